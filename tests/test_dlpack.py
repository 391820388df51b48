"""The DLPack kernel API: CPU (torch tensors, the launch ops' reference bodies: `final_adaln_out.launch` on CPU
tensors) and GPU (CuPy arrays and torch tensors, bitwise equal to adaln_lab.final_adaln_out, zero-copy, on the
caller's stream)."""

import pytest
import torch

from adaln_lab import dlpack
from adaln_lab.core.plan import forward_workspace
from adaln_lab.harness.candidates import adaln_lab_candidate
from adaln_lab.harness.inputs import make, upstream
from adaln_lab.ops.final_adaln_out import launch
from adaln_lab.reference import replay

SMALL = dict(H=264, D=64, T=3)


def test_cpu_forward_is_the_replay_and_backward_has_every_gradient():
    inputs = make(1, 20, "cpu", **SMALL)
    out, table_f32, rstd = dlpack.forward(*inputs.args)
    assert torch.equal(out, replay(*inputs.args))
    assert table_f32.shape == (3, 528) and rstd.shape == (20,)
    dy = upstream(1, inputs.x)
    grads = dlpack.backward(dy, inputs.x, inputs.norm_weight, inputs.temb, inputs.weight, inputs.timestep_indices,
                            table_f32, rstd)
    for g, leaf in zip(grads, inputs.leaves):
        assert g.shape == leaf.shape and bool(torch.isfinite(g.float()).all())
    # the launch ops' bodies on CPU tensors give the same bits: forward, saved values and gradients
    op_out = torch.empty_like(inputs.x)
    workspace = torch.empty(forward_workspace(3, 264, 20, 64)[1], dtype=torch.uint8)
    launch.forward(*inputs.args, 1e-5, "cupy", "cuda", op_out, workspace)
    _, op_table_f32, op_rstd = launch.saved_views(workspace, 3, 264, 20, 64)
    assert torch.equal(op_out, out) and torch.equal(op_table_f32, table_f32) and torch.equal(op_rstd, rstd)
    op_grads = [torch.empty_like(t) for t in inputs.leaves]
    launch.backward(dy, inputs.x, inputs.norm_weight, inputs.temb, inputs.weight, inputs.timestep_indices, workspace,
                    "cupy", *op_grads)
    for g, op_g in zip(grads, op_grads):
        assert torch.equal(g, op_g)


def test_bad_arrays_are_refused_naming_the_argument():
    inputs = make(1, 8, "cpu", **SMALL)
    with pytest.raises(TypeError, match="adaln_lab.dlpack needs x in bfloat16 and temb in float32, got torch.float32"):
        dlpack.forward(inputs.x.float(), *inputs.args[1:])
    out, table_f32, rstd = dlpack.forward(*inputs.args)
    with pytest.raises(ValueError, match="rstd"):
        dlpack.backward(out, inputs.x, inputs.norm_weight, inputs.temb, inputs.weight, inputs.timestep_indices,
                        table_f32, rstd[:3])


class _UnreadableArray:
    """Says it speaks DLPack, but its export fails (as a read-only or exotic array's may)."""

    def __dlpack__(self, **kwargs):
        raise BufferError("this array cannot be exported")

    def __dlpack_device__(self):
        return (1, 0)


def test_non_arrays_are_refused_naming_the_argument():
    inputs = make(1, 8, "cpu", **SMALL)
    args = list(inputs.args)
    with pytest.raises(TypeError, match=r"^adaln_lab.dlpack: x must be an array that supports DLPack .*got list$"):
        dlpack.forward(args[0].tolist(), *args[1:])
    with pytest.raises(TypeError, match=r"^adaln_lab.dlpack: temb must be an array .*DLPack .*got NoneType$"):
        dlpack.forward(*args[:2], None, *args[3:])
    with pytest.raises(TypeError, match=r"^adaln_lab.dlpack: torch.from_dlpack cannot read weight \(_Unreadable"):
        dlpack.forward(*args[:3], _UnreadableArray(), *args[4:])
    out, table_f32, rstd = dlpack.forward(*args)
    with pytest.raises(TypeError, match=r"^adaln_lab.dlpack: dy must be an array that supports DLPack .*got str$"):
        dlpack.backward("dy", inputs.x, inputs.norm_weight, inputs.temb, inputs.weight, inputs.timestep_indices,
                        table_f32, rstd)


@pytest.mark.parametrize("bad", [-1, 3])
def test_a_timestep_index_outside_the_table_is_an_index_error_naming_it(bad):
    """As `final_adaln_out` on the CPU: IndexError naming timestep_indices, the value and the range (T = 3)."""
    inputs = make(1, 8, "cpu", **SMALL)
    idx = inputs.timestep_indices.clone()
    idx[5] = bad
    match = rf"^timestep_indices holds {bad}, outside \[0, T\) = \[0, 3\)$"
    with pytest.raises(IndexError, match=match):
        dlpack.forward(*inputs.args[:5], idx)
    out, table_f32, rstd = dlpack.forward(*inputs.args)
    with pytest.raises(IndexError, match=match):
        dlpack.backward(out, inputs.x, inputs.norm_weight, inputs.temb, inputs.weight, idx, table_f32, rstd)


def _op_result(inputs, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    out = adaln_lab_candidate().fn(*leaves, inputs.timestep_indices)
    out.backward(dy)
    return out.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.gpu
def test_torch_tensors_on_cuda_equal_the_op_bit_for_bit():
    inputs = make(1, 1000, "cuda")
    dy = upstream(1, inputs.x)
    out_ref, grads_ref = _op_result(inputs, dy)
    out, table_f32, rstd = dlpack.forward(*inputs.args)
    grads = dlpack.backward(dy, inputs.x, inputs.norm_weight, inputs.temb, inputs.weight, inputs.timestep_indices,
                            table_f32, rstd)
    assert torch.equal(out, out_ref)
    for g, r in zip(grads, grads_ref):
        assert torch.equal(g, r)


@pytest.mark.gpu
def test_cupy_arrays_zero_copy_on_cupys_stream_equal_the_op():
    cupy = pytest.importorskip("cupy")
    inputs = make(2, 513, "cuda", **SMALL)
    dy = upstream(2, inputs.x)
    out_ref, grads_ref = _op_result(inputs, dy)
    arrays = [cupy.from_dlpack(t) for t in inputs.args]
    assert arrays[0].data.ptr == inputs.x.data_ptr()  # zero-copy in
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out, table_f32, rstd = dlpack.forward(*arrays)
        grads = dlpack.backward(cupy.from_dlpack(dy), arrays[0], arrays[1], arrays[2], arrays[3], arrays[5],
                                table_f32, rstd)
    stream.synchronize()
    assert isinstance(out, cupy.ndarray) and all(isinstance(g, cupy.ndarray) for g in grads)
    assert torch.equal(torch.from_dlpack(out), out_ref)
    for g, r in zip(grads, grads_ref):
        assert torch.equal(torch.from_dlpack(g), r)
