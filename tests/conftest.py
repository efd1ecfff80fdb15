"""Test session setup: 8 simulated CPU devices (for sharded tests) and float32 matmuls at full precision."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests run tiny models, where XLA:CPU compile time dominates (these two flags cut it ~3x); neither changes what
# is computed: the LLVM optimisation level and the choice of fusion code emitter keep IEEE float32 semantics.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false").strip()
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches():
    """Each test module starts with empty JAX caches: a test worker runs many modules in one process, and the
    compiled programs of earlier modules would otherwise stay resident (they are never reused across modules)."""
    jax.clear_caches()
    yield


# Test files by measured wall time, longest first (whole suite, 2 workers; files not listed follow in collection
# order). `make test` hands out whole files (--dist loadfile) in collection order (--no-loadscope-reorder; xdist's
# default order, most tests first, put the long few-test files last and left one core idle at the end): longest
# first keeps both workers busy until the short files even out the finish. Only the speed depends on this list.
LONGEST_FIRST = ("test_groups.py", "test_sharding_glm.py", "test_models.py", "test_glm52.py", "test_lora.py",
                 "test_float64.py", "test_faults.py", "test_multiprocess.py", "test_rollout.py", "test_engine.py",
                 "test_bench.py", "test_evaluate.py", "test_run.py", "test_sharding_sequence.py",
                 "test_sharding_grpo.py", "test_sharding_sample.py", "test_qwen36_hf_parity.py", "test_convert.py",
                 "test_qwen36.py", "test_experts.py", "test_glm52_hf_parity.py", "test_train.py", "test_ops.py",
                 "test_naive.py", "test_logprobs.py", "test_orbax_io.py")


def pytest_collection_modifyitems(config, items):
    """Files in LONGEST_FIRST order, then the rest; the tests of a file keep their order (module-scoped set-ups)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
