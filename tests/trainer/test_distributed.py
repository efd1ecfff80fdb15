"""Multi-process runs (trainer/distributed.py, trainer/launch.py, docs/cluster.md).

- the real thing, once (two processes compile in parallel: the slow part): `launch --processes 2 -- --mesh 2x4` (4
  CPU devices per process, `data` across them, each process scoring its own slice's group), 3 steps with process 1
  SIGKILLed in step 3 (fault hook): the launcher exits with 137, process 0 stops by itself (JAX's heartbeat) within
  the grace period, the checkpoint of step 2 (written by both processes) is complete; `run --resume --mesh 2x4` in
  one process (8 devices) finishes step 3, and rewards, losses and grad norms of all 3 steps equal a one-process
  `--mesh 2x4` run's (rtol 1e-4); metrics.jsonl written once (by process 0). (The same mesh: on another mesh
  round-off differences grow through AdamW, whose update is +-lr for near-zero gradients: 2x2 -> 2x4 gave a 0.5% grad
  norm difference at step 3.)
- a bad coordinator address: a clear error naming it, exit status 2, within the init timeout (no JAX abort);
- processes started with different options stop at once with one line naming every differing option; a process
  whose peer never starts says so in one line within the init timeout (both started by hand, side by side);
- a process stopped (SIGSTOP) in the middle of step 3 (`--mesh 2x1`: one device per process): the other ends within
  the step bound with one line naming it and the last complete checkpoint, which is unchanged;
- the launcher owns its workers: SIGHUP or SIGKILL to it ends every worker within seconds;
- the pure parts: how a process joins (flags, JAX_* variables, SLURM incl. one task per 8-GPU node), the device
  split, the launcher's checks and command lines, host <-> global arrays, --mesh changeable on --resume.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from longstraw_jax import sharding
from longstraw_jax.sharding import hosts
from longstraw_jax.trainer import cli as run, distributed, launch
from longstraw_jax.trainer.config import RunConfig, RunError
from longstraw_jax.trainer.distributed import Cluster, DistributedError
from tests.helpers import ROOT

# lr 1e-5: AdamW moves every parameter with a non-negligible gradient by ~lr, so round-off differences between
# process layouts (~1e-7) that flip such a gradient's sign change the next step by ~lr, not by a 3e-3 jump
SMALL = ["--vocab-size", "32", "--prompt-len", "32", "--group-size", "3", "--response-len", "2", "--chunk-size", "16",
         "--eval-every", "0", "--sft-steps", "0", "--save-every", "2", "--seed", "3", "--learning-rate", "1e-5",
         "--reward", "tests.trainer.test_distributed:token_reward", "--mesh", "2x4"]


def token_reward(prompt_tokens, response_tokens, info):
    """Rewards that differ between branches unless all sample the same first token (non-zero advantages). With
    LONGSTRAW_TEST_SCORED=PATH, each call appends "process prompt-head" to PATH.<process> (who scored what)."""
    if os.environ.get("LONGSTRAW_TEST_SCORED"):
        with open(f"{os.environ['LONGSTRAW_TEST_SCORED']}.{jax.process_index()}", "a") as f:
            f.write(f"{jax.process_index()} {' '.join(map(str, prompt_tokens[:12]))}\n")
    return float(response_tokens[0])


def scored(path, process):
    """The prompt heads `token_reward` saw in `process` -> {head: number of calls}."""
    calls = {}
    if os.path.exists(f"{path}.{process}"):
        for line in open(f"{path}.{process}"):
            head = line.split(" ", 1)[1]
            calls[head] = calls.get(head, 0) + 1
    return calls


def read(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def env(**extra):
    """The subprocesses' environment: this checkout first on the path, CPU, this session's XLA flags, short
    distributed timeouts."""
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu",
            "JAX_DEFAULT_MATMUL_PRECISION": "highest", "LONGSTRAW_HEARTBEAT_TIMEOUT_S": "20",
            "LONGSTRAW_SHUTDOWN_TIMEOUT_S": "10", "LONGSTRAW_INIT_TIMEOUT_S": "60", **extra}


def cached(cache) -> dict:
    """The environment of a subprocess that shares the persistent compilation cache `cache` (a directory)."""
    return dict(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def run_cli(args, cache, **extra):
    """`python -m longstraw_jax.run args` in one process (its own 8 CPU devices for --mesh 2x4), sharing a persistent
    compilation cache -> Popen."""
    return subprocess.Popen([sys.executable, "-m", "longstraw_jax.run", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env(**cached(cache), **extra))


# XLA:CPU's abort when the simulated devices of one process wait in different collectives (docs/benchmarks.md 6b)
XLA_CPU_COLLECTIVE_RACE = "Termination timeout for `all"


def run_to_end(args, cache, attempts: int = 2) -> tuple[int, str]:
    """run_cli(args) to its end -> (exit status, output). A run that XLA:CPU's runtime aborted because the
    simulated devices of one process waited in different collectives (an ordering race of the in-process runtime,
    docs/benchmarks.md 6b: 1 of ~50 CI runs of the resume below, never in 20 runs here) is started again, up to
    `attempts` times in all, and says so: a --resume run that died mid-step resumes from the same checkpoint."""
    for attempt in range(1, attempts + 1):
        proc = run_cli(args, cache)
        output = proc.communicate(timeout=600)[0]
        if proc.returncode == 0 or XLA_CPU_COLLECTIVE_RACE not in output or attempt == attempts:
            return proc.returncode, output
        print(f"attempt {attempt}: XLA:CPU aborted on its in-process collective race; running it again")


@pytest.mark.slow  # three trainer processes (two launched, one reference) and a resumed one
def test_two_processes_killed_then_resumed_in_one(tmp_path):
    out, single, cache = str(tmp_path / "mp"), str(tmp_path / "single"), tmp_path / "cache"
    start = time.perf_counter()
    # the one-process reference (3 steps, same 2x4 mesh) compiles alongside the two processes
    reference = run_cli([*SMALL, "--steps", "3", "--out", single], cache)
    proc = subprocess.run([sys.executable, "-m", "longstraw_jax.launch", "--processes", "2", "--grace", "60", "--",
                           *SMALL, "--steps", "3", "--out", out], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env(LONGSTRAW_TEST_FAULT="step:3:SIGKILL:1",
                                               LONGSTRAW_TEST_SCORED=str(tmp_path / "scored")))
    launched = time.perf_counter() - start
    lines = proc.stdout.splitlines()
    # the last lines, after the first error-looking ones (which say why when a process ended unexpectedly)
    errors = [line for line in lines if any(w in line for w in ("rror", "Terminating", "heartbeat", "mismatch"))]
    tail = "\n".join(line[:200] for line in errors[:8] + ["..."] + lines[-30:])
    assert proc.returncode == 128 + 9, tail
    assert "[launch] process 1 ended with signal SIGKILL" in proc.stdout, tail
    assert any(line.startswith("[launch] process 0 ended by itself with status 2") for line in lines), tail  # no hang
    # one line each: the killed process's (from its supervisor), the survivor's (its watchdog, after the heartbeat
    # timeout: the runtime's abort does not come first)
    last = {p: [line for line in lines if line.startswith(f"[p{p}] ")][-1] for p in (0, 1)}
    checkpoint = f"the last complete checkpoint is step 2 ({out}/checkpoints/2); continue with --out {out} --resume"
    assert last[1] == ("[p1] error: process 1 of 2: ended by SIGKILL (killed: out of memory, or by the scheduler or "
                       f"a user) during step 3; {checkpoint}"), tail
    assert last[0] == ("[p0] error: process 0 of 2: process 1 stopped answering (no heartbeat for 20 s: killed, "
                       f"stopped or its host lost) during step 3; {checkpoint}"), tail
    assert all(line.startswith(("[p0] ", "[p1] ", "[launch] ")) for line in lines), tail
    # process 0 alone prints progress and writes metrics.jsonl; both joined the same coordinator
    assert [line for line in lines if "/3 reward" in line and line.startswith("[p0] ")] and \
        not [line for line in lines if "/3 reward" in line and line.startswith("[p1] ")], tail
    assert sum("joining the JAX coordinator at 127.0.0.1:" in line for line in lines) == 2, tail
    assert "devices: 8 x cpu in 2 processes" in proc.stdout, tail
    assert [r["step"] for r in read(out)] == [1, 2]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["2"]  # complete, renamed: both processes wrote
    print(f"2-process launch (2 steps, killed in the 3rd): {launched:.1f} s")
    # each process scored only the groups of its own data slice (B = 2: one each), every branch of steps 1-3 (the
    # kill comes after step 3's rewards)
    by_process = [scored(tmp_path / "scored", p) for p in (0, 1)]
    assert len(by_process[0]) == len(by_process[1]) == 3 and not set(by_process[0]) & set(by_process[1]), by_process
    assert all(n == 3 for calls in by_process for n in calls.values()), by_process  # G = 3 branches each

    # the checkpoint of 2 processes resumed in one (same mesh; compiled programs from the reference's cache)
    output = reference.communicate(timeout=600)[0]
    assert reference.returncode == 0, output[-2000:]
    returncode, output = run_to_end(["--out", out, "--resume", "--steps", "3", "--mesh", "2x4"], cache)
    assert returncode == 0, output[-2000:]
    got, want = read(out), read(single)
    assert [r["step"] for r in got] == [1, 2, 3]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose([g["reward_mean"], g["loss"], g["grad_norm"]],
                                   [w["reward_mean"], w["loss"], w["grad_norm"]], rtol=1e-4, atol=1e-6)
    assert all(w["grad_norm"] > 0 for w in want)  # the comparison saw real gradients
    print(f"whole test: {time.perf_counter() - start:.1f} s")


def start(args, port, process_id, processes=2, **extra):
    """`python -m longstraw_jax.run args` as process `process_id` of `processes` at 127.0.0.1:port -> Popen."""
    return subprocess.Popen([sys.executable, "-m", "longstraw_jax.run", *args, "--coordinator", f"127.0.0.1:{port}",
                             "--num-processes", str(processes), "--process-id", str(process_id)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(**extra))


@pytest.mark.slow  # three trainer processes (each a supervisor and its trainer) that stop before any compile
def test_start_up_failures_are_one_line(tmp_path):
    out = str(tmp_path / "never")
    common = ["--vocab-size", "32", "--prompt-len", "32", "--chunk-size", "16", "--eval-every", "0", "--sft-steps",
              "0", "--out", out]
    begin = time.perf_counter()
    port, lonely_port = launch.free_port(), launch.free_port()
    procs = [start([*common, "--steps", "3", "--seed", "3", "--mesh", "2x4", "-G", "3"], port, 0),
             start([*common, "--steps", "4", "--seed", "5", "--mesh", "2x2", "--mode", "detached", "-G", "4"], port, 1),
             start([*common, "--mesh", "2x4"], lonely_port, 0, LONGSTRAW_INIT_TIMEOUT_S="3")]  # process 1 never comes
    results = [(p.communicate(timeout=120)[1], p.returncode, time.perf_counter() - begin) for p in procs]
    disagree = ("error: processes disagree on --group-size (process 0: 3, process 1: 4), --steps (process 0: 3, "
                "process 1: 4), --mode (process 0: exact, process 1: detached), --mesh (process 0: 2x4, process 1: "
                "2x2), --seed (process 0: 3, process 1: 5); every process must be started with the same options")
    for stderr, returncode, took in results[:2]:
        assert returncode == 2 and stderr.splitlines()[-1] == disagree, stderr[-2000:]
        assert took < 60, took  # at once (imports and joining), no hang
    stderr, returncode, took = results[2]
    assert returncode == 2, stderr[-2000:]
    assert stderr.splitlines()[-1] == ("error: process 1 of 2 did not join within 3 s (not started, failed before "
                                       "joining, or started with another --coordinator or --num-processes)")
    assert "Check failure" not in stderr and "Traceback" not in stderr and took < 60
    assert not os.path.exists(out)
    print(f"disagreeing processes stopped after {max(r[2] for r in results[:2]):.1f} s, the lonely one after "
          f"{took:.1f} s")


@pytest.mark.slow  # a 2-process launch of 3 steps
def test_stopped_process_ends_the_run_within_the_step_bound(tmp_path):
    """One device per process (--mesh 2x1): the watchdog's step bound does not depend on the mesh, and with several
    devices per process XLA:CPU's collectives could hang in step 1 on a loaded machine (a whole-suite run once ended
    here with "a collective never completed" after 300 s); with one, a step takes ~2 s instead of ~13 s."""
    out = str(tmp_path / "mp")
    one_device_each = [*SMALL[:SMALL.index("--mesh")], "--mesh", "2x1"]
    proc = subprocess.run([sys.executable, "-m", "longstraw_jax.launch", "--processes", "2", "--grace", "5", "--",
                           *one_device_each, "--steps", "4", "--out", out, "--step-timeout", "30"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900,
                          env=env(LONGSTRAW_TEST_FAULT="step:3:SIGSTOP:1", LONGSTRAW_HEARTBEAT_TIMEOUT_S="300",
                                  LONGSTRAW_STEP_BOUND_FACTOR="3"))
    lines = proc.stdout.splitlines()
    tail = "\n".join(line[:300] for line in lines[-30:])
    assert proc.returncode == 2, tail  # process 0's status; process 1 (stopped) is killed by the launcher
    assert "[launch] process 0 ended with status 2" in proc.stdout, tail
    assert "[launch] process 1 still running after 5 s: killing it" in proc.stdout, tail
    last = [line for line in lines if line.startswith("[p0] ")][-1]
    checkpoint = f"the last complete checkpoint is step 2 ({out}/checkpoints/2); continue with --out {out} --resume"
    match = re.fullmatch(r"\[p0\] error: process 0 of 2: step 3 did not finish within (\d+) s \(3 x the median "
                         r"step \S+ s; --step-timeout 30\): process 1 stopped answering; " + re.escape(checkpoint),
                         last)
    assert match and int(match[1]) < 300, tail  # the step bound (from the measured step 2), not the heartbeat's
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["2"]
    assert [r["step"] for r in read(out)] == [1, 2]


def descendants(pid):
    """Every process below `pid` (from /proc), living ones only."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # two 2-process launches, ended while they compile
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL])
def test_launcher_owns_its_workers(tmp_path, sig):
    launcher = subprocess.Popen([sys.executable, "-m", "longstraw_jax.launch", "--processes", "2", "--", *SMALL,
                                 "--steps", "1000", "--out", str(tmp_path / "mp")], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env(), start_new_session=True)
    joined = []

    def read():
        for line in launcher.stdout:
            joined.extend([line] if "joining the JAX coordinator" in line else [])

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 120
    while len(joined) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    workers = descendants(launcher.pid)
    assert len(joined) == 2 and len(workers) == 4, (joined, workers)  # 2 supervisors, 2 trainers
    launcher.send_signal(sig)
    ended = time.monotonic()
    while any(alive(p) for p in workers) and time.monotonic() < ended + 30:
        time.sleep(0.2)
    left = [p for p in workers if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    launcher.wait(timeout=30)
    assert not left, f"{signal.Signals(sig).name}: workers {left} outlived the launcher"
    print(f"{signal.Signals(sig).name}: every worker ended {time.monotonic() - ended:.1f} s after the launcher's end")


@pytest.mark.slow  # a trainer subprocess that waits out its init timeout
def test_bad_coordinator_is_a_clear_error(tmp_path):
    with socket.socket() as s:  # a port nothing listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        out = str(tmp_path / "never")
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "longstraw_jax.run", *SMALL, "--out", out, "--coordinator",
                               f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, env=env(LONGSTRAW_INIT_TIMEOUT_S="3"))
        took = time.perf_counter() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-1] == (f"error: coordinator 127.0.0.1:{port}: nothing answered within 3 s (is "
                                            "process 0 running, with this address, and is 127.0.0.1 reachable from "
                                            "this host?)")
    assert took < 60 and not os.path.exists(out)
    with pytest.raises(DistributedError, match="cannot resolve 'no-such-host.invalid'"):
        distributed.check_coordinator("no-such-host.invalid:1234", 1, 1.0)
    with socket.socket() as s:  # process 0 cannot listen on a port in use
        s.bind(("", 0))
        s.listen()
        with pytest.raises(DistributedError, match=f"process 0 cannot listen on port {s.getsockname()[1]}"):
            distributed.check_coordinator(f"127.0.0.1:{s.getsockname()[1]}", 0, 1.0)


def test_resolve_flags_environment_and_clusters():
    none = {}
    assert distributed.resolve(environ=none) is None
    assert distributed.resolve(None, 1, None, environ=none) is None  # --num-processes 1: one process
    assert distributed.resolve("h:1", 2, 1, environ=none) == Cluster("h:1", 2, 1)
    jax_env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:29500", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert distributed.resolve(environ=jax_env) == Cluster("10.0.0.1:29500", 4, 3, source="environment")
    with pytest.raises(DistributedError, match="missing --process-id"):
        distributed.resolve("h:1", 2, None, environ=none)
    with pytest.raises(DistributedError, match=r"process_id=2 must be in \[0, num_processes=2\)"):
        distributed.resolve("h:1", 2, 2, environ=none)
    with pytest.raises(DistributedError, match="coordinator='h' must be HOST:PORT"):
        distributed.resolve("h", 2, 0, environ=none)
    with pytest.raises(DistributedError, match="JAX_NUM_PROCESSES='two' must be an integer"):
        distributed.resolve(environ={"JAX_NUM_PROCESSES": "two"})
    # SLURM: 4 nodes x 1 task, 8 GPUs each -> every GPU of the node, not just GPU SLURM_LOCALID = 0
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "gpu[01-04]", "SLURM_NTASKS": "4", "SLURM_PROCID": "2",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
             "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert distributed.resolve(environ=slurm) == Cluster(None, None, None, tuple(range(8)), "slurm",
                                                         source="cluster (slurm)")
    # one task per GPU: JAX's default (one device each); a single-task step is no cluster
    per_gpu = dict(slurm, SLURM_NTASKS="32", SLURM_STEP_TASKS_PER_NODE="8(x4)")
    assert distributed.resolve(environ=per_gpu).local_device_ids is None
    assert distributed.resolve(environ=dict(slurm, SLURM_NTASKS="1", SLURM_STEP_TASKS_PER_NODE="1")) is None
    assert distributed.slurm_local_device_ids({"SLURM_JOB_ID": "1", "SLURM_TASKS_PER_NODE": "2,1(x2)",
                                               "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "4"}) == (0, 1, 2, 3)
    # flags under SLURM still get the node's GPUs; JAX_LOCAL_DEVICE_IDS wins
    assert distributed.resolve("h:1", 4, 2, environ=slurm).local_device_ids == tuple(range(8))
    assert distributed.resolve("h:1", 4, 2, environ=dict(slurm, JAX_LOCAL_DEVICE_IDS="0,1")).local_device_ids == (0, 1)
    assert distributed.detected_cluster({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}) == "ompi"
    assert distributed.detected_cluster({"LONGSTRAW_CLUSTER_DETECTION": "k8s"}) == "k8s"
    assert distributed.detected_cluster({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) is None  # opt-in only
    assert distributed.devices_per_process(8, 2) == 4
    with pytest.raises(DistributedError, match="--mesh has 8 devices, which --num-processes=3 does not divide"):
        distributed.devices_per_process(8, 3)
    assert distributed.env_timeout("heartbeat", {}) == 100
    with pytest.raises(DistributedError, match="LONGSTRAW_INIT_TIMEOUT_S='0' must be a number of seconds > 0"):
        distributed.env_timeout("init", {"LONGSTRAW_INIT_TIMEOUT_S": "0"})


def test_launcher_checks_and_commands(capsys):
    cmds = launch.commands(2, ["--mesh", "2x4", "--steps", "2"], 1234, python="py")
    assert cmds[1] == ["py", "-m", "longstraw_jax.run", "--mesh", "2x4", "--steps", "2", "--coordinator",
                       "127.0.0.1:1234", "--num-processes", "2", "--process-id", "1"]
    assert launch.mesh_of(["--mesh", "1x8", "--mesh=2x4"]) == "2x4" and launch.exit_status(-9) == 137
    for processes, args, message in ((3, ["--mesh", "2x4"], "--mesh 2x4 has 8 devices, which --processes=3 does not "
                                      "divide"), (2, ["--steps", "2"], "need --mesh AxB"),
                                     (2, ["--mesh", "2x4", "--process-id", "0"], "the launcher sets"),
                                     (0, ["--mesh", "2x4"], "--processes=0 must be >= 1")):
        assert launch.main(["--processes", str(processes), "--", *args]) == 2
        assert message in capsys.readouterr().err
    # a run with --num-processes > 1 and no --mesh: refused before JAX starts
    assert run.main(["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"]) == 2
    assert "a multi-process run needs --mesh AxB" in capsys.readouterr().err
    assert run.main(["--num-processes", "2", "--process-id", "2", "--mesh", "2x4"]) == 2
    assert "--process-id=2 must be in [0, --num-processes=2)" in capsys.readouterr().err


def test_host_and_global_arrays():
    """One process here, so every array is addressable; the same calls are what the multi-process run uses."""
    mesh = sharding.make_mesh("2x4")
    x = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "seq")))
    g = distributed.to_global({"x": x}, rows)["x"]
    assert g.sharding == rows and len(g.addressable_shards) == 8
    np.testing.assert_array_equal(hosts.to_host({"x": g})["x"], x)
    key = distributed.to_global(jax.random.key(5), distributed.replicated(mesh))
    assert key.sharding.is_fully_replicated
    assert np.array_equal(jax.random.key_data(hosts.to_host(key)), jax.random.key_data(jax.random.key(5)))
    local = distributed.from_process_local(x, rows)  # one process: its rows are all rows
    np.testing.assert_array_equal(hosts.to_host(local), x)
    distributed.agree("test", None)  # one process: nothing to wait for
    with pytest.raises(DistributedError, match="broken"):
        distributed.agree("test", "broken")


def test_mesh_may_change_on_resume():
    saved = RunConfig(mesh="2x4", group_size=3).saved()
    assert "coordinator" not in saved and "num_processes" not in saved and saved["mesh"] == "2x4"
    assert RunConfig(mesh="1x8").resumed(saved, {"mesh"}).mesh == "1x8"  # given: the new mesh
    assert RunConfig().resumed(saved, set()).mesh == "2x4"  # not given: the checkpoint's
    with pytest.raises(RunError, match="--group-size=4 differs"):
        RunConfig(group_size=4).resumed(saved, {"group_size"})


@pytest.fixture(autouse=True)
def _no_leftovers(tmp_path):
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_group_owners_and_process_sums():
    """Which process scores which group: the lowest process of the group's data slice (a slice may span processes)."""
    class Device:
        def __init__(self, process_index):
            self.process_index = process_index

    class Mesh:
        def __init__(self, processes):
            self.devices = np.array([[Device(p) for p in row] for row in processes], dtype=object)

    assert distributed.group_owners(Mesh([[0, 0], [1, 1]]), 4) == [0, 0, 1, 1]  # 2x2 on 2 hosts: data spans them
    assert distributed.group_owners(Mesh([[0, 0, 1, 1]]), 2) == [0, 0]  # 1x4 on 2 hosts: one slice, process 0
    assert distributed.group_owners(Mesh([[2, 2], [0, 0], [1, 1]]), 3) == [2, 0, 1]
    assert distributed.group_owners(None, 2) == [0, 0]
    assert distributed.group_owners(sharding.make_mesh("2x4"), 2) == [0, 0]  # one process owns everything
    tree = (np.ones((2, 3), np.float32), np.zeros(2))
    assert distributed.sum_over_processes(tree) is tree  # one process: nothing to add

