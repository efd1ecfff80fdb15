"""Hugging Face safetensors <-> Orbax checkpoint conversion; see longstraw_jax/io/convert.py.

    python tools/convert_hf.py hf2orbax --hf Qwen3.6-27B --out init/qwen3.6-27b
    python tools/convert_hf.py orbax2hf --ckpt init/qwen3.6-27b --config Qwen3.6-27B --out Qwen3.6-27B-trained
"""
import sys

from longstraw_jax.io.convert import main

if __name__ == "__main__":
    sys.exit(main())
