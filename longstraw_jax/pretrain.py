"""`python -m longstraw_jax.pretrain`: next-token pre-training on a text corpus, saved as an HF checkpoint (code:
trainer/pretrain.py)."""
import sys

from longstraw_jax.trainer.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
