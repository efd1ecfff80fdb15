"""`python -m longstraw_jax.plan`: the capacity planner (code: capacity/cli.py; the memory model: capacity/)."""
import sys

from longstraw_jax.capacity.cli import main

if __name__ == "__main__":
    sys.exit(main())
