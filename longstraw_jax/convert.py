"""`python -m longstraw_jax.convert`: HF <-> Orbax checkpoint conversion (code: io/convert.py)."""
import sys

from longstraw_jax.io.convert import main

if __name__ == "__main__":
    sys.exit(main())
