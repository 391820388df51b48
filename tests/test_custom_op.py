"""The torch.library custom ops on the CPU: registration, fake kernels, opcheck, autograd, and
torch.compile(fullgraph=True) tracing through them (their CPU kernels are the replay forward and the
analytic backward, so CI checks every layer but the CUDA kernels themselves)."""

import pytest
import torch

from adaln_lab import cuda_op
from adaln_lab.harness.inputs import make, upstream
from adaln_lab.reference import replay

SHAPE = dict(H=64, D=32, T=3)


def _leaves(inputs):
    return [t.detach().clone().requires_grad_(True) for t in inputs.leaves]


def test_ops_are_registered_with_fake_kernels():
    assert hasattr(torch.ops.adaln_lab, "final_adaln_out_fwd")
    assert hasattr(torch.ops.adaln_lab, "final_adaln_out_bwd")
    inputs = make(1, 10, "cpu", **SHAPE)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in inputs.args]
        out, table_f32, rstd = cuda_op.final_adaln_out_fwd(*fake, 1e-5, "cuda")
        assert out.shape == (10, 64) and out.dtype == torch.bfloat16
        assert table_f32.shape == (3, 128) and table_f32.dtype == torch.float32
        assert rstd.shape == (10,)


@pytest.mark.parametrize("rows", [0, 1, 37])
def test_opcheck_on_cpu(rows):
    inputs = make(2, rows, "cpu", **SHAPE)
    args = (*_leaves(inputs), inputs.timestep_indices, 1e-5, "cuda")
    torch.library.opcheck(cuda_op.final_adaln_out_fwd, args)


def test_cpu_kernel_forward_is_the_replay_and_backward_is_close_to_autograd():
    inputs = make(3, 41, "cpu", **SHAPE)
    dy = upstream(3, inputs.x)
    ours = _leaves(inputs)
    out = cuda_op.final_adaln_out_op(*ours, inputs.timestep_indices, 1e-5)
    out.backward(dy)
    ref = _leaves(inputs)
    expected = replay(*ref, inputs.timestep_indices)
    expected.backward(dy)
    assert torch.equal(out, expected)
    for a, b in zip(ours, ref):
        scale = b.grad.double().abs().max()
        assert (a.grad.double() - b.grad.double()).abs().max() <= 0.05 * scale


def test_compile_fullgraph_traces_the_op_forward_and_backward():
    """torch.compile with fullgraph=True raises on any graph break: the op must be one traced node."""
    torch._dynamo.reset()
    inputs = make(4, 33, "cpu", **SHAPE)
    dy = upstream(4, inputs.x)

    def fn(x, norm_weight, temb, weight, bias, timestep_indices):
        return cuda_op.final_adaln_out_op(x, norm_weight, temb, weight, bias, timestep_indices, 1e-5)

    eager = _leaves(inputs)
    out_eager = cuda_op.final_adaln_out_op(*eager, inputs.timestep_indices, 1e-5)
    out_eager.backward(dy)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    leaves = _leaves(inputs)
    out = compiled(*leaves, inputs.timestep_indices)
    out.backward(dy)
    assert torch.equal(out, out_eager)
    for a, b in zip(leaves, eager):
        assert torch.equal(a.grad, b.grad)


def test_opcheck_of_the_backward_op_and_of_non_contiguous_inputs():
    """The backward op on its own, and a permuted x: outputs are contiguous in the fake and the real kernel."""
    inputs = make(5, 24, "cpu", **SHAPE)
    out, table_f32, rstd = cuda_op.final_adaln_out_fwd(*inputs.args, 1e-5, "cuda")
    dy = upstream(5, inputs.x)
    torch.library.opcheck(cuda_op.final_adaln_out_bwd, (dy, inputs.x, inputs.norm_weight, inputs.temb, inputs.weight,
                                                        inputs.timestep_indices, table_f32, rstd))
    x3 = inputs.x.view(4, 6, 64).transpose(0, 1)  # (6, 4, 64) with S = 4: non-contiguous
    args = (x3, *[t.detach().clone().requires_grad_(True) for t in inputs.leaves[1:]], inputs.timestep_indices[:4],
            1e-5, "cuda")
    torch.library.opcheck(cuda_op.final_adaln_out_fwd, args)


def test_cpu_table_f32_is_the_unrounded_table():
    """table_f32 is the fp32 sum before the table's bf16 rounding, as table.cu gives it."""
    inputs = make(6, 3, "cpu", **SHAPE)
    _, table_f32, _ = cuda_op.final_adaln_out_fwd(*inputs.args, 1e-5, "cuda")
    act = torch.nn.functional.silu(inputs.temb).to(torch.bfloat16).double()
    exact = act @ inputs.weight.double().T + inputs.bias.double()
    assert (table_f32.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert not torch.equal(table_f32, table_f32.to(torch.bfloat16).float())
