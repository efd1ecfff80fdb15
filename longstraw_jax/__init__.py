"""longstraw-jax: GRPO post-training on million-token shared prompts (capture once, replay branches)."""
from longstraw_jax import models
from longstraw_jax.engine import grpo_grads
from longstraw_jax.engine.naive import naive_grpo_grads
from longstraw_jax.grpo import GroupBatch, GRPOConfig
from longstraw_jax.train import make_optimizer, train_step

__all__ = ["models", "GroupBatch", "GRPOConfig", "grpo_grads", "naive_grpo_grads", "make_optimizer", "train_step"]
