"""Dense projections in the transformers weight orientation, and the SwiGLU MLP both model families use."""
import jax

from longstraw_jax.ops import lora


def linear(x: jax.Array, w, precision=None) -> jax.Array:
    """x [..., in] @ w[out, in].T -> [..., out]; w may be a `ops.lora.LoRA` node (low-rank path added, never merged)."""
    return lora.linear(x, w, precision)


def swiglu(p: dict, x: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x)) with p = {gate_proj [I, D], up_proj [I, D], down_proj [D, I]} (docs/models.md 1.8,
    and GLM's dense MLP and shared expert, 2.9)."""
    return linear(jax.nn.silu(linear(x, p["gate_proj"])) * linear(x, p["up_proj"]), p["down_proj"])
