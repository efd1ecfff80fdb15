"""Multi-process runs (one process per host, or several per host): joining the JAX distributed system, the CPU
device count per process, and moving values between one process's host memory and global (multi-process) arrays.

Who joins (`resolve`, first match wins):

1. `--coordinator HOST:PORT --num-processes N --process-id I` (the trainer's flags; trainer/launch.py passes them);
2. the environment: `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`;
3. a cluster JAX detects itself: SLURM (an `srun` step with more than one task), Open MPI (`mpirun`, more than one
   rank), or the method named by `LONGSTRAW_CLUSTER_DETECTION` (any of JAX's `cluster_detection_method`s, e.g.
   `k8s`, `mpi4py`; Kubernetes is opt-in because every pod looks like one);
4. otherwise one process, and `jax.distributed` is not started.

SLURM and one task per node: JAX's SLURM detection restricts each task to the one GPU numbered SLURM_LOCALID, so a
task that owns a node's 8 GPUs would use only GPU 0. `local_device_ids` therefore passes every GPU of the node
(`CUDA_VISIBLE_DEVICES`, or `SLURM_GPUS_ON_NODE`) when the node runs a single task of the step; with one task per GPU
JAX's default (one device each) is kept. `JAX_LOCAL_DEVICE_IDS=0,1,...` overrides both.

Timeouts (seconds, from the environment so that launchers and tests can shorten them):
`LONGSTRAW_INIT_TIMEOUT_S` (default 300: waiting for the coordinator and the other processes to join),
`LONGSTRAW_HEARTBEAT_TIMEOUT_S` (100: a process that stops answering is declared dead and the others abort),
`LONGSTRAW_SHUTDOWN_TIMEOUT_S` (300: how long a finishing process waits for the others at exit),
`LONGSTRAW_SYNC_TIMEOUT_S` (1800: `agree`, waiting for the other processes' verdict); and the watchdog's step bound
`LONGSTRAW_STEP_BOUND_FACTOR` (10: a step may take this many times the median step, at least --step-timeout).

Device order: `jax.devices()` lists process 0's devices first, then process 1's, ...; `sharding.make_mesh` reshapes
that list to (A, B), so the `data` axis spans processes (hosts) and `seq` stays within one host when B divides the
devices per process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import socket
import sys
import time

ENV_TIMEOUTS = {"init": ("LONGSTRAW_INIT_TIMEOUT_S", 300), "heartbeat": ("LONGSTRAW_HEARTBEAT_TIMEOUT_S", 100),
                "shutdown": ("LONGSTRAW_SHUTDOWN_TIMEOUT_S", 300), "sync": ("LONGSTRAW_SYNC_TIMEOUT_S", 1800),
                "step_factor": ("LONGSTRAW_STEP_BOUND_FACTOR", 10)}
_ADDRESS = re.compile(r"^(?P<host>\[[^\]]+\]|[^:\s]+):(?P<port>\d{1,5})$")


class DistributedError(Exception):
    """A user-facing problem with joining or coordinating the processes (run.main prints it as `error: ...`)."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """How this process joins: `coordinator` "HOST:PORT" (None: JAX detects it), `num_processes` N and `process_id`
    I in [0, N) (None: detected), `local_device_ids` (None: JAX's default), `detection` (a JAX
    cluster_detection_method, or None), and `source` (where the values came from, for messages)."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None = None
    detection: str | None = None
    source: str = "flags"

    def __post_init__(self):
        errors = []
        if self.coordinator is not None:
            match = _ADDRESS.match(self.coordinator)
            if match is None or not 0 < int(match["port"]) < 65536:
                errors.append(f"coordinator={self.coordinator!r} must be HOST:PORT with a port in [1, 65535]")
        if self.num_processes is not None and self.num_processes < 1:
            errors.append(f"num_processes={self.num_processes} must be >= 1")
        if self.process_id is not None and not 0 <= self.process_id < (self.num_processes or math.inf):
            errors.append(f"process_id={self.process_id} must be in [0, num_processes={self.num_processes})")
        if errors:
            raise DistributedError(f"{self.source}: " + "; ".join(errors))


def env_timeout(name: str, environ=os.environ) -> float:
    """One of ENV_TIMEOUTS ("init", "heartbeat", "shutdown", "sync" in seconds; "step_factor", a multiple of the
    median step); a bad value names the variable."""
    var, default = ENV_TIMEOUTS[name]
    text = environ.get(var)
    if text is None:
        return float(default)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value > 0):
        raise DistributedError(f"{var}={text!r} must be a number{' of seconds' if name != 'step_factor' else ''} > 0")
    return value


def _expand_slurm_counts(spec: str) -> list[int]:
    """SLURM's tasks-per-node syntax "2(x3),1" -> [2, 2, 2, 1]."""
    out = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise DistributedError(f"cannot read SLURM tasks per node {spec!r}")
        out += [int(match[1])] * int(match[2] or 1)
    return out


def slurm_local_device_ids(environ=os.environ) -> tuple[int, ...] | None:
    """Under SLURM with a single task of the step on this node: every GPU of the node (from CUDA_VISIBLE_DEVICES,
    else SLURM_GPUS_ON_NODE), so JAX does not restrict the task to GPU SLURM_LOCALID. None otherwise (several tasks
    on the node: JAX's one GPU per task; or no GPU count known)."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if "SLURM_JOB_ID" not in environ or not spec:
        return None
    counts = _expand_slurm_counts(spec)
    node = int(environ.get("SLURM_NODEID", "0"))
    if node >= len(counts) or counts[node] != 1:
        return None
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible and visible not in ("NoDevFiles", "-1"):
        return tuple(range(len(visible.split(","))))
    gpus = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    return tuple(range(int(gpus))) if gpus.isdigit() and int(gpus) > 0 else None


def _env_int(environ, name: str) -> int | None:
    text = environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise DistributedError(f"{name}={text!r} must be an integer") from None


def detected_cluster(environ=os.environ) -> str | None:
    """The JAX cluster_detection_method to use when neither flags nor JAX_* variables say how to join: the one named
    by LONGSTRAW_CLUSTER_DETECTION, "slurm" inside an srun step of more than one task, "ompi" under mpirun with more
    than one rank, else None (one process)."""
    named = environ.get("LONGSTRAW_CLUSTER_DETECTION")
    if named:
        return named
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in environ for v in slurm) and (_env_int(environ, "SLURM_NTASKS") or 1) > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in environ and (_env_int(environ, "OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "ompi"
    return None


def resolve(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
            environ=os.environ) -> Cluster | None:
    """How this process joins (the module docstring's order), or None for a single-process run. Flags and the JAX_*
    variables must name all three values, or give num_processes=1 (one process)."""
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    source = "flags"
    if all(v is None for v in given.values()):
        given = {"JAX_COORDINATOR_ADDRESS": environ.get("JAX_COORDINATOR_ADDRESS") or None,
                 "JAX_NUM_PROCESSES": _env_int(environ, "JAX_NUM_PROCESSES"),
                 "JAX_PROCESS_ID": _env_int(environ, "JAX_PROCESS_ID")}
        source = "environment"
    local = _env_int_list(environ, "JAX_LOCAL_DEVICE_IDS") or slurm_local_device_ids(environ)
    if all(v is None for v in given.values()):
        method = detected_cluster(environ)
        return None if method is None else Cluster(None, None, None, local, method, source=f"cluster ({method})")
    values = list(given.values())
    if values[1] == 1 and values[2] in (None, 0):
        return None
    missing = [name for name, v in given.items() if v is None]
    if missing:
        raise DistributedError(f"{source}: {', '.join(given)} go together; missing {', '.join(missing)}")
    return Cluster(values[0], values[1], values[2], local, source=source)


def _env_int_list(environ, name: str) -> tuple[int, ...] | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise DistributedError(f"{name}={text!r} must be comma-separated integers") from None


def devices_per_process(mesh_size: int, num_processes: int) -> int:
    """A*B devices of the mesh split evenly over the processes; a clear error when they cannot be."""
    if mesh_size % num_processes:
        raise DistributedError(f"--mesh has {mesh_size} devices, which --num-processes={num_processes} does not "
                               f"divide: every process must hold the same number of devices")
    return mesh_size // num_processes


def _split_address(address: str) -> tuple[str, int]:
    match = _ADDRESS.match(address)
    return match["host"].strip("[]"), int(match["port"])


def check_coordinator(address: str, process_id: int, timeout: float) -> None:
    """Before `jax.distributed.initialize` (whose failures abort the process with a long native trace): the host
    resolves; process 0 can listen on the port; any other process reaches it within `timeout` seconds. A
    DistributedError naming the address otherwise."""
    host, port = _split_address(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise DistributedError(f"coordinator {address}: cannot resolve {host!r} ({e.strerror or e})") from None
    if process_id == 0:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("::" if ":" in host else "", port))
            except OSError as e:
                raise DistributedError(f"coordinator {address}: process 0 cannot listen on port {port} "
                                       f"({e.strerror or e}); choose a free port") from None
        return
    deadline = time.monotonic() + timeout
    while True:
        for family, kind, proto, _, sockaddr in infos:
            with socket.socket(family, kind, proto) as s:
                s.settimeout(min(2.0, max(0.1, deadline - time.monotonic())))
                with contextlib.suppress(OSError):
                    s.connect(sockaddr)
                    return
        if time.monotonic() >= deadline:
            raise DistributedError(f"coordinator {address}: nothing answered within {timeout:g} s (is process 0 "
                                   f"running, with this address, and is {host} reachable from this host?)")
        time.sleep(0.2)


def not_joined(process_id: int | None, num_processes: int | None, timeout: float) -> str:
    """The one line for a join that timed out: with 2 processes it names the other one; otherwise this one."""
    why = "not started, failed before joining, or started with another --coordinator or --num-processes"
    if num_processes == 2 and process_id in (0, 1):
        return f"process {1 - process_id} of 2 did not join within {timeout:g} s ({why})"
    who = "" if process_id is None else f"; this is process {process_id}"
    return f"not every one of the {num_processes or '?'} processes joined within {timeout:g} s ({why}{who})"


# JAX's own limits are set this much beyond ours, so that our one-line message comes first (JAX aborts natively)
_JAX_MARGIN_S = 30.0


def exit_with(text: str | None, status: int = 2) -> None:
    """Print `text` (one line, stderr) and end the process at once (os._exit: from a watchdog thread while the main
    thread is stuck in native code, and without JAX's exit handlers, which would wait for the other processes)."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    with contextlib.suppress(OSError, ValueError):
        if text is not None:
            print(text, file=sys.stderr, flush=True)
    os._exit(status)


def initialize(cluster: Cluster, mesh_size: int | None, environ=os.environ) -> str | None:
    """Join the distributed system (before anything touches a JAX backend) and, for CPU, ask for mesh_size / N
    simulated devices per process. Prints one line on stderr naming the address first. A join that does not complete
    within LONGSTRAW_INIT_TIMEOUT_S ends the process with one line (`not_joined`, exit status 2) before JAX's own
    limit (which aborts natively). Returns the device-split error of a mesh N does not divide (None when it divides):
    the process joins with one device so that `check_agreement` can first say whether the processes disagree on
    --mesh."""
    import threading

    import jax

    split_error = None
    if cluster.num_processes is not None and mesh_size is not None:
        try:
            per_process = devices_per_process(mesh_size, cluster.num_processes)
        except DistributedError as e:
            split_error, per_process = str(e), 1
        jax.config.update("jax_num_cpu_devices", per_process)
    timeouts = {name: env_timeout(name, environ) for name in ("init", "heartbeat", "shutdown")}
    if cluster.coordinator is not None:
        check_coordinator(cluster.coordinator, cluster.process_id, timeouts["init"])
    where = cluster.coordinator or "(detected)"
    who = "?" if cluster.process_id is None else cluster.process_id
    print(f"joining the JAX coordinator at {where} as process {who} of {cluster.num_processes or '?'} "
          f"({cluster.source}; timeout {timeouts['init']:g} s)", file=sys.stderr, flush=True)
    joined = threading.Event()

    def watch_join():
        if not joined.wait(timeouts["init"]):
            exit_with("error: " + not_joined(cluster.process_id, cluster.num_processes, timeouts["init"]))

    threading.Thread(target=watch_join, name="longstraw-join-watchdog", daemon=True).start()
    jax.distributed.initialize(
        coordinator_address=cluster.coordinator, num_processes=cluster.num_processes, process_id=cluster.process_id,
        local_device_ids=list(cluster.local_device_ids) if cluster.local_device_ids else None,
        cluster_detection_method=cluster.detection,
        initialization_timeout=math.ceil(timeouts["init"] + _JAX_MARGIN_S),
        # our watchdog (trainer/watchdog.py) declares a silent process dead after the heartbeat timeout, JAX later
        heartbeat_timeout_seconds=math.ceil(2 * timeouts["heartbeat"] + _JAX_MARGIN_S),
        shutdown_timeout_seconds=math.ceil(timeouts["shutdown"]))
    joined.set()
    if mesh_size is not None and cluster.num_processes is None:  # detected: the count is known only now
        try:
            devices_per_process(mesh_size, _client_state().num_processes)
        except DistributedError as e:
            split_error = str(e)
    return split_error


def _client_state():
    """JAX's distributed state (client, process_id, num_processes); usable before any backend starts."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state


def exchange(name: str, value: str, timeout: float) -> list[str]:
    """Every process posts `value` under `name` in the coordinator's key-value store and reads everyone's ->
    the values of processes 0..N-1. Touches no device (works before the backends start). A process that has not
    posted within `timeout` seconds is a DistributedError naming it."""
    state = _client_state()
    me, n = state.process_id, state.num_processes
    n_round = _rounds[name] = _rounds.get(name, 0) + 1
    state.client.key_value_set(f"longstraw/{name}/{n_round}/{me}", value)
    values = []
    for p in range(n):
        if p == me:
            values.append(value)
            continue
        try:
            values.append(state.client.blocking_key_value_get(f"longstraw/{name}/{n_round}/{p}", int(timeout * 1000)))
        except Exception:  # XlaRuntimeError DEADLINE_EXCEEDED: the process is stuck or gone
            raise DistributedError(f"process {p} of {n} did not report its {name} within {timeout:g} s") from None
    return values


def check_agreement(config, explicit=frozenset()) -> None:
    """After joining, before any device is used or anything compiles: the processes compare their
    `agreement.fingerprint`s through the coordinator; a difference is one DistributedError on every process naming
    the differing fields and processes. Nothing to do in a single-process run."""
    import json

    from longstraw_jax.trainer import agreement

    state = _client_state()
    if state.client is None:
        return
    mine = json.dumps(agreement.fingerprint(config, explicit))
    prints = [json.loads(v) for v in exchange("agreement", mine, env_timeout("init"))]
    message = agreement.disagreement(prints)
    if message is not None:
        raise DistributedError(message)


# ----- after initialisation --------------------------------------------------------------------------------------

def raise_cpu_device_count(mesh: str) -> None:
    """Ask for A*B simulated CPU devices before JAX initialises its backends (no effect on accelerators)."""
    import jax

    from longstraw_jax.sharding.mesh import parse_mesh_spec

    try:
        jax.config.update("jax_num_cpu_devices", max(math.prod(parse_mesh_spec(mesh)), 1))
    except RuntimeError:  # backends already initialised (e.g. in-process tests): keep what exists
        pass


def start_jax(config, explicit=frozenset()) -> None:
    """Before anything touches a JAX backend (the trainer and `evaluate` call it first): join a multi-process run
    (config.coordinator / num_processes / process_id, the JAX_* variables, or a detected SLURM / Open MPI job) with
    config.mesh's A*B devices split over the processes, check that every process was started alike
    (`check_agreement`) and start this process's watchdog (trainer/watchdog.py); or in one process raise the
    simulated CPU device count to A*B. config: a RunConfig (or anything with those four fields); explicit: the
    options given on the command line."""
    from longstraw_jax.sharding.mesh import parse_mesh_spec

    cluster = resolve(config.coordinator, config.num_processes, config.process_id)
    if cluster is None:
        if config.mesh is not None:
            raise_cpu_device_count(config.mesh)
        return
    if config.mesh is None:
        raise DistributedError(f"{cluster.source}: a multi-process run needs --mesh AxB (the global mesh, its A*B "
                               "devices split evenly over the processes)")
    split_error = initialize(cluster, math.prod(parse_mesh_spec(config.mesh)))
    check_agreement(config, explicit)
    if split_error is not None:
        raise DistributedError(split_error)
    from longstraw_jax.trainer import watchdog

    state = _client_state()
    if state.client is not None and (state.num_processes or 1) >= 2:
        watchdog.start(state.client, state.process_id, state.num_processes, env_timeout("heartbeat"),
                       getattr(config, "step_timeout", watchdog.DEFAULT_STEP_TIMEOUT_S), cluster.coordinator,
                       exit=exit_with, median_factor=env_timeout("step_factor"))


def process_index() -> int:
    import jax

    return jax.process_index()


def is_primary() -> bool:
    """Process 0: the one that writes metrics.jsonl, the plot, config.json, --export-hf, and prints."""
    return process_index() == 0


def to_global(tree, shardings):
    """A pytree of values that are equal on every process (host arrays, process-local jax arrays) -> global arrays
    with `shardings` (a matching pytree, or one sharding for all leaves); each process builds only its own
    devices' shards. Global arrays already spread over several processes are resharded by `jax.device_put`."""
    import jax
    import numpy as np

    def one(x, sharding):
        if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            return jax.random.wrap_key_data(one(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, shardings), tree)
    return jax.tree.map(one, tree, shardings)


def from_process_local(tree, shardings):
    """Each process's own rows (e.g. the groups it sampled and scored) -> global arrays: leaf by leaf
    `jax.make_array_from_process_local_data`, the global leading dimension being the processes' rows in process
    order (data-parallel inputs along `data`). `sharding.hosts.to_host` turns the result back into the full value
    everywhere."""
    import jax

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(shardings, x), tree)
    return jax.tree.map(jax.make_array_from_process_local_data, shardings, tree)


def group_owners(mesh, groups_per_step: int) -> list[int]:
    """The process that scores each of `groups_per_step` groups: group b lives on data slice b // (groups_per_step /
    data size) (`sharding/groups.py`), and its owner is the lowest process index among that slice's devices (a slice
    may span several processes, e.g. `1x8` on 2 hosts). No mesh: process 0 owns every group."""
    if mesh is None:
        return [0] * groups_per_step
    slices = mesh.devices.reshape(mesh.devices.shape[0], -1)
    per_slice = groups_per_step // slices.shape[0]
    return [min(d.process_index for d in slices[b // per_slice]) for b in range(groups_per_step)]


def sum_over_processes(tree):
    """Leaf-wise sum of host arrays over all processes (each process sends its own; every process gets the sum):
    rows computed by their owner and zero elsewhere come back whole on every process. One process: unchanged."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return tree
    return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(np.asarray(x))).sum(0), tree)


def replicated(mesh):
    """The fully replicated NamedSharding of `mesh`."""
    import jax

    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


_rounds = {}


def agree(name: str, error: str | None, value: str = "", single_raises: bool = True) -> None:
    """Every process reports whether its part of step `name` failed (`error`: a one-line message, or None) and what
    it found (`value`, a short string that must be equal on all), then waits for the others' reports
    (LONGSTRAW_SYNC_TIMEOUT_S at most). All raise the same DistributedError when any failed (this process's own
    message first) or when the values differ, so that an error on one process stops every process at the same point
    instead of leaving the others waiting in a collective. single_raises=False: this process's own error is left to
    the caller to raise (its original exception). One process: only that."""
    import jax

    if jax.process_count() == 1:
        if error is not None and single_raises:
            raise DistributedError(error)
        return
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    n = _rounds[name] = _rounds.get(name, 0) + 1
    me = jax.process_index()
    client.key_value_set(f"longstraw/{name}/{n}/{me}", "error:" + error if error is not None else "ok:" + value)
    timeout = env_timeout("sync")
    reports = {}
    for p in range(jax.process_count()):
        if p != me:
            try:
                reports[p] = client.blocking_key_value_get(f"longstraw/{name}/{n}/{p}", int(timeout * 1000))
            except Exception:  # a timeout (XlaRuntimeError): the process died or is stuck elsewhere
                reports[p] = f"error:did not reach {name!r} within {timeout:g} s"
    if error is not None:
        if single_raises:
            raise DistributedError(error)
        return
    failed = sorted(p for p, text in reports.items() if text.startswith("error:"))
    if failed:
        raise DistributedError(f"process {failed[0]}: {reports[failed[0]][len('error:'):]}")
    differ = sorted(p for p, text in reports.items() if text != "ok:" + value)
    if differ:
        p = differ[0]
        raise DistributedError(f"process {p} found {reports[p][3:]!r} where process {me} found {value!r} ({name}); "
                               "do all hosts see the same files?")


@contextlib.contextmanager
def agreed(name: str, errors: tuple[type[BaseException], ...]):
    """Run the block on every process, then `agree` on its outcome: an exception of `errors` on any process becomes
    the same DistributedError on all (one line, naming the process it came from when not this one)."""
    import jax

    if jax.process_count() == 1:  # nothing to agree on: the exception passes unchanged
        yield
        return
    try:
        yield
    except errors as e:
        agree(name, (str(e).splitlines() or [type(e).__name__])[0])
    agree(name, None)
