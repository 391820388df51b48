"""fp32 parameters under autocast (`adaln_lab.core.autocast`): the ops cast them to bf16 for the kernels as autocast
casts a linear's, so under `torch.autocast("cuda", torch.bfloat16)` the kernels run (no KernelFallbackWarning),
the output and gradients are bitwise those of the same op on bf16 parameters holding bf16(master) (the
gradients reaching the fp32 parameters as fp32), and they repeat bit for bit. Without autocast, fp32 parameters
on CUDA warn with the reason and run the torch code. On the CPU nothing is cast: the torch code there is
diffusers' ops, which autocast treats as it treats diffusers'."""

import warnings

import pytest
import torch

from adaln_lab import block_adaln_path, final_adaln_out
from adaln_lab.harness.block_protocol import rowwise_attn, rowwise_ff
from adaln_lab.core.autocast import autocast_params
from adaln_lab.ops import KernelFallbackWarning

from .test_block_adaln import _path_case


def _master(p, seed):
    """fp32 master weights near p, most of them off the bf16 grid (so the cast rounds)."""
    g = torch.Generator().manual_seed(seed)
    return p.float() * (1 + 1e-3 * torch.randn(p.shape, generator=g))


def _leaves(case, device, params_dtype):
    """x bf16 and temb fp32 as given; the four parameters as fp32 master weights (`_master`) in params_dtype
    (bf16: bf16(master)); every one a fresh leaf."""
    x, temb, *params = case
    params = [_master(p, i).to(params_dtype) for i, p in enumerate(params)]
    return [t.to(device).detach().requires_grad_(True) for t in (x, temb, *params)]


def _block(leaves, row_index, dy, autocast):
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        out = block_adaln_path(*leaves, row_index, rowwise_attn, rowwise_ff, 1e-5, 1e-6)
    out.backward(dy)
    return out.detach(), [t.grad for t in leaves]


def _norm_out_case(seed, S=300, H=256, D=128, T=3):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(S, H, generator=g) * 2).bfloat16(), (0.5 + torch.rand(H, generator=g)),
            torch.randn(T, D, generator=g), torch.randn(2 * H, D, generator=g) * D ** -0.5,
            torch.randn(2 * H, generator=g) * 0.02), torch.randint(0, T, (S,), generator=g)


def _norm_out(case, index, dy, params_dtype, autocast):
    x, nw, temb, w, b = case
    leaves = [t.cuda().detach().requires_grad_(True) for t in (x, _master(nw, 0).to(params_dtype), temb,
                                                               _master(w, 1).to(params_dtype),
                                                               _master(b, 2).to(params_dtype))]
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        out = final_adaln_out(*leaves, index.cuda(), 1e-5)
    out.backward(dy)
    return out.detach(), [t.grad for t in leaves]


def test_nothing_is_cast_on_the_cpu_or_outside_autocast():
    x, w = torch.randn(4, 8).bfloat16(), torch.randn(8)
    with torch.autocast("cpu", torch.bfloat16):
        assert autocast_params(x, w)[0] is w
    assert autocast_params(x, w)[0] is w


@pytest.mark.gpu
def test_cuda_block_under_autocast_runs_the_kernels_on_the_cast_parameters_bitwise():
    case, row_index, dy = _path_case(40, 1000, H=256, D=128)
    row_index, dy = row_index.cuda(), dy.cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        out, grads = _block(_leaves(case, "cuda", torch.float32), row_index, dy, autocast=True)
        again, grads_again = _block(_leaves(case, "cuda", torch.float32), row_index, dy, autocast=True)
        want, want_grads = _block(_leaves(case, "cuda", torch.bfloat16), row_index, dy, autocast=False)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want) and torch.equal(out, again)
    for got, rep, ref in zip(grads, grads_again, want_grads):
        assert torch.equal(got, rep)
    for got, ref in zip(grads[2:], want_grads[2:]):  # the parameters: fp32 gradients holding the bf16 ones
        assert got.dtype == torch.float32 and torch.equal(got, ref.float())
    assert all(torch.equal(got, ref) for got, ref in zip(grads[:2], want_grads[:2]))


@pytest.mark.gpu
def test_cuda_norm_out_under_autocast_runs_the_kernels_on_the_cast_parameters_bitwise():
    case, index = _norm_out_case(41)
    dy = torch.randn(case[0].shape, generator=torch.Generator().manual_seed(42)).bfloat16().cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        out, grads = _norm_out(case, index, dy, torch.float32, autocast=True)
        want, want_grads = _norm_out(case, index, dy, torch.bfloat16, autocast=False)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    assert torch.equal(grads[0], want_grads[0]) and torch.equal(grads[2], want_grads[2])  # x, temb
    for got, ref in (grads[1], want_grads[1]), (grads[3], want_grads[3]), (grads[4], want_grads[4]):
        assert got.dtype == torch.float32 and torch.equal(got, ref.float())


@pytest.mark.gpu
def test_cuda_fp32_parameters_without_autocast_warn_and_run_the_torch_code():
    case, row_index, dy = _path_case(43, 200, H=256, D=128)
    with pytest.warns(KernelFallbackWarning, match="weight in bfloat16"):
        _block(_leaves(case, "cuda", torch.float32), row_index.cuda(), dy.cuda(), autocast=False)
    case, index = _norm_out_case(44)
    with pytest.warns(KernelFallbackWarning, match="in bfloat16"):
        _norm_out(case, index, torch.ones(case[0].shape, dtype=torch.float32, device="cuda"), torch.float32,
                  autocast=False)


@pytest.mark.gpu
def test_cuda_fp32_parameters_compile_fullgraph_without_a_graph_break():
    """The fallback warning is an eager-only act: under torch.compile(fullgraph=True) the same call traces (a
    warning there is a graph break; diffusers' own test_torch_compile_recompilation_and_graph_break caught it)."""
    case, index = _norm_out_case(45)
    x, nw, temb, w, b = (t.cuda() for t in case)
    # dynamo alone (backend "eager"): fullgraph refuses any graph break, and the traced ops run as eager ones do
    fn = torch.compile(lambda *a: final_adaln_out(*a, 1e-5), fullgraph=True, backend="eager")
    with pytest.warns(KernelFallbackWarning):
        eager = final_adaln_out(x, nw, temb, w, b, index.cuda(), 1e-5)
    assert torch.equal(fn(x, nw, temb, w, b, index.cuda()), eager)
