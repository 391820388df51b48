"""Every validation error of final_adaln_out names its argument."""

import pytest
import torch

from adaln_lab import final_adaln_out, validate
from adaln_lab.harness.inputs import make


@pytest.fixture
def args():
    return list(make(1, 6, H=16, D=8, T=3).args)


NAMES = ["x", "norm_weight", "temb", "weight", "bias", "timestep_indices"]


def call(args, **kw):
    return final_adaln_out(*args, **kw)


@pytest.mark.parametrize("position", range(6))
def test_not_a_tensor(args, position):
    args[position] = [1.0]
    with pytest.raises(TypeError, match=NAMES[position]):
        call(args)


@pytest.mark.parametrize("position,dtype,error,match", [
    (0, torch.int32, TypeError, "x must be floating"),
    (1, torch.int64, TypeError, "norm_weight must be floating"),
    (2, torch.bfloat16, TypeError, "temb must be float32"),
    (3, torch.int8, TypeError, "weight must be floating"),
    (4, torch.float32, TypeError, "bias dtype"),
    (5, torch.int32, TypeError, "timestep_indices must be int64"),
])
def test_wrong_dtype(args, position, dtype, error, match):
    args[position] = args[position].to(dtype)
    with pytest.raises(error, match=match):
        call(args)


@pytest.mark.parametrize("position,shape,match", [
    (0, (16,), "x must have shape"),
    (1, (15,), "norm_weight must have shape"),
    (2, (3,), "temb must have shape"),
    (3, (32, 7), "weight must have shape"),
    (4, (31,), "bias must have shape"),
    (5, (5,), "timestep_indices must have shape"),
])
def test_wrong_shape(args, position, shape, match):
    args[position] = torch.zeros(shape, dtype=args[position].dtype)
    with pytest.raises(ValueError, match=match):
        call(args)


@pytest.mark.parametrize("bad", [-1, 3])
def test_index_out_of_range(args, bad):
    args[5] = args[5].clone()
    args[5][2] = bad
    with pytest.raises(IndexError, match=rf"timestep_indices holds {bad}, outside \[0, T\) = \[0, 3\)"):
        call(args)


def test_unchecked_indices_skip_only_the_range_check(args):
    args[5] = args[5].clone()
    args[5][2] = 7
    assert validate(*args, 1e-5, check_indices=False) == (6, 16, 3, 8)


def test_devices_must_match(args):
    args[2] = args[2].to("meta")
    with pytest.raises(ValueError, match="temb is on meta"):
        call(args)


@pytest.mark.parametrize("eps", [0.0, -1.0, "1e-5", True])
def test_bad_eps(args, eps):
    with pytest.raises(ValueError, match="eps"):
        final_adaln_out(*args, eps=eps)


@pytest.mark.parametrize("kw,match", [({"backend": "jax"}, "backend"), ({"numerics": "fp64"}, "numerics"),
                                      ({"table_backend": "cublas"}, "table_backend")])
def test_bad_options(args, kw, match):
    with pytest.raises(ValueError, match=match):
        call(args, **kw)


def test_cupy_backend_needs_cuda(args):
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        call(args, backend="cupy")


def test_leading_dims_accepted(args):
    x = torch.stack([args[0], args[0]])
    out = final_adaln_out(x, *args[1:])
    assert out.shape == x.shape and torch.equal(out[0], out[1])
