"""Sharded execution on a ("data", "seq") device mesh: `make_mesh`, partition rules, sequence-parallel capture and
replay (docs/architecture.md 5)."""
from longstraw_jax.sharding import rules
from longstraw_jax.sharding.api import capture, extend, extend_hidden
from longstraw_jax.sharding.layout import SeqLayout, ShardedPromptState
from longstraw_jax.sharding.mesh import AXES, make_mesh, parse_mesh_spec

__all__ = ["AXES", "make_mesh", "parse_mesh_spec", "rules", "SeqLayout", "ShardedPromptState", "capture", "extend",
           "extend_hidden"]
