"""`adaln_lab.core.checks.validate` (`adaln_lab.validate`): what it returns, the dtype rule (pinned to what
diffusers' model runs), eps, speed.

Every refused input, each with its error class and the argument's name in the message, is in
tests/ops/test_final_adaln_out_bad_inputs.py (`BAD_INPUTS`, through `final_adaln_out`); non-contiguous
inputs in tests/ops/test_final_adaln_out_edge_inputs.py. The block ops' checks (`check_rows`, `check_order`,
`check_table_inputs`) are pinned by each op's refusal test in tests/ops/.
"""

import fractions
import importlib.util
import time

import numpy as np
import pytest
import torch

from adaln_lab import final_adaln_out, validate
from adaln_lab.harness.inputs import make

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
HAS_DIFFUSERS = importlib.util.find_spec("diffusers") is not None


@pytest.fixture
def args():
    return list(make(1, 6, H=16, D=8, T=3).args)


def test_returns_shapes(args):
    assert validate(*args, 1e-5) == (6, 16, 3, 8)
    x = args[0].expand(2, 3, 6, 16)
    assert validate(x, *args[1:], 1e-5) == (6, 16, 3, 8)


def test_empty_inputs_accepted(args):
    empty = torch.zeros(0, dtype=torch.int64)
    assert validate(args[0][:0], *args[1:5], empty, 1e-5) == (0, 16, 3, 8)
    assert validate(torch.zeros(2, 0, 16, dtype=BF16), *args[1:5], empty, 1e-5) == (0, 16, 3, 8)
    # a leading dim of 0: no rows, but S = 6 and the indices are still checked
    assert validate(torch.zeros(0, 6, 16, dtype=BF16), *args[1:], 1e-5) == (6, 16, 3, 8)
    bad = args[5].clone()
    bad[0] = 3
    with pytest.raises(IndexError, match="timestep_indices holds 3"):
        validate(torch.zeros(0, 6, 16, dtype=BF16), *args[1:5], bad, 1e-5)


def test_unchecked_indices_skip_only_the_range_check(args):
    args[5] = args[5].clone()
    args[5][2] = 7
    assert validate(*args, 1e-5, check_indices=False) == (6, 16, 3, 8)
    with pytest.raises(IndexError, match="timestep_indices holds 7"):
        validate(*args, 1e-5)
    with pytest.raises(TypeError, match="timestep_indices must be int64"):
        validate(*args[:5], args[5].int(), 1e-5, check_indices=False)


def test_meta_tensors_are_checked_without_reading_values(args):
    meta = [a.to("meta") for a in args]
    assert validate(*meta, 1e-5) == (6, 16, 3, 8)


@pytest.mark.parametrize("eps", [1, 1e-5, np.float32(1e-5), np.float64(1e-6), np.int64(1), fractions.Fraction(1, 10 ** 5),
                                 1e300, 5e-324])
def test_eps_any_positive_finite_real(args, eps):
    validate(*args, eps)


# --------------------------------------------------------------------------------------------- dtype rule

def _cast(args, x_dtype, param_dtype, temb_dtype):
    x, norm_weight, temb, weight, bias, idx = args
    return [x.to(x_dtype), norm_weight.to(param_dtype), temb.to(temb_dtype), weight.to(param_dtype),
            bias.to(param_dtype), idx]


# (x, norm_out's parameters, temb): what MiniMaxH3Transformer3DModel hands norm_out (see
# adaln_lab/core/checks.py and test_every_dtype_the_diffusers_model_runs_is_accepted)
DIFFUSERS_MIXES = [
    (BF16, BF16, F32),   # from_pretrained(torch_dtype=bf16): time_embedder kept float32
    (F16, F16, F32),     # from_pretrained(torch_dtype=fp16)
    (F32, F32, F32),     # default load / fp32
    (F64, F64, F32),     # from_pretrained(torch_dtype=fp64)
    (BF16, BF16, BF16),  # model.to(bf16): time_embedder cast too
    (F16, F16, F16),     # model.half()
    (F64, F64, F64),     # model.double()
    (BF16, F32, F32),    # fp32 load + enable_layerwise_casting(compute_dtype=bf16): norm_out skipped
    (F16, F32, F32),     # fp32 load + layerwise casting to fp16
    (F16, BF16, F32),    # bf16 load + layerwise casting to fp16
    (F16, BF16, BF16),   # model.to(bf16) + layerwise casting to fp16: time_embedder skipped too
    (BF16, F16, F32),    # fp16 load + layerwise casting to bf16
    (F32, BF16, F32),    # bf16 load + layerwise casting to fp32
    (BF16, BF16, F64),   # float64 temb (the goldens' inputs)
]


@pytest.mark.parametrize("x_dtype,param_dtype,temb_dtype", DIFFUSERS_MIXES, ids=str)
def test_dtype_mixes_accepted_with_diffusers_output_dtype(args, x_dtype, param_dtype, temb_dtype):
    """Accepted; the output has diffusers' dtype promote_types(x, parameters) (x's when they agree),
    and equals the diffusers module bit for bit."""
    args = _cast(args, x_dtype, param_dtype, temb_dtype)
    out = final_adaln_out(*args, backend="torch")
    assert out.dtype == torch.promote_types(x_dtype, param_dtype)
    if HAS_DIFFUSERS:
        from adaln_lab.harness.candidates import diffusers_candidate

        assert torch.equal(out, diffusers_candidate().fn(*args))


@pytest.mark.parametrize("which,dtype,match", [
    ("weight", F16, "weight is torch.float16 but norm_weight is torch.bfloat16"),
    ("bias", F32, "bias is torch.float32 but weight is torch.bfloat16"),
    ("norm_weight", F16, "weight is torch.bfloat16 but norm_weight is torch.float16"),
    ("temb", F16, "temb is torch.float16 but weight is torch.bfloat16"),
    ("temb", BF16, None),  # temb in the parameters' dtype: accepted
])
def test_parameter_dtypes_must_agree(args, which, dtype, match):
    position = ("x", "norm_weight", "temb", "weight", "bias").index(which)
    args[position] = args[position].to(dtype)
    if match is None:
        validate(*args, 1e-5)
        return
    with pytest.raises(TypeError, match=match):
        validate(*args, 1e-5)


@pytest.mark.skipif(not HAS_DIFFUSERS, reason="the test extra brings diffusers 0.42")
@pytest.mark.parametrize("config", ["fp32", "to_bf16", "to_fp16", "layerwise_fp32_to_bf16", "layerwise_bf16_to_fp16"])
def test_every_dtype_the_diffusers_model_runs_is_accepted(config):
    """A small MiniMaxH3Transformer3DModel in each way of setting its dtype: whatever its norm_out
    receives passes `validate`, and `final_adaln_out` (torch) returns norm_out's own output, bitwise."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    torch.manual_seed(0)
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=2, attention_head_dim=96, hidden_size=64, num_layers=1, num_refiner_layers=1,
        ffn_dim=32, in_channels=4, audio_in_channels=4, patch_size=(1, 1, 1), text_dim=16, freq_dim=16,
        time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=16)
    if config.startswith("to_"):
        model = model.to({"to_bf16": BF16, "to_fp16": F16}[config])
    elif config == "layerwise_fp32_to_bf16":
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=BF16)
    elif config == "layerwise_bf16_to_fp16":
        model = model.to(BF16)
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=F16)
    seen = []

    def hook(module, inputs, output):
        x, temb, idx = inputs
        call = (x, module.norm.weight, temb, module.linear.weight, module.linear.bias, idx)
        validate(*call, module.norm.eps)
        ours = final_adaln_out(*call, module.norm.eps, backend="torch")
        seen.append((x.dtype, module.norm.weight.dtype, temb.dtype, torch.equal(ours, output), ours.dtype == output.dtype))

    model.norm_out.register_forward_hook(hook)
    S = 8
    with torch.no_grad():
        model(hidden_states=torch.randn(1, 3, 4), audio_hidden_states=torch.randn(1, 2, 4),
              encoder_hidden_states=torch.randn(1, 3, 16), timestep=torch.tensor([0.3, 0.7]),
              timestep_indices=torch.tensor([0, 1, 0, 1, 0, 1, 0, 1]), token_tags=torch.tensor([1, 1, 1, 0, 0, 0, 2, 2]),
              position_ids=torch.zeros(S, 3, dtype=torch.long), video_indices=torch.tensor([3, 4, 5]),
              audio_indices=torch.tensor([6, 7]), text_indices=torch.tensor([0, 1, 2]))
    (x_dtype, param_dtype, temb_dtype, equal, same_dtype), = seen
    assert (x_dtype, param_dtype, temb_dtype) in DIFFUSERS_MIXES
    assert equal and same_dtype


# --------------------------------------------------------------------------------------------- speed

def test_validate_stays_cheap(args):
    """It runs on every call: ~4 us on small CPU tensors (10k calls ~40 ms here, ~21 ms without the
    index range check). A generous 50 us bound catches a per-call sync or a Python loop over data."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(2000):
            validate(*args, 1e-5)
        best = min(best, (time.perf_counter() - start) / 2000)
    assert best < 50e-6, f"validate takes {best * 1e6:.1f} us per call"


# --------------------------------------------------------------------------------------------- dispatch

def test_cupy_backend_needs_cuda(args):
    with pytest.raises(ValueError, match="the CUDA kernels need CUDA tensors, but x is on cpu"):
        final_adaln_out(*args, backend="cupy")


def test_leading_dims_accepted(args):
    x = torch.stack([args[0], args[0]])
    out = final_adaln_out(x, *args[1:])
    assert out.shape == x.shape and torch.equal(out[0], out[1])


def test_cuda_tensors_without_cupy_name_the_cuda_extra(monkeypatch):
    """Without CuPy (the cuda extra not installed) the kernel rule's reason for CUDA tensors, the reason "auto"
    falls back with and backend "cupy" raises, says what to install."""
    import types

    from adaln_lab.core import support

    x = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, shape=(4, 64))
    monkeypatch.setattr(support, "CUPY_FOUND", False)
    error = support.rows(x, 3)
    assert isinstance(error, ImportError) and "pip install 'adaln_lab[cuda]'" in str(error)
    with pytest.raises(ImportError, match=r"pip install 'adaln_lab\[cuda\]'"):
        support.route("modulated_rms_norm", "cupy", x, error)
    monkeypatch.setattr(support, "CUPY_FOUND", True)
    assert support.rows(x, 3) is None


def test_the_cupy_lookup_traces_under_torch_compile_fullgraph(monkeypatch):
    """The kernel rule's CuPy lookup inside a fullgraph compile: no graph break (importlib's find_spec cannot be
    traced; the GPU test of the compiled op failed on it). The lookup is made once, when the rule's module loads,
    and the rule traced reads it: the answer for CUDA tensors with and without CuPy."""
    import types

    from adaln_lab.core import support

    assert support.CUPY_FOUND == (importlib.util.find_spec("cupy") is not None)
    x = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, shape=(4, 64))
    compiled = torch.compile(lambda t: t + float(support.rows(x, 3) is None), fullgraph=True, backend="eager")
    for found in (False, True):
        monkeypatch.setattr(support, "CUPY_FOUND", found)
        torch._dynamo.reset()
        assert compiled(torch.zeros(1)).item() == float(found)
