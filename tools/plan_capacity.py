"""Capacity planner: per-device memory of one whole trainer step, from shapes only; see longstraw_jax/capacity/.

    python tools/plan_capacity.py --config configs/qwen3.6-27b.json --mesh 1x8 -P 2100000,4460000 -G 2,8 --markdown
    python -m longstraw_jax.plan ...    # the same
"""
import sys

from longstraw_jax.capacity.cli import main

if __name__ == "__main__":
    sys.exit(main())
