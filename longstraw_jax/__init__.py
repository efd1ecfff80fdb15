"""longstraw-jax: GRPO post-training on million-token shared prompts (capture once, replay branches)."""
from longstraw_jax import models

__all__ = ["models"]
