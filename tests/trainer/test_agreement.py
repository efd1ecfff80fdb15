"""What the processes of a multi-process run compare before any work, and how a run that stops making progress
ends, without starting processes: the fingerprint and its diff (trainer/agreement.py), the watchdog's bounds and
lines on a fake clock and key-value store (trainer/watchdog.py), the supervisor's line for a child ended by a
signal and the parent-death request (trainer/supervise.py), the join time-out's line (trainer/distributed.py).
The multi-process runs themselves: tests/trainer/test_distributed.py."""
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from longstraw_jax.trainer import agreement, distributed, supervise, watchdog
from longstraw_jax.trainer.config import RunConfig, parse_args

ENV = {"longstraw-jax source": "abc", "longstraw-jax version": "0.1.0", "jax version": "1", "jaxlib version": "1"}


def fp(args, **kw):
    config, explicit = parse_args(args)
    return agreement.fingerprint(config, explicit, environment=kw.pop("environment", ENV))


def test_fingerprint_leaves_out_per_process_fields_and_names_flags():
    a = fp(["--mesh", "2x4", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "0"])
    b = fp(["--mesh", "2x4", "--coordinator", "other:2", "--num-processes", "2", "--process-id", "1"])
    assert a == b and "--process-id" not in a and "--coordinator" not in a and a["--mesh"] == "2x4"
    assert agreement.disagreement([a, b]) is None


def test_disagreement_names_every_field_and_process():
    base = ["--mesh", "2x4", "--steps", "3", "--seed", "3", "-G", "3"]
    other = ["--mesh", "2x2", "--steps", "4", "--seed", "5", "-G", "4", "--mode", "detached"]
    line = agreement.disagreement([fp(base), fp(other)])
    assert line == ("processes disagree on --group-size (process 0: 3, process 1: 4), --steps (process 0: 3, "
                    "process 1: 4), --mode (process 0: exact, process 1: detached), --mesh (process 0: 2x4, process "
                    "1: 2x2), --seed (process 0: 3, process 1: 5); every process must be started with the same "
                    "options")
    # many processes: grouped by value; a field only one process has is "(missing)"; long values are cut
    prints = [{"--steps": "3"}] * 7 + [{"--steps": "4", "x": "y" * 100}]
    assert agreement.disagreement(prints) == (
        "processes disagree on --steps (processes 0-6: 3, process 7: 4), x (processes 0-6: (missing), process 7: "
        f"{'y' * 57}...); every process must be started with the same options")
    assert agreement.process_list([0, 1, 3, 5, 6, 7]) == "processes 0, 1, 3, 5-7"
    # the environment: another version of the code or of JAX is a difference too
    assert "jax version (process 0: 1, process 1: 2)" in agreement.disagreement(
        [fp(base), fp(base, environment=dict(ENV, **{"jax version": "2"}))])


def test_input_files_are_compared_by_contents(tmp_path):
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text('{"a": 1}\n')
    a = fp(["--rollouts", str(rollouts)])
    rollouts.write_text('{"a": 2}\n')  # same size, other bytes
    b = fp(["--rollouts", str(rollouts)])
    assert a["--rollouts contents"].startswith("9 bytes, sha256 ")
    assert "--rollouts contents (process 0: 9 bytes, sha256" in agreement.disagreement([a, b])
    model = tmp_path / "init"
    model.mkdir()
    (model / "config.json").write_text("{}")
    one = fp(["--init-from", str(model)])["--init-from contents"]
    (model / "params").mkdir()
    (model / "params" / "w").write_bytes(b"1234")
    assert one.startswith("1 files, 2 bytes") and fp(["--init-from", str(model)])["--init-from contents"] != one
    # an option whose metavar names a path counts (a dataset option added later would); outputs and words do not
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    assert agreement.is_input_path(fields["tokenizer"]) and agreement.is_input_path(fields["model"])
    assert not agreement.is_input_path(fields["out"]) and not agreement.is_input_path(fields["task"])
    assert "--out contents" not in fp(["--out", str(tmp_path)])
    # on --resume, which options were given decides what the checkpoint overrides
    assert fp(["--resume", "--eval-every", "20"])["options given"] == "--eval-every --resume"
    assert "options given" not in fp(["--eval-every", "20"])


def test_fingerprint_of_this_checkout():
    real = agreement.fingerprint(RunConfig())
    assert len(real["longstraw-jax source"]) == 16 and real["jax version"] != "not installed"


def test_join_timeout_line():
    assert distributed.not_joined(0, 2, 60) == ("process 1 of 2 did not join within 60 s (not started, failed before "
                                               "joining, or started with another --coordinator or --num-processes)")
    assert distributed.not_joined(1, 2, 5).startswith("process 0 of 2 did not join within 5 s")
    assert distributed.not_joined(2, 4, 5).startswith("not every one of the 4 processes joined within 5 s")
    assert distributed.not_joined(2, 4, 5).endswith("; this is process 2)")


class FakeStore:
    """The coordinator's key-value store as the watchdog uses it."""

    def __init__(self):
        self.data = {}
        self.broken = None

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.broken:
            raise RuntimeError(self.broken)
        self.data[key] = value

    def key_value_dir_get(self, prefix):
        if self.broken:
            raise RuntimeError(self.broken)
        return [(k, v) for k, v in sorted(self.data.items()) if k.startswith(prefix)]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make(me=0, n=2, heartbeat=20.0, step_timeout=5.0):
    clock, exits = Clock(), []
    dog = watchdog.Watchdog(FakeStore(), me, n, heartbeat, step_timeout, "h:1", exit=lambda t, s: exits.append((t, s)),
                            clock=clock)
    dog.note_checkpoint("the last complete checkpoint is step 2 (o/checkpoints/2)")
    return dog, clock, exits


def test_step_bound():
    assert watchdog.step_bound([], 5) == 50  # no step after the first timed yet: it compiles
    assert watchdog.step_bound([1.0, 2.0, 30.0], 5) == 20  # 10 x the median
    assert watchdog.step_bound([0.1], 5) == 5  # at least --step-timeout
    assert watchdog.step_bound([1.0, 2.0, 30.0], 5, median_factor=3) == 6  # LONGSTRAW_STEP_BOUND_FACTOR
    assert distributed.env_timeout("step_factor", {}) == 10
    assert distributed.env_timeout("step_factor", {"LONGSTRAW_STEP_BOUND_FACTOR": "2.5"}) == 2.5
    with pytest.raises(distributed.DistributedError, match="LONGSTRAW_STEP_BOUND_FACTOR='0' must be a number > 0"):
        distributed.env_timeout("step_factor", {"LONGSTRAW_STEP_BOUND_FACTOR": "0"})


def test_watchdog_names_a_silent_process_and_a_step_that_does_not_finish():
    dog, clock, _ = make()
    dog.begin_step(1)
    clock.now += 30
    dog.end_step(1)  # the first step (compiling) is not timed
    assert dog.durations == []
    for step in (2, 3):
        dog.begin_step(step)
        clock.now += 1.0
        dog.end_step(step)
    dog.seen[1] = ("7:0", clock.now)  # process 1 beats, between steps
    dog.begin_step(4)
    clock.now += 9.0
    assert dog.check(clock.now) is None  # within max(5, 10 x 1 s)
    clock.now += 2.0
    assert dog.check(clock.now) == (
        "process 0 of 2: step 4 did not finish within 10 s (10 x the median step 1 s; --step-timeout 5): process 1 "
        "stopped answering; the last complete checkpoint is step 2 (o/checkpoints/2)")
    dog.seen[1] = ("8:4", clock.now)  # alive and in the same step: a collective that never completes
    assert "every process is alive and in this step: a collective never completed" in dog.check(clock.now)
    dog.seen[1] = ("9:5", clock.now)
    assert "): process 1 is in step 5;" in dog.check(clock.now)
    clock.now += 25  # no heartbeat for more than 20 s
    assert dog.check(clock.now) == (
        "process 0 of 2: process 1 stopped answering (no heartbeat for 20 s: killed, stopped or its host lost) during "
        "step 4; the last complete checkpoint is step 2 (o/checkpoints/2)")
    dog.seen[1] = ("done", clock.now - 100)  # a finished process is not a silent one
    dog.end_step(4)
    assert dog.check(clock.now) is None


def test_watchdog_coordinator_lost_and_relayed_failures():
    dog, clock, exits = make(me=1)
    dog.last_reply = clock.now - 21
    assert dog.check(clock.now).startswith("process 1 of 2: the coordinator (process 0 at h:1) stopped answering "
                                           "(no reply for 21 s); the last complete")
    # the store fails: one line naming the coordinator, posted nowhere (it is gone), status 2
    dog.client.broken = "UNAVAILABLE: Socket closed\nmore"
    dog._beat()
    assert exits == [("error: process 1 of 2: lost the coordinator (process 0 at h:1: UNAVAILABLE: Socket closed); "
                      "the last complete checkpoint is step 2 (o/checkpoints/2)", 2)]
    # another process's failure is printed as it was posted, acknowledged, and ends this one
    dog, clock, exits = make(me=1)
    dog.client.data[f"{watchdog.PREFIX}/abort/0"] = "process 0 of 2: something (noticed by process 0)"
    dog._beat()
    assert exits == [("error: process 0 of 2: something (noticed by process 0)", 2)]
    assert dog.client.data[f"{watchdog.PREFIX}/ack/1"] == "1"
    # a failure this process notices is posted for the others, with who noticed it
    dog, clock, exits = make(me=0)
    dog.seen[1] = ("1:0", clock.now - 100)  # silent: process 0 does not wait for its acknowledgement
    dog.fail("process 0 of 2: x")
    assert dog.client.data[f"{watchdog.PREFIX}/abort/0"] == "process 0 of 2: x (noticed by process 0)"
    assert exits == [("error: process 0 of 2: x", 2)]
    dog.fail("again")  # one line only
    assert len(exits) == 1


def test_watchdog_leave():
    dog, clock, exits = make(me=1)
    assert dog.leave(2, "error: bad") == 2
    assert exits == [("error: bad", 2)]
    assert dog.client.data[f"{watchdog.PREFIX}/abort/1"] == "process 1 of 2 stopped: bad"
    dog, clock, exits = make(me=1)
    dog.start()
    assert dog.leave(0, None) == 0 and exits == []
    assert dog.client.data[f"{watchdog.PREFIX}/alive/1"] == "done"
    assert not any(t.is_alive() for t in dog.threads)
    assert watchdog.leave(3, None) == 3  # no watchdog (one process): the status only


def test_supervisor_line_and_status_pipe():
    context = ("process 1 of 2", "during step 3", "the last complete checkpoint is step 2 (o/checkpoints/2)")
    assert supervise.signal_line(context, signal.SIGKILL) == (
        "error: process 1 of 2: ended by SIGKILL (killed: out of memory, or by the scheduler or a user) during step 3; "
        "the last complete checkpoint is step 2 (o/checkpoints/2)")
    assert supervise.signal_line(None, signal.SIGABRT).startswith(
        "error: the trainer: ended by SIGABRT (the JAX runtime aborted: it lost the coordinator or another process")
    # a child that reports where it stands and is killed: the supervisor's line, then the same signal
    child = textwrap.dedent("""
        import os, signal, sys
        from longstraw_jax.trainer import supervise
        supervise.report("process 1 of 2", "during step 3", "the last complete checkpoint is step 2 (x)")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    code = ("import sys; from longstraw_jax.trainer import supervise; "
            f"sys.exit(supervise.run([], command=[sys.executable, '-c', {child!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "error: process 1 of 2: ended by SIGKILL (killed: out of memory, or by the scheduler or a user) during step 3; "
        "the last complete checkpoint is step 2 (x)")


def test_die_with_parent_when_the_parent_is_already_gone():
    code = ("import os; from longstraw_jax.trainer import supervise; "
            "supervise.die_with_parent({supervise.PARENT_ENV: '1:SIGTERM'}); print('survived')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.returncode == -signal.SIGTERM and "survived" not in proc.stdout  # its parent is not pid 1
    same = subprocess.run([sys.executable, "-c", code.replace("'1:SIGTERM'", "f'{os.getppid()}:SIGTERM'")],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert same.returncode == 0 and "survived" in same.stdout


def test_step_timeout_option():
    assert RunConfig(step_timeout=30).step_timeout == 30 and "step_timeout" not in RunConfig().saved()
    with pytest.raises(ValueError, match="--step-timeout=0.0 must be a finite number of seconds > 0"):
        RunConfig(step_timeout=0.0)


def test_a_collective_that_lost_a_peer_is_recognised():
    """The runtime's gloo error in the main thread (a peer killed mid-collective) is left to the watchdog's verdict
    (which names the process) instead of a traceback; other runtime errors are not."""
    from longstraw_jax.trainer import watchdog

    JaxRuntimeError = type("JaxRuntimeError", (RuntimeError,), {})
    assert watchdog.is_peer_lost(JaxRuntimeError("UNKNOWN: Gloo AllGather failed: Read error: Connection reset by "
                                                 "peer"))
    assert not watchdog.is_peer_lost(JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory"))
    assert not watchdog.is_peer_lost(ValueError("gloo"))
