"""The method: capture a prompt once, replay G branches from its state, and (exact mode) backpropagate into the
prompt. `capture` (the prompt state: in chunks on one device, in rounds on a mesh), `replay` (the branch scan),
`layerwise` (the block-by-block backward the families plug into), `local` (`grpo_grads` on one device), `mesh`
(`grpo_grads` on a ("data", "seq") mesh), `naive` (the full-graph oracle). Model-agnostic: a family plugs in through
the protocols of models/base.py and is never imported here."""
from longstraw_jax.engine.local import MODES, grpo_grads
from longstraw_jax.engine.naive import naive_grpo_grads

__all__ = ["MODES", "grpo_grads", "naive_grpo_grads"]
