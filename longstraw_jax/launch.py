"""`python -m longstraw_jax.launch`: N local processes forming one mesh (code: trainer/launch.py)."""
import sys

from longstraw_jax.trainer.launch import main

if __name__ == "__main__":
    sys.exit(main())
