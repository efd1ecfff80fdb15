"""`python -m longstraw_jax.run`: the trainer (code: trainer/cli.py)."""
import sys

from longstraw_jax.trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
