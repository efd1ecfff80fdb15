"""No process of a multi-process run waits for ever: a watchdog in every process (two daemon threads) that ends the
process with one line when

- another process stops answering: every process posts a heartbeat (a counter and its current step) to the
  coordinator's key-value store every second; one whose heartbeat has not changed for LONGSTRAW_HEARTBEAT_TIMEOUT_S
  (killed, stopped, its host lost) is named;
- the coordinator stops answering (no reply for that long) or is lost (the key-value store fails);
- a training step does not finish within `step_bound` (max(--step-timeout, 10 x the median step so far, the first
  step left out; the factor is LONGSTRAW_STEP_BOUND_FACTOR); until a step after the first has been timed, 10 x
  --step-timeout: the first step compiles): a collective that never completes;
- another process stopped the run with an error (its one line, relayed).

The line names the process and the last complete checkpoint. The process then ends with os._exit (status 2): the
main thread is usually stuck in native code (a collective) and JAX's exit handlers would wait for the others.
Before it does, the line is posted to the others (they print it too and exit), and process 0, which hosts the
coordinator, waits briefly for them to acknowledge: when the coordinator goes, JAX aborts the other processes
natively. JAX's own heartbeat limit is set beyond ours (trainer/distributed.py), so our line comes first.

`start` makes the watchdog of this process; the trainer calls `step(n)` around each step and `note_checkpoint`
after each save; `leave` ends it (cli.main). Without a started watchdog (one process) they do nothing.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import time

PREFIX = "longstraw/watchdog"
DEFAULT_STEP_TIMEOUT_S = 600.0  # --step-timeout's default
FIRST_STEP_FACTOR = 10  # the first step compiles: 10 x --step-timeout
MEDIAN_FACTOR = 10  # later steps: 10 x the median step (at least --step-timeout); LONGSTRAW_STEP_BOUND_FACTOR
_ACK_WAIT_S = 5.0

_current: Watchdog | None = None


def step_bound(durations: list[float], step_timeout: float, median_factor: float = MEDIAN_FACTOR) -> float:
    """Seconds a step may take: FIRST_STEP_FACTOR x step_timeout while no step after the first (which compiles) has
    been timed (`durations` leaves the first out), else max(step_timeout, median_factor x the median of
    `durations`)."""
    if not durations:
        return FIRST_STEP_FACTOR * step_timeout
    return max(step_timeout, median_factor * statistics.median(durations))


def silent_peers(seen: dict[int, tuple[str, float]], now: float, limit: float) -> list[int]:
    """The processes whose heartbeat (value, time it last changed) has not changed for more than `limit` seconds,
    leaving out those that finished ("done")."""
    return sorted(p for p, (value, since) in seen.items() if value != "done" and now - since > limit)


def _first_line(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return text if len(text) <= 160 else text[:157] + "..."


class Watchdog:
    """The watchdog of process `me` of `n` (see the module docstring). client: JAX's DistributedRuntimeClient;
    heartbeat_s: silence that declares a process dead; step_timeout: --step-timeout; median_factor: the step bound's
    multiple of the median step; coordinator: its address, for messages; exit(text, status): prints the line `text`
    and ends the process (injectable for tests)."""

    def __init__(self, client, me: int, n: int, heartbeat_s: float, step_timeout: float, coordinator: str | None,
                 exit, interval_s: float = 1.0, clock=time.monotonic, median_factor: float = MEDIAN_FACTOR):
        self.client, self.me, self.n = client, me, n
        self.heartbeat_s, self.step_timeout, self.interval_s = heartbeat_s, step_timeout, interval_s
        self.median_factor = median_factor
        self.coordinator = coordinator or "(detected)"
        self.exit, self.clock = exit, clock
        self.lock = threading.Lock()
        self.leaving = threading.Lock()  # held by whoever ends the process: one line only
        self.stopped = threading.Event()
        now = clock()
        self.seen = {p: ("", now) for p in range(n) if p != me}
        self.last_reply = now
        self.current_step, self.step_started, self.durations, self.steps_timed = None, None, [], 0
        self.checkpoint = "no checkpoint was saved yet"
        self.threads = [threading.Thread(target=self._beat, name="longstraw-heartbeat", daemon=True),
                        threading.Thread(target=self._watch, name="longstraw-watchdog", daemon=True)]

    # ----- the trainer's hooks ----------------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        with self.lock:
            self.current_step, self.step_started = step, self.clock()
        _report_context(self.context())

    def end_step(self, step: int) -> None:
        with self.lock:
            if self.step_started is not None and self.steps_timed:  # the first step compiles: not in the median
                self.durations.append(self.clock() - self.step_started)
            self.steps_timed += 1
            self.current_step, self.step_started = None, None
        _report_context(self.context())

    def note_checkpoint(self, text: str) -> None:
        """text: where the run stands, e.g. "the last complete checkpoint is step 2 (out/checkpoints/2); ..."."""
        with self.lock:
            self.checkpoint = text
        _report_context(self.context())

    def context(self) -> tuple[str, str, str]:
        """(who, during, checkpoint): ("process 1 of 2", "during step 3" or "", "the last complete checkpoint
        is ...") for messages."""
        with self.lock:
            during = f"during step {self.current_step}" if self.current_step is not None else ""
            return f"process {self.me} of {self.n}", during, self.checkpoint

    def line(self, what: str) -> str:
        """"process 0 of 2: <what> during step 3; the last complete checkpoint is ..."."""
        who, during, checkpoint = self.context()
        return f"{who}: {what}{' ' + during if during else ''}; {checkpoint}"

    # ----- threads ----------------------------------------------------------------------------------------------

    def start(self) -> Watchdog:
        for t in self.threads:
            t.start()
        return self

    def _beat(self) -> None:
        count = 0
        while not self.stopped.is_set():
            count += 1
            try:
                self.client.key_value_set(f"{PREFIX}/alive/{self.me}", f"{count}:{self.current_step or 0}",
                                          allow_overwrite=True)
                alive = self.client.key_value_dir_get(f"{PREFIX}/alive/")
                aborts = self.client.key_value_dir_get(f"{PREFIX}/abort/")
            except Exception as e:  # the key-value store failed: the coordinator is gone
                if not self.stopped.is_set():
                    self.fail(self.line(f"lost the coordinator (process 0 at {self.coordinator}: "
                                        f"{_first_line(e)})"))
                return
            now = self.clock()
            with self.lock:
                self.last_reply = now
                for key, value in alive:
                    p = int(key.rsplit("/", 1)[1])
                    if p in self.seen and self.seen[p][0] != value:
                        self.seen[p] = (value, now)
            for key, message in aborts:
                p = int(key.rsplit("/", 1)[1])
                if p != self.me:
                    self.fail(message, relay=True)
                    return
            self.stopped.wait(self.interval_s)

    def _watch(self) -> None:
        while not self.stopped.wait(min(0.25, self.interval_s)):
            line = self.check(self.clock())
            if line is not None:
                self.fail(line)
                return

    def check(self, now: float) -> str | None:
        """The line to end the process with at time `now`, or None while all is well."""
        with self.lock:
            silent = silent_peers(self.seen, now, self.heartbeat_s)
            no_reply = now - self.last_reply
            step, started, bound = self.current_step, self.step_started, step_bound(self.durations, self.step_timeout,
                                                                                     self.median_factor)
            peers_steps = {p: value.split(":")[-1] for p, (value, _) in self.seen.items()}
            recently_silent = silent_peers(self.seen, now, 3 * self.interval_s + 1)
        if self.me != 0 and no_reply > self.heartbeat_s:
            return self.line(f"the coordinator (process 0 at {self.coordinator}) stopped answering (no reply for "
                             f"{no_reply:.0f} s)")
        if silent:
            return self.line(f"process {silent[0]} stopped answering (no heartbeat for {self.heartbeat_s:g} s: "
                             "killed, stopped or its host lost)")
        if step is not None and now - started > bound:
            if recently_silent:
                who = f"process {recently_silent[0]} stopped answering"
            else:
                behind = {p: s for p, s in peers_steps.items() if s not in (str(step), "", "done")}
                who = ("every process is alive and in this step: a collective never completed" if not behind else
                       ", ".join(f"process {p} is {f'in step {s}' if s != '0' else 'between steps'}"
                                 for p, s in sorted(behind.items())))
            measured = (f"{self.median_factor:g} x the median step {statistics.median(self.durations):.2g} s; "
                        if self.durations else "")
            me, _, checkpoint = self.context()
            return (f"{me}: step {step} did not finish within {bound:.0f} s ({measured}--step-timeout "
                    f"{self.step_timeout:g}): {who}; {checkpoint}")
        return None

    # ----- ending -----------------------------------------------------------------------------------------------

    def fail(self, line: str, relay: bool = False, status: int = 2) -> None:
        """Print `error: line`, tell the other processes (unless relaying theirs), and end this process."""
        if not self.leaving.acquire(blocking=False):
            return  # another thread is ending the process
        self._tell_others(None if relay else f"{line} (noticed by process {self.me})")
        self.exit(f"error: {line}", status)

    def _tell_others(self, line: str | None) -> None:
        """Post `line` as this process's abort (None: only acknowledge the others'); process 0 then waits up to a few
        seconds for every other process that is still alive to acknowledge, so that they print before the
        coordinator they depend on goes away. Each call to the store runs in a helper thread with a time limit."""
        def post():
            if line is not None:
                self.client.key_value_set(f"{PREFIX}/abort/{self.me}", line, allow_overwrite=True)
            self.client.key_value_set(f"{PREFIX}/ack/{self.me}", "1", allow_overwrite=True)

        if not _within(post, 2.0) or self.me != 0:
            return
        deadline = self.clock() + _ACK_WAIT_S
        with self.lock:
            alive = set(self.seen) - set(silent_peers(self.seen, self.clock(), 3 * self.interval_s + 1))
        while self.clock() < deadline:
            acks = []
            if not _within(lambda: acks.extend(self.client.key_value_dir_get(f"{PREFIX}/ack/")), 1.0):
                return
            if alive <= {int(k.rsplit("/", 1)[1]) for k, _ in acks}:
                return
            time.sleep(0.1)

    def leave(self, status: int, line: str | None) -> int:
        """The run ends in the main thread with `status` (0 done, 130 Ctrl-C, else a failure) and `line` to print
        (or None). A failure is posted to the other processes and ends this process at once (os._exit through
        `exit`); otherwise the heartbeat says "done" (a finished process is not a silent one) and the threads stop.
        -> status."""
        if not self.leaving.acquire(blocking=False):
            self.stopped.wait()  # a watchdog thread is ending the process right now
            return status
        if status not in (0, 130):
            reason = (line or f"status {status}").removeprefix("error: ")
            self._tell_others(f"process {self.me} of {self.n} stopped: {reason}")
            self.exit(line, status)
            return status
        self.stopped.set()
        for t in self.threads:
            t.join(timeout=2 * self.interval_s + 1)
        with contextlib.suppress(Exception):
            _within(lambda: self.client.key_value_set(f"{PREFIX}/alive/{self.me}", "done", allow_overwrite=True),
                    2.0)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        return status


def _within(call, seconds: float) -> bool:
    """Run call() in a daemon thread; True when it returned without an exception within `seconds`."""
    result = []

    def target():
        with contextlib.suppress(Exception):
            call()
            result.append(True)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    return bool(result)


def _report_context(context: tuple[str, str, str]) -> None:
    from longstraw_jax.trainer import supervise

    supervise.report(*context)


def start(client, me: int, n: int, heartbeat_s: float, step_timeout: float, coordinator: str | None,
          exit, median_factor: float = MEDIAN_FACTOR) -> Watchdog:
    """This process's watchdog of a joined multi-process run (process `me` of `n` >= 2; client: JAX's
    DistributedRuntimeClient; exit(text, status) ends the process), started (trainer/distributed.py:start_jax)."""
    global _current
    _current = Watchdog(client, me, n, heartbeat_s, step_timeout, coordinator, exit=exit,
                        median_factor=median_factor).start()
    _report_context(_current.context())
    return _current


@contextlib.contextmanager
def step(number: int):
    """Around training step `number`: the step bound applies while inside."""
    if _current is None:
        yield
        return
    _current.begin_step(number)
    yield
    _current.end_step(number)


_PEER_LOST = ("gloo", "connection reset", "connection refused", "connection closed", "broken pipe",
              "deadline_exceeded", "socket closed")


def is_peer_lost(error: BaseException) -> bool:
    """Whether `error` is the runtime's report of a collective that lost a peer (gloo's connection reset, a deadline
    in a collective, ...): the watchdog can say which process went away."""
    return (type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError")
            and any(word in str(error).lower() for word in _PEER_LOST))


def peer_lost(error: BaseException) -> int:
    """The main thread's collective failed because a peer went away (`is_peer_lost`): wait for the watchdog, which
    names the silent process within the heartbeat limit and ends this process with that line; if it has not within
    that limit + 5 s, end with one line saying the collective failed -> 2."""
    watchdog = _current
    deadline = time.monotonic() + watchdog.heartbeat_s + 5.0
    while time.monotonic() < deadline and not watchdog.stopped.is_set():
        time.sleep(0.2)
    me, during, checkpoint = watchdog.context()
    return leave(2, f"error: {me}: a collective failed{' ' + during if during else ''} ({_first_line(error)}); "
                    f"{checkpoint}")


def active() -> bool:
    """Whether this process runs a watchdog (a multi-process run that has joined)."""
    return _current is not None


def note_checkpoint(text: str) -> None:
    if _current is not None:
        _current.note_checkpoint(text)


def leave(status: int, line: str | None) -> int:
    """End the run with `status`, printing `line` (stderr) -> status; see Watchdog.leave (one process: print only)."""
    global _current
    if _current is None:
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        return status
    watchdog, _current = _current, None
    return watchdog.leave(status, line)
