"""Test session setup: 8 simulated CPU devices (for sharded tests) and float32 matmuls at full precision."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests run tiny models, where XLA:CPU compile time dominates (these two flags cut it ~3x); neither changes what
# is computed: the LLVM optimisation level and the choice of fusion code emitter keep IEEE float32 semantics.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false").strip()
import shutil  # noqa: E402
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


# Test files by measured wall time, longest first (2 workers; files not listed follow in collection order), one
# list per tier: the whole suite (`make test`) and the tests not marked slow (`make test-fast`, `-m "not slow"`).
# Both hand out whole files (--dist loadfile) in collection order (--no-loadscope-reorder; xdist's default order,
# most tests first, put the long few-test files last and left one core idle at the end): longest first keeps both
# workers busy until the short files even out the finish. Only the speed depends on these lists.
LONGEST_FIRST = ("test_groups.py", "test_sharding_glm.py", "test_models.py", "test_glm52.py", "test_lora.py",
                 "test_float64.py", "test_faults.py", "test_multiprocess.py", "test_rollout.py", "test_engine.py",
                 "test_bench.py", "test_evaluate.py", "test_data.py", "test_run.py", "test_sharding_sequence.py",
                 "test_sharding_grpo.py", "test_sharding_sample.py", "test_capacity.py", "test_qwen36_hf_parity.py",
                 "test_convert.py",
                 "test_qwen36.py", "test_experts.py", "test_glm52_hf_parity.py", "test_train.py", "test_ops.py",
                 "test_naive.py", "test_logprobs.py", "test_orbax_io.py")
LONGEST_FIRST_FAST = ("test_rollout.py", "test_engine.py", "test_lora.py", "test_faults.py", "test_models.py",
                      "test_glm52.py", "test_sharding_sequence.py", "test_sharding_glm.py", "test_bench.py",
                      "test_run.py", "test_evaluate.py", "test_qwen36_hf_parity.py", "test_sharding_grpo.py",
                      "test_glm52_hf_parity.py", "test_experts.py", "test_convert.py", "test_train.py",
                      "test_qwen36.py", "test_grpo.py", "test_naive.py", "test_groups.py", "test_ops.py",
                      "test_orbax_io.py", "test_sharding_rules.py", "test_imports.py", "test_logprobs.py")


def pytest_collection_modifyitems(config, items):
    """Files in the tier's longest-first order, then the rest; the tests of a file keep their order (module-scoped
    set-ups)."""
    fast = config.getoption("markexpr", "").replace(" ", "") == "notslow"
    rank = {name: i for i, name in enumerate(LONGEST_FIRST_FAST if fast else LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
