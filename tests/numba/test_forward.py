"""The Numba twin of the forward (adaln_lab.ops.final_adaln_out.twin.forward): on a CPU through numba's CUDA simulator (tiny shapes;
tests/conftest.py turns it on where there is no GPU), on a GPU against kernels_cu bit for bit."""

import pytest
import torch

from adaln_lab.harness.accuracy import parity
from adaln_lab.harness.inputs import make
from adaln_lab.ops.final_adaln_out.twin import forward as numba_forward
from adaln_lab.reference import replay

pytestmark = pytest.mark.integration  # the Numba twin in numba's CUDA simulator (a few thousand threads a second)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = {"H": 32, "D": 16, "T": 2}  # the simulator runs ~6,000 threads a second: keep grids tiny


def twin_forward(*args):
    return numba_forward.forward(*args)[0]


def test_numpy_shim_is_in_place_once_numba_cuda_is_imported():
    import numpy

    numba_forward.cuda()
    assert numpy.row_stack is not None


def test_twin_table_rows_are_T_invariant():
    full = make(1, 2, DEVICE, **{**TINY, "T": 3})
    table_bf16, table_f32 = numba_forward.table(full.temb, full.weight, full.bias)
    for picked in ([2], [2, 0]):
        sub_bf16, sub_f32 = numba_forward.table(full.temb[picked].contiguous(), full.weight, full.bias)
        assert torch.equal(sub_bf16, table_bf16[picked])
        assert torch.equal(sub_f32, table_f32[picked])
    assert torch.equal(table_bf16, table_f32.to(torch.bfloat16))


def test_twin_rows_do_not_depend_on_the_batch():
    batch = make(3, 6, DEVICE, **TINY)
    out, rstd, table_bf16 = numba_forward.forward(*batch.args)
    for r in (0, 5):
        alone = batch.rows(torch.tensor([r]))
        out_r, rstd_r = numba_forward.norm_modulate(alone.x, alone.norm_weight, table_bf16, alone.timestep_indices, 1e-5)
        assert torch.equal(out_r[0], out[r]) and torch.equal(rstd_r[0], rstd[r])


def test_twin_forward_is_diffusers_up_to_summation_order():
    inputs = make(2, 5, DEVICE, **TINY)
    result = parity(twin_forward, replay, inputs)
    assert result["within_1_ulp_fraction"] >= 0.99
    assert result["max_operand_ulp"] <= 4


@pytest.mark.gpu
def test_twin_rows_equal_kernels_cu_bit_for_bit_and_both_tables_the_golden_rounded():
    """The twin's norm_modulate on the kernel's table: the kernel's rows, bit for bit. The tables: the twin keeps v25's
    GEMV order and table.cu sums on tensor cores (numba has no mma), so each is checked against the float64 golden
    instead: within n u sum |act w|, n = D / 8 + 16 (more than either's longest chain of fp32 roundings: 84 steps
    and 8 chunks on tensor cores, 11 vectors of 8 fmas and 5 butterfly levels in the GEMV, plus the bias; u = 2^-24),
    and their bf16 roundings equal wherever the golden is farther than that from a rounding midpoint (a quarter of
    the elements at least, so that the check bites)."""
    from adaln_lab.core import tensors

    inputs = make(1, 33, "cuda")
    table_cu, table_f32_cu = tensors.table(inputs.temb, inputs.weight, inputs.bias)
    out_cu, rstd_cu = tensors.norm_modulate(inputs.x, inputs.norm_weight, table_cu, inputs.timestep_indices,
                                            1e-5, inputs.temb.shape[1])
    out, rstd = numba_forward.norm_modulate(inputs.x, inputs.norm_weight, table_cu, inputs.timestep_indices, 1e-5)
    table_bf16, table_f32 = numba_forward.table(inputs.temb, inputs.weight, inputs.bias)
    torch.cuda.synchronize()
    assert torch.equal(rstd, rstd_cu) and torch.equal(out, out_cu)
    act = torch.nn.functional.silu(inputs.temb).bfloat16().double()
    exact = act @ inputs.weight.double().T + inputs.bias.double()
    cond = act.abs() @ inputs.weight.double().abs().T
    bound = (inputs.temb.shape[1] // 8 + 16) * 2.0 ** -24 * cond
    for f32 in (table_f32, table_f32_cu):
        assert bool(((f32.double() - exact).abs() <= bound).all())
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    midpoint = ((exact / ulp) - (exact / ulp).floor() - 0.5).abs() * ulp  # distance to the nearest rounding midpoint
    clear = midpoint > bound
    assert bool((table_bf16 == table_cu)[clear].all()) and clear.float().mean() > 0.25


# the forward's kernels for numba's real CUDA target (tests/numba/conftest.py: `twin_ptx_for_sm90` compiles them in one
# process with test_backward.py's)
SM90_SIGS = """
from adaln_lab.ops.final_adaln_out.twin import forward as nb
nb.cuda()
from numba import cuda, float32, int64, uint16
sigs = {
    "table": (nb.table_kernel(5376, 2688, 3), (float32[:, ::1], uint16[:, ::1], uint16[::1], uint16[:, ::1], float32[:, ::1]),
              ".entry"),
    "norm_modulate": (nb.norm_modulate_kernel(5376, 3), (uint16[:, ::1], uint16[::1], uint16[:, ::1], int64[::1],
                                                           uint16[:, ::1], float32[::1], int64, float32), ".entry"),
}
"""


@pytest.mark.xdist_group("numba_sm90")  # with test_backward.py's: one process compiles both (`twin_ptx_for_sm90`)
def test_twin_compiles_for_the_cuda_target_without_a_gpu(twin_ptx_for_sm90):
    """numba's real CUDA target (NVVM from the test extra), not the simulator: types and shared sizes hold."""
    stdout = twin_ptx_for_sm90
    assert "table ok" in stdout and "norm_modulate ok" in stdout
