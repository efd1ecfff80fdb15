"""capacity/gpu_target.py: the description of each GPU kind that XLA's GPU compiler is given (its numbers are
capacity.hardware's where both have them), and `plan --compile-for` without jax's CUDA plugin (the test extra has
none, by design): one line naming the extra, exit status 2. (With the plugin: docs/benchmarks.md 7.3.)"""
import subprocess
import sys

import pytest

from longstraw_jax.capacity import gpu_target
from longstraw_jax.capacity.hardware import HARDWARE
from tests.helpers import ROOT


@pytest.mark.parametrize("kind", sorted(gpu_target.TARGETS))
def test_the_target_description_is_the_hardware_entry(kind):
    text = gpu_target.target_config(kind)
    fields = dict(line.strip().split(": ", 1) for line in text.splitlines() if ": " in line and "{" not in line)
    hw = HARDWARE[kind]
    assert int(fields["device_memory_size"]) == int(hw.hbm_bytes)
    assert int(fields["memory_bandwidth"]) == int(hw.hbm_per_s)
    assert int(fields["core_count"]) == gpu_target.TARGETS[kind]["core_count"]
    assert int(fields["shared_memory_per_block_optin"]) == 227 * 1024  # what the kernels must fit (sm_90)
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert text.count("{") == text.count("}")  # balanced: the text format parses


def test_an_unknown_kind_is_named():
    with pytest.raises(ValueError, match="--compile-for 'a100': expected one of h100, h20, h200"):
        gpu_target.target_config("a100")


def test_plan_compile_for_without_the_plugin_says_what_to_install():
    result = subprocess.run([sys.executable, "-m", "longstraw_jax.plan", "--config", "configs/qwen3.6-tiny.json",
                             "--mesh", "1x8", "-P", "4096", "--compile-for", "h20"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: compiling for a h20 needs jax's CUDA plugin: pip install -e '.[gpu-compile]'"), line
