"""The last word of a multi-process trainer is one line, even when the JAX runtime aborts natively, and no trainer
outlives the process that started it.

A process of a multi-process run (`python -m longstraw_jax.run` with --coordinator / JAX_* / a detected cluster) runs
the trainer as a child process of its own (`run`) and waits for it: the child's exit status passes through; when the
child dies by a signal (the runtime's abort when the coordinator or another process is lost, SIGABRT; SIGKILL from
the kernel's out-of-memory killer or a user; ...), the supervisor prints one line naming the process, the signal, the
step and the last complete checkpoint (the child reports where it stands through a pipe: `report`), then ends by the
same signal. SIGINT, SIGTERM and SIGHUP are forwarded to the child (which has its own process group, so a
terminal's Ctrl-C reaches it once); after SIGTERM or SIGHUP a child still running TERM_GRACE_S later is killed (JAX's
preemption notifier catches SIGTERM in a multi-process run, so the trainer would not end by it).

`die_with_parent`: a process started by the local launcher or by a supervisor (LONGSTRAW_PARENT="PID:SIGNAL") gets
SIGNAL when its parent dies (Linux: prctl PR_SET_PDEATHSIG; elsewhere a thread polls the parent's pid).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

STATUS_FD_ENV = "LONGSTRAW_STATUS_FD"  # set in the supervised child: where it reports where it stands
PARENT_ENV = "LONGSTRAW_PARENT"  # "PID:SIGNAL": end with SIGNAL when process PID (the parent) is gone
_PR_SET_PDEATHSIG = 1
TERM_GRACE_S = 10.0  # after a forwarded SIGTERM or SIGHUP, the child is killed if still running

_status_fd: int | None = None


def supervised() -> bool:
    """Whether this process is a supervised trainer (the supervisor set STATUS_FD_ENV)."""
    return STATUS_FD_ENV in os.environ


def report(who: str, during: str, checkpoint: str) -> None:
    """The supervised child says where it stands ("process 1 of 2", "during step 3" or "", "the last complete
    checkpoint is ..."); the supervisor uses it if the child dies by a signal. No supervisor: nothing."""
    global _status_fd
    if _status_fd is None:
        if not supervised():
            return
        _status_fd = int(os.environ[STATUS_FD_ENV])
    with contextlib.suppress(OSError):
        os.write(_status_fd, ("\t".join(" ".join(part.split()) for part in (who, during, checkpoint)) + "\n").encode())


def signal_line(context: tuple[str, str, str] | None, signum: int) -> str:
    """The supervisor's one line for a child ended by signal `signum`; context: its last `report`, if any."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    why = {signal.SIGABRT: "the JAX runtime aborted: it lost the coordinator or another process, see the lines above",
           signal.SIGKILL: "killed: out of memory, or by the scheduler or a user",
           signal.SIGSEGV: "a crash in native code"}.get(signum, "")
    who, during, checkpoint = context or ("the trainer", "before it joined the other processes", "")
    return (f"error: {who}: ended by {name}{f' ({why})' if why else ''}{' ' + during if during else ''}"
            + (f"; {checkpoint}" if checkpoint else ""))


def run(argv: list[str], command: list[str] | None = None) -> int:
    """Run `python -m longstraw_jax.run argv` (or `command`) as a supervised child -> its exit status (a child ended
    by signal N: the one line, then this process ends by N too; 128 + N for a signal that would dump core)."""
    read_end, write_end = os.pipe()
    env = dict(os.environ, **{STATUS_FD_ENV: str(write_end), PARENT_ENV: f"{os.getpid()}:SIGKILL"})
    command = command or [sys.executable, "-m", "longstraw_jax.run", *argv]
    child = subprocess.Popen(command, env=env, pass_fds=(write_end,),
                             process_group=0)  # own group: signals reach it only through forward()
    os.close(write_end)
    latest = []

    def read():
        with os.fdopen(read_end, "r", errors="replace") as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 3:
                    latest[:] = [tuple(parts)]

    reader = threading.Thread(target=read, name="longstraw-supervisor-status", daemon=True)
    reader.start()

    def forward(signum, frame):
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)
        if signum != signal.SIGINT:  # JAX's preemption notifier catches SIGTERM: the child gets TERM_GRACE_S
            timer = threading.Timer(TERM_GRACE_S, lambda: child.poll() is None and child.kill())
            timer.daemon = True
            timer.start()

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        returncode = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    reader.join(timeout=2)
    if returncode >= 0:
        return returncode
    signum = -returncode
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        print(signal_line(latest[0] if latest else None, signum), file=sys.stderr, flush=True)
    if signum in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGQUIT):
        return 128 + signum  # no second core dump
    with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set (it is the default anyway)
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    time.sleep(5)  # a signal that does not end the process by default (e.g. SIGCHLD): the status instead
    return 128 + signum


def die_with_parent(environ=os.environ) -> None:
    """When PARENT_ENV names this process's parent: receive its signal when the parent dies (at once if it already
    has). Nothing otherwise."""
    spec = environ.get(PARENT_ENV)
    if not spec:
        return
    pid_text, _, sig_name = spec.partition(":")
    try:
        parent, sig = int(pid_text), signal.Signals[sig_name or "SIGTERM"]
    except (ValueError, KeyError):
        return
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    else:
        def poll():
            while os.getppid() == parent:
                time.sleep(0.5)
            os.kill(os.getpid(), sig)

        threading.Thread(target=poll, name="longstraw-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)
