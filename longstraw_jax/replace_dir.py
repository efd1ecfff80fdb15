"""Replacing a directory so that a crash never leaves it half-written: the new contents are written into a sibling
staging directory, synced, and renamed over the old one (which is renamed aside first and removed last, so a
complete version, old or new, exists under one of the two names at every moment)."""
from __future__ import annotations

import os
import shutil


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
