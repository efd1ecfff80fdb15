"""Replacing a directory so that a crash never leaves it half-written: the new contents are written into a sibling
staging directory, synced, and renamed over the old one (which is renamed aside first and removed last, so a
complete version, old or new, exists under one of the two names at every moment)."""
from __future__ import annotations

import contextlib
import os
import shutil
from typing import Iterator


def fsync_tree(directory: str) -> None:
    """Flush every file below `directory` to disk (before a rename makes it visible)."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def swap_in(staging: str, path: str, tag: str) -> None:
    """Make the complete directory `staging` appear at `path`, replacing whatever is there. tag names the aside copy
    (`{path}.old-{tag}-{pid}`) so that concurrent tools do not collide."""
    fsync_tree(staging)
    if os.path.lexists(path):
        old = f"{path}.old-{tag}-{os.getpid()}"
        os.rename(path, old)
        os.rename(staging, path)
        shutil.rmtree(old)
    else:
        os.rename(staging, path)


@contextlib.contextmanager
def staged(path: str, tag: str) -> Iterator[str]:
    """Yield a fresh staging directory beside `path`; when the block completes it replaces `path` (`swap_in`), on
    any error (a kill included: the next run finds only the staging directory) it is removed and `path` is
    untouched."""
    staging = f"{path}.tmp-{tag}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    swap_in(staging, path, tag)
