"""GLM-5 / 5.1 / 5.2 (docs/models.md 2): `config` (Glm52Config, its segments, Glm52State), `layers` (the layer math as
pure functions), `blocks` (the stages of the block-by-block backward), `model` (Glm52: parameters, HF names,
capture / extend / decode), `mesh` (the mesh adapter and the backward on a mesh), `mesh_forward` (capture, replay and
decoding on a mesh)."""
from longstraw_jax.models.glm52.config import Glm52Config, Glm52State
from longstraw_jax.models.glm52.model import Glm52

__all__ = ["Glm52Config", "Glm52State", "Glm52"]
