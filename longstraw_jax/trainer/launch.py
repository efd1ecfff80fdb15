"""`python -m longstraw_jax.launch --processes N -- <run arguments>`: a multi-process run on this machine.

Starts N processes of `python -m longstraw_jax.run <run arguments> --coordinator 127.0.0.1:<free port>
--num-processes N --process-id I` (I = 0..N-1). Each gets A*B/N of `--mesh AxB`'s devices (on CPU: that many
simulated devices; trainer/distributed.py), so `--processes 2 -- --mesh 2x4` is two processes of 4 CPU devices each, the
`data` axis spanning them: the local stand-in for 2 hosts of 4 accelerators.

Every output line of process I is printed with the prefix `[pI] ` (stdout and stderr merged, in order per process);
the launcher's own lines start with `[launch] `. When a process ends with a non-zero status, the others get
`--grace` seconds to end by themselves (JAX's heartbeat stops them when a peer died) and are then killed; the
launcher exits with that first non-zero status (128 + N for a process killed by signal N). Ctrl-C (SIGINT), SIGTERM
and SIGHUP (a dropped ssh session) are forwarded to every process (each runs in its own process group, so it gets
the signal once). The processes never outlive the launcher: each gets SIGTERM when it dies, even by SIGKILL
(trainer/supervise.py:die_with_parent).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from longstraw_jax.sharding.mesh import parse_mesh_spec
from longstraw_jax.trainer import supervise

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def mesh_of(run_args: list[str]) -> str | None:
    """The value of --mesh in the run's arguments (last one wins, as argparse does), or None."""
    mesh = None
    for i, arg in enumerate(run_args):
        if arg == "--mesh" and i + 1 < len(run_args):
            mesh = run_args[i + 1]
        elif arg.startswith("--mesh="):
            mesh = arg.split("=", 1)[1]
    return mesh


def check_args(processes: int, run_args: list[str]) -> None:
    """The launcher's checks before starting anything: N >= 1, a --mesh whose A*B devices N divides, and no
    multi-process flags of the run's own (the launcher sets them)."""
    if processes < 1:
        raise ValueError(f"--processes={processes} must be >= 1")
    taken = [a for a in run_args if a.split("=")[0] in ("--coordinator", "--num-processes", "--process-id")]
    if taken:
        raise ValueError(f"{', '.join(taken)}: the launcher sets --coordinator, --num-processes and --process-id")
    mesh = mesh_of(run_args)
    if mesh is None:
        raise ValueError("the run arguments need --mesh AxB (the global mesh, its A*B devices split over the "
                         "processes)")
    size = math.prod(parse_mesh_spec(mesh))
    if size % processes:
        raise ValueError(f"--mesh {mesh} has {size} devices, which --processes={processes} does not divide")


def commands(processes: int, run_args: list[str], port: int, python: str = sys.executable) -> list[list[str]]:
    """The N command lines (pure: what `launch` runs)."""
    return [[python, "-m", "longstraw_jax.run", *run_args, "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", str(processes), "--process-id", str(i)] for i in range(processes)]


def exit_status(returncode: int) -> int:
    """A child's returncode as a shell exit status: -N (killed by signal N) -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"status {returncode}"


def _pump(stream, prefix: str, lock) -> None:
    """Copy a process's lines to stdout with `prefix`; reading on when stdout is gone (a closed terminal), so that
    the process never blocks on a full pipe."""
    for line in iter(stream.readline, ""):
        with lock, contextlib.suppress(OSError, ValueError):
            sys.stdout.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            sys.stdout.flush()
    stream.close()


def _say(lock, text: str) -> None:
    with lock, contextlib.suppress(OSError, ValueError):
        print(f"[launch] {text}", flush=True)


def launch(processes: int, run_args: list[str], grace: float = 10.0, env=None) -> int:
    """Run the N processes to the end -> the exit status (0, or the first non-zero one)."""
    check_args(processes, run_args)
    lock = threading.RLock()  # reentrant: the signal handler may print while the main thread prints
    say = lambda text: _say(lock, text)
    port = free_port()
    # the workers end with SIGTERM when the launcher dies, however it dies
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1",
               **{supervise.PARENT_ENV: f"{os.getpid()}:SIGTERM"})
    procs, pumps = [], []
    for i, cmd in enumerate(commands(processes, run_args, port)):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)  # own process group: a terminal's Ctrl-C reaches it once
        procs.append(proc)
        pumps.append(threading.Thread(target=_pump, args=(proc.stdout, f"[p{i}] ", lock), daemon=True))
        pumps[-1].start()
    say(f"{processes} processes, coordinator 127.0.0.1:{port}: {' '.join(commands(processes, run_args, port)[0][1:])}"
        " (process 0)")

    def forward(signum, frame):
        say(f"{signal.Signals(signum).name}: forwarding to every process")
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    first_failure = None
    try:
        while [p.poll() for p in procs].count(None):  # poll every process (any() would stop at the first)
            failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed and first_failure is None:
                first_failure = failed[0]
                say(f"process {first_failure} ended with {_describe(procs[first_failure].returncode)}; the others "
                    f"get {grace:g} s to stop by themselves, then are killed")
                deadline = time.monotonic() + grace
                while time.monotonic() < deadline and [p.poll() for p in procs].count(None):
                    time.sleep(0.1)
                for i, p in enumerate(procs):
                    if p.poll() is None:
                        say(f"process {i} still running after {grace:g} s: killing it")
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
                    elif i != first_failure:
                        say(f"process {i} ended by itself with {_describe(p.returncode)}")
            time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for t in pumps:
            t.join(timeout=5)
    if first_failure is None:
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        first_failure = failed[0] if failed else None
    status = 0 if first_failure is None else exit_status(procs[first_failure].returncode)
    say(f"done: exit status {status} ({', '.join(f'p{i} {_describe(p.returncode)}' for i, p in enumerate(procs))})")
    return status


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m longstraw_jax.launch", description=__doc__.split("\n\n")[0],
                                usage="%(prog)s --processes N [--grace S] -- <python -m longstraw_jax.run arguments>")
    p.add_argument("--processes", type=int, required=True, metavar="N", help="processes to start on this machine")
    p.add_argument("--grace", type=float, default=10.0, metavar="S",
                   help="after a process fails, seconds the others get to stop by themselves before being killed")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, run_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(own)
    if not (math.isfinite(args.grace) and args.grace >= 0):
        print(f"error: --grace={args.grace} must be a finite number >= 0", file=sys.stderr)
        return 2
    try:
        return launch(args.processes, run_args, args.grace)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
