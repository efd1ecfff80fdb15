"""Test session setup: 8 simulated CPU devices (for sharded tests) and float32 matmuls at full precision."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests run tiny models, where XLA:CPU compile time dominates; LLVM optimisation level does not change IEEE results.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")
