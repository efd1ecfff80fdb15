"""The method on a ("data", "seq") device mesh: capture / extend a seq-sharded prompt (prompt.py) and `grpo_grads`
on the mesh (engine.py). The mesh primitives live in `parallel/` and are re-exported here: `make_mesh`, `rules`
(docs/architecture.md 5)."""
from longstraw_jax.parallel import rules
from longstraw_jax.parallel.layout import SeqLayout, ShardedPromptState
from longstraw_jax.parallel.mesh import AXES, make_mesh, parse_mesh_spec
from longstraw_jax.sharding.prompt import capture, extend, extend_hidden

__all__ = ["AXES", "make_mesh", "parse_mesh_spec", "rules", "SeqLayout", "ShardedPromptState", "capture", "extend",
           "extend_hidden"]
