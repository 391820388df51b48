"""`reference.rms_norm` is `F.rms_norm` bit for bit, values and gradients, for every pair of x and norm_weight
dtypes; and mixed dtypes (layerwise casting's fp16 x with bf16 parameters, ...) run the ops without torch's
"Mismatch dtype ... Cannot dispatch to fused implementation" UserWarning reaching the caller."""

import itertools
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from adaln_lab.reference.final_adaln_out import rms_norm
from tests.paths import PACKAGE, ROOT

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _values_and_grads(norm, x, norm_weight, dy):
    x = x.detach().clone().requires_grad_(True)
    norm_weight = norm_weight.detach().clone().requires_grad_(True)
    out = norm(x, norm_weight)
    out.backward(dy)
    return out.detach(), x.grad, norm_weight.grad


@pytest.mark.parametrize("x_dtype,w_dtype", list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm_is_torch_rms_norm_bit_for_bit(x_dtype, w_dtype, eps):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 33, 72, generator=g) * torch.logspace(-3, 3, 33).unsqueeze(-1)  # rows of many magnitudes
    x = x.to(x_dtype)
    norm_weight = (1 + 0.5 * torch.randn(72, generator=g)).to(w_dtype)
    out_dtype = F.rms_norm(x, (72,), norm_weight, eps).dtype if x_dtype == w_dtype else x_dtype
    dy = torch.randn(2, 33, 72, generator=g).to(out_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # F.rms_norm's own mismatch warning (once per process)
        want = _values_and_grads(lambda a, w: F.rms_norm(a, (72,), w, eps), x, norm_weight, dy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _values_and_grads(lambda a, w: rms_norm(a, w, eps), x, norm_weight, dy)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


MIXED_CALLS = """
import torch, adaln_lab
from adaln_lab.harness.inputs import make
x, norm_weight, temb, weight, bias, idx = make(1, 8, "cpu", H=64, D=32, T=3).args
for x_dtype, p_dtype in ((torch.float16, torch.bfloat16), (torch.float16, torch.float32),
                         (torch.bfloat16, torch.float16), (torch.bfloat16, torch.float32)):
    for backend in ("auto", "torch"):
        leaves = [t.to(d).requires_grad_() for t, d in ((x, x_dtype), (norm_weight, p_dtype), (weight, p_dtype),
                                                        (bias, p_dtype))]
        out = adaln_lab.final_adaln_out(leaves[0], leaves[1], temb, leaves[2], leaves[3], idx, backend=backend)
        out.float().sum().backward()
shift, scale = torch.randn(2, 9, 64, dtype=torch.bfloat16).unbind(0)
x16 = x.half().requires_grad_()
adaln_lab.modulated_rms_norm(x16, norm_weight.requires_grad_(), shift, scale, idx * 3).float().sum().backward()
print("ran")
"""


@pytest.mark.integration  # a process of its own
def test_mixed_dtypes_raise_no_torch_internal_warning():
    """A fresh process (torch warns once per process), every UserWarning an error: final_adaln_out forward and
    backward with fp16 / bf16 x and parameters of another dtype, and a block op with fp16 x and bf16 norm weight."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(PACKAGE.parent),
                                                                     os.environ.get("PYTHONPATH"))))}
    result = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", MIXED_CALLS], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ran" and "Mismatch dtype" not in result.stderr
