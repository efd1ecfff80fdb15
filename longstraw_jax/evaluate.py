"""`python -m longstraw_jax.evaluate`: held-out evaluation of a run's checkpoints (code: trainer/evaluate.py)."""
import sys

from longstraw_jax.trainer.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
