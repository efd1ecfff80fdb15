"""Qwen3.5 / Qwen3.6 (docs/models.md 1): `config` (Qwen36Config, Qwen36State), `layers` (the layer math as pure
functions), `model` (Qwen36: parameters, HF names, capture / extend / decode, the block protocol), `mesh` (the mesh
adapter and the backward on a mesh), `mesh_forward` (capture, replay and decoding on a mesh)."""
from longstraw_jax.models.qwen36.config import Qwen36Config, Qwen36State
from longstraw_jax.models.qwen36.model import Qwen36

__all__ = ["Qwen36Config", "Qwen36State", "Qwen36"]
