"""The one parser of command-line sizes (`validation.parse_size`): K = 1024, M = 2^20, a fraction rounded to the
nearest integer with halves up (exactly, not in floating point); its argparse types and their errors in the planner
(`python -m longstraw_jax.plan`) and tools/bench_device.py, and the rule stated in both `--help` texts."""
import importlib.util
import os

import pytest

from longstraw_jax.capacity import cli
from longstraw_jax.common.validation import SIZE_RULE, parse_size, size_arg, sizes_arg
from tests.helpers import ROOT


@pytest.mark.parametrize("text, value", [
    ("8192", 8192), ("0", 0), (" 16k ", 16384), ("64K", 65536), ("1M", 2**20), ("1m", 2**20), ("4M", 4 * 2**20),
    ("0.5K", 512), ("2.1M", 2202010),  # 2,202,009.6
    ("4.46M", 4676649),  # 4,676,648.96
    ("1.5", 2), ("2.5", 3), ("0.5", 1),  # halves up (Python's round() would give 2, 2, 0)
    ("0.0001K", 0),  # 0.1024
    ("2100000", 2100000),  # the docs' decimal prompt lengths, written out
])
def test_parse_size(text, value):
    assert parse_size(text) == value and isinstance(parse_size(text), int)


@pytest.mark.parametrize("text", ["", "K", "-1K", "+2", "1e6", "2.1G", "4,096", "1.K", ".5K", "64KB", "0x10", "2 M 1"])
def test_parse_size_rejects_with_the_rule(text):
    with pytest.raises(ValueError, match="is not a size") as error:
        parse_size(text)
    assert repr(text) in str(error.value) and SIZE_RULE in str(error.value)


def test_size_lists():
    assert sizes_arg("2.1M,4K,8192") == [2202010, 4096, 8192]
    with pytest.raises(Exception, match="'4G' is not a size"):
        sizes_arg("2M,4G")
    assert size_arg("16K") == 16384


def _bench_device():
    spec = importlib.util.spec_from_file_location("bench_device", os.path.join(ROOT, "tools", "bench_device.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_planner_options_parse_sizes_and_reject_bad_ones(capsys):
    args = cli.build_parser().parse_args(["--config", "c.json", "--mesh", "1x8", "-P", "2.1M,64K", "-R", "1K",
                                          "--chunk-size", "16K", "--search-step", "0.5M", "-B", "2"])
    assert (args.prompt_len, args.response_len, args.chunk_size, args.search_step, args.groups_per_step) == (
        [2202010, 65536], 1024, 16384, 2**19, 2)
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["--config", "c.json", "--mesh", "1x8", "-P", "2.1G"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --prompt-len/-P: '2.1G' is not a size" in err and "K = 1024, M = 2^20" in err
    assert SIZE_RULE in cli.build_parser().format_help()


def test_bench_device_parses_sizes_the_same_way(capsys):
    bench = _bench_device()
    with pytest.raises(SystemExit) as exit_:  # argparse fails before any child process starts
        bench.main(["--capture-len", "64KB"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --capture-len: '64KB' is not a size" in err and SIZE_RULE in err
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    assert SIZE_RULE in capsys.readouterr().out
