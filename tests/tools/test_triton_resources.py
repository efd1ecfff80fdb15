"""tools/triton_resources.py: ptxas's report read, the programs-per-SM arithmetic, and every kernel at its full-size
default launch compiled for sm_90 and sm_80 by the `triton` package (a test dependency): each must fit a program
of an H100 (shared memory <= 227 KiB) and of an A100 (163 KiB), and so launch there. Four did not on an H100 before
(the latent attention's forward and backward, two of the GDN's backward kernels); nothing else would have said so
before a GPU was lent."""
import pytest
import triton_resources as resources  # tools/ is on the tests' path (pyproject's pythonpath)

PTXAS = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'flash_attention_dkv' for 'sm_90a'
ptxas info    : Function properties for flash_attention_dkv
    2600 bytes stack frame, 2600 bytes spill stores, 6632 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 2600 bytes cumulative stack size
"""


def test_ptxas_report_and_programs_per_sm():
    assert resources.parse_ptxas(PTXAS) == dict(registers=255, spill_stores=2600, spill_loads=6632)
    with pytest.raises(ValueError, match="no register / spill report"):
        resources.parse_ptxas("ptxas fatal   : Unsupported .version 9.4")
    per_sm, per_block = resources.SM_LIMITS[90]
    # 8 warps of 255 registers (256 a thread as allocated): 65,536 / (256 x 32 x 8) = 1 program by registers
    assert resources.programs_per_sm(255, 8, 160 * 1024, 90) == 1
    # 4 warps of 128 registers: 4 by registers, 2 by 100 KiB of shared memory
    assert resources.programs_per_sm(128, 4, 100 * 1024, 90) == 2
    assert resources.programs_per_sm(32, 1, 0, 90) == resources.MAX_PROGRAMS_PER_SM
    assert resources.programs_per_sm(128, 4, per_block + 1, 90) == 0  # over the per-program limit: no launch
    assert resources.programs_per_sm(128, 4, per_block, 90) == per_sm // per_block == 1


@pytest.mark.slow  # lowers the three families at full size and compiles 11 kernels for a GPU (~1 min each)
@pytest.mark.parametrize("arch", [90, 80])  # H100 / H200 / H20; A100
def test_every_kernel_fits_at_its_defaults(arch):
    """Qwen3.6-27B's attention (forward, dQ, dK / dV) and GDN (six kernels) and GLM-5.2's sparse latent attention
    (forward, backward), each module verified and compiled for sm_`arch`: every kernel compiles and fits at least one
    program on an SM (shared memory within what a program may have, 227 KiB on sm_90, 163 KiB on sm_80; registers
    within the SM's)."""
    from longstraw_jax.ops import triton_ir

    with triton_ir.h100_target_without_a_gpu():
        rows = resources.measure(arch, resources.default_cases(), echo=False)
    assert len(rows) == 11
    assert {row["kernel"] for row in rows} == {
        "flash_attention_forward", "flash_attention_dq", "flash_attention_dkv", "gated_delta_chunk_local",
        "gated_delta_state_pass", "gated_delta_output", "gated_delta_output_backward", "gated_delta_state_backward",
        "gated_delta_chunk_local_backward", "sparse_latent_attention_forward", "sparse_latent_attention_backward"}
    for row in rows:
        assert "failed" not in row, row
        assert row["shared"] <= resources.SM_LIMITS[arch][1] and row["programs_per_sm"] >= 1, row
        assert 0 < row["registers"] <= 255, row
