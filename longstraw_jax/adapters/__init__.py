"""Training part of a model: the trainable / frozen split of a parameter tree (`trainable`) and LoRA adapters on the
projections (`lora`; the kernel is ops/lora.py)."""
