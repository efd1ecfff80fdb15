"""Mesh primitives: the ("data", "seq") mesh (`make_mesh`), FSDP partition rules (`rules`), the zigzag sequence
layout and capture rounds (`layout`), sequence collectives: ring attention, GDN affine fold, log-sum-exp merge
(`sequence`), groups over `data` (`groups`), tensor-parallel layers (`tensor`), expert parallelism (`experts`).
Knows no model family and no engine (docs/architecture.md 5)."""
from longstraw_jax.sharding import rules
from longstraw_jax.sharding.layout import SeqLayout, ShardedPromptState
from longstraw_jax.sharding.mesh import AXES, make_mesh, parse_mesh_spec

__all__ = ["AXES", "make_mesh", "parse_mesh_spec", "rules", "SeqLayout", "ShardedPromptState"]
