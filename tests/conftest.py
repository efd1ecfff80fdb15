"""Test session setup: 8 simulated CPU devices (for sharded tests) and float32 matmuls at full precision."""
import importlib.metadata
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests run tiny models, where XLA:CPU compile time dominates (these two flags cut it ~3x); neither changes what
# is computed: the LLVM optimisation level and the choice of fusion code emitter keep IEEE float32 semantics.
# jaxlib >= 0.11's XLA no longer knows the emitter flag (an unknown flag aborts the process): there it is left out.
_JAXLIB = tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2])
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                           + (" --xla_cpu_use_fusion_emitters=false" if _JAXLIB < (0, 11) else "")).strip()
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache per pytest run, shared by its xdist workers (the controller imports this file
# first and makes the directory; the workers it starts inherit the variable): a program that several test modules
# compile (the same tiny model's forward, the trainer tests' step) compiles once per run; the others load it from
# disk. Only this process's JAX is configured (trainer subprocesses keep their own caches, set by the tests that
# start them). The size limit turns on JAX's file lock, so a worker never reads an entry the other is still writing.
# LONGSTRAW_TEST_XLA_CACHE=off compiles everything in every module.
_CACHE_ENV = "LONGSTRAW_TEST_XLA_CACHE"
_OWN_CACHE = _CACHE_ENV not in os.environ
if _OWN_CACHE:
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="longstraw-xla-cache-")
if os.environ[_CACHE_ENV] != "off":
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", 8 << 30)


import pytest  # noqa: E402


def pytest_unconfigure(config):
    """The run's compilation cache goes with the process that made it (the controller, after its workers)."""
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches():
    """Each test module starts with empty JAX caches: a test worker runs many modules in one process, and the
    compiled programs of earlier modules would otherwise stay resident (a later module that compiles one of them
    again loads it from the run's persistent compilation cache above)."""
    jax.clear_caches()
    yield


@pytest.fixture(autouse=True, scope="session")
def _triton_target_without_a_gpu():
    """jax >= 0.11's Pallas Triton lowering asks the default device for its GPU's description (0.10's did not): on a
    host without a GPU the CUDA-lowering tests (`lower(lowering_platforms=("cuda",))`) lower for an H100's
    (`ops.triton_ir.h100_target_without_a_gpu`). Nothing on jaxlib < 0.11 (the pinned 0.10.2) or on a GPU."""
    from longstraw_jax.ops import triton_ir

    with triton_ir.h100_target_without_a_gpu():
        yield


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """tests/tasks/test_dataset.py's word-level tokenizer directory (chat template; stop ids 3 = <|im_end|>, 1)."""
    from tests.tasks.test_dataset import tiny_tokenizer

    return tiny_tokenizer(tmp_path_factory.mktemp("tok"), eos_ids=[3, 1])


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    from longstraw_jax.tasks.tokenizer import load_tokenizer
    from tests.tasks.test_dataset import VOCAB

    return load_tokenizer(tok_dir, VOCAB)


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """datasets' Arrow cache (JSONL / Parquet conversions) under the test's own directory (modules that read
    datasets use it for every test: `pytestmark = pytest.mark.usefixtures("datasets_cache")`)."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


# Test files by measured seconds, longest first (2 workers), for the whole suite (`make test`) and the tests not marked
# slow (`make test-fast`, `-m "not slow"`): tests/durations.json holds each file's seconds in both tiers, as measured
# by `make test-durations` (LONGSTRAW_TEST_DURATIONS=PATH below writes them). Both tiers hand out whole files (--dist
# loadfile) in collection order (--no-loadscope-reorder; xdist's default order, most tests first, put the long
# few-test files last and left one core idle at the end): longest first keeps both workers busy until the short
# files even out the finish. A file not measured yet counts as the median file. Only the speed depends on this.
TESTS = pathlib.Path(__file__).resolve().parent
DURATIONS = os.path.join(TESTS, "durations.json")
_RECORD = os.environ.get("LONGSTRAW_TEST_DURATIONS")
_recorded: dict[str, dict[str, float]] = {"fast": {}, "slow": {}}


def file_seconds(fast: bool) -> dict[str, float]:
    """{test file path under tests/: measured seconds of its tests in the tier} from DURATIONS (fast: the tests not
    marked slow; else all)."""
    if not os.path.exists(DURATIONS):
        return {}
    with open(DURATIONS) as f:
        measured = json.load(f)
    names = set(measured["fast"]) | set(measured["slow"])
    return {name: measured["fast"].get(name, 0.0) + (0.0 if fast else measured["slow"].get(name, 0.0))
            for name in names}


def pytest_collection_modifyitems(config, items):
    """Files longest first in the tier, then by name; the tests of a file keep their order (module-scoped
    set-ups)."""
    fast = config.getoption("markexpr", "").replace(" ", "") == "notslow"
    seconds = file_seconds(fast)
    default = statistics.median(seconds.values()) if seconds else 0.0
    key = lambda item: item.path.relative_to(TESTS).as_posix()
    items.sort(key=lambda item: (-seconds.get(key(item), default), key(item)))


def pytest_runtest_logreport(report):
    """With LONGSTRAW_TEST_DURATIONS=PATH: each test's set-up, call and tear-down seconds, summed per file and tier
    (in the controller, which receives its workers' reports)."""
    if _RECORD:
        tier = _recorded["slow" if "slow" in report.keywords else "fast"]
        name = report.nodeid.split("::")[0].removeprefix("tests/")
        tier[name] = tier.get(name, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """With LONGSTRAW_TEST_DURATIONS=PATH: the controller writes the per-file seconds (DURATIONS' format)."""
    if _RECORD and not hasattr(session.config, "workerinput"):
        with open(_RECORD, "w") as f:
            json.dump({tier: {name: round(s, 1) for name, s in sorted(files.items())}
                       for tier, files in _recorded.items()}, f, indent=1)
            f.write("\n")
