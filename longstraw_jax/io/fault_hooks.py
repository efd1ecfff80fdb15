"""TEST-ONLY fault injection for tests/trainer/test_faults.py: kill or interrupt the trainer at a chosen point, exactly.

Set the environment variable `LONGSTRAW_TEST_FAULT=<point>:<step>:<signal>` (e.g. `save:4:SIGKILL`) and the
trainer sends itself `<signal>` when it reaches `<point>` during step `<step>`:

- `save`: inside the checkpoint save of step N, after every file of it is written into Orbax's temporary
  directory (`checkpoints/N.orbax-checkpoint-tmp`) and before that directory is renamed to `checkpoints/N`;
- `step`: in the middle of step N, after its batch is sampled and scored, before the update.

`<point>:<step>:<signal>:<process>` fires only in process number `<process>` of a multi-process run (every process
of a launch inherits the variable). `<signal>` is a signal's name (SIGKILL, SIGINT, SIGSTOP: the process stops, as if
its host froze), or HANG: the main thread sleeps for ever while the process's other threads (its heartbeat) go on,
as in a collective that never completes.

Unset (the normal case) nothing happens: each point costs one dictionary lookup. Never set it outside tests.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time

ENV = "LONGSTRAW_TEST_FAULT"


HANG = "HANG"


def armed(point: str, step: int) -> signal.Signals | str | None:
    """The signal (or HANG) the test asked for at `point` of `step`, or None."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    name, at, sig, *process = spec.split(":")
    if name != point or int(at) != step:
        return None
    if process:
        import jax  # initialised by now: the trainer is running

        if jax.process_index() != int(process[0]):
            return None
    return HANG if sig == HANG else signal.Signals[sig]


def fire(point: str, step: int) -> None:
    """Send this process the signal armed for `point` of `step` (HANG: sleep for ever), if any."""
    sig = armed(point, step)
    if sig == HANG:
        while True:
            time.sleep(3600)
    if sig is not None:
        os.kill(os.getpid(), sig)


@contextlib.contextmanager
def around_orbax_commit(step: int):
    """While saving `step`: fire the `save` point just before Orbax renames the temporary directory (its atomic
    commit). Patches Orbax's AtomicRenameTemporaryPath.finalize for the duration, only when the point is armed."""
    if armed("save", step) is None:
        yield
        return
    # here, not at module level: a private Orbax module, touched only when a test arms the hook
    from orbax.checkpoint._src.path import atomicity

    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self, *args, **kwargs):
        if self.get_final().name == str(step):  # the step directory, not one of its items
            fire("save", step)
        return await original(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize
    try:
        yield
    finally:
        atomicity.AtomicRenameTemporaryPath.finalize = original
