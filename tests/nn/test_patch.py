"""`adaln_lab.patch` on a tiny random `MiniMaxH3Transformer3DModel`: same outputs, gradients and state dict."""

import math
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import adaln_lab
from adaln_lab import AdaLNOut, AdaLNTransformerBlock
from adaln_lab.testing import checkpoint_layout

diffusers = pytest.importorskip("diffusers", reason="the test extra brings diffusers 0.42")
from diffusers import MiniMaxH3Transformer3DModel  # noqa: E402
from diffusers.models.transformers.transformer_minimax_h3 import (  # noqa: E402
    MiniMaxH3AdaLayerNormOut, MiniMaxH3TransformerBlock)

# Smallest config that runs: 2 heads of 16 channels, 12 of them rotated (2 * 3 * rope_freq_dim); H and D
# divisible by 8 as the CUDA kernels want. Video rows are 4 channels x (1, 2, 2) patches = 16.
TINY = dict(num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
            ffn_dim=64, in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=16, freq_dim=16,
            time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2)
TINY_ROWS = dict(text=5, video=8, audio=4)  # S = 17
# For the GPU parity statistics: 2 x 2048 rows x H = 256 -> about a million norm_out elements.
SMALL = dict(num_attention_heads=2, attention_head_dim=64, hidden_size=256, num_layers=2, num_refiner_layers=1,
             ffn_dim=512, in_channels=16, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=64, freq_dim=64,
             time_embed_hidden_dim=256, time_embed_dim=256, rope_freq_dim=4)
SMALL_ROWS = dict(text=128, video=1536, audio=384)
NORM_OUT_KEYS = ["norm_out.norm.weight", "norm_out.linear.weight", "norm_out.linear.bias"]


def make_model(seed, precision, config=TINY):
    """precision: "fp32"; "mixed", the MiniMax-H3 checkpoint's layout (bf16, but `_keep_in_fp32_modules`
    float32, so temb is float32); "bf16", the whole model cast to bf16 (temb is bf16)."""
    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(**config)
    with torch.no_grad():  # norms start at ones: make their weights matter
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight") and p.dim() == 1:
                p.uniform_(0.5, 1.5)
    if precision == "fp32":
        return model
    if precision == "mixed":
        return checkpoint_layout(model)
    return model.to(torch.bfloat16)


def make_inputs(seed, rows=TINY_ROWS, config=TINY, batch=2, device="cpu"):
    """Valid inputs of the model's forward: one packed layout of text, video and audio rows in a shuffled
    order, three distinct timesteps, positions on a small (t, h, w) grid."""
    g = torch.Generator().manual_seed(seed)
    nt, nv, na = rows["text"], rows["video"], rows["audio"]
    S = nt + nv + na
    perm = torch.randperm(S, generator=g)
    text_indices, video_indices, audio_indices = (perm[:nt].sort().values, perm[nt:nt + nv].sort().values,
                                                  perm[nt + nv:].sort().values)
    token_tags = torch.empty(S, dtype=torch.long)
    token_tags[video_indices], token_tags[text_indices], token_tags[audio_indices] = 0, 1, 2
    patch = math.prod(config["patch_size"]) * config["in_channels"]
    inputs = dict(
        hidden_states=torch.randn(batch, nv, patch, generator=g),
        audio_hidden_states=torch.randn(batch, na, config["audio_in_channels"], generator=g),
        encoder_hidden_states=torch.randn(batch, nt, config["text_dim"], generator=g),
        timestep=torch.tensor([0.9, 0.4, 0.0]),
        timestep_indices=torch.randint(0, 3, (S,), generator=g),
        token_tags=token_tags,
        position_ids=torch.randint(0, 8, (S, 3), generator=g),
        video_indices=video_indices, audio_indices=audio_indices, text_indices=text_indices,
    )
    return {k: v.to(device) for k, v in inputs.items()}


def upstreams(seed, model, inputs):
    g = torch.Generator().manual_seed(seed)
    batch = inputs["hidden_states"].shape[0]
    dv = torch.randn(batch, len(inputs["video_indices"]), model.proj_out.out_features, generator=g)
    da = torch.randn(batch, len(inputs["audio_indices"]), model.audio_proj_out.out_features, generator=g)
    device = inputs["hidden_states"].device
    return dv.to(device), da.to(device)


def forward_backward(model, inputs, dys):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    torch.autograd.backward([out.sample, out.audio_sample], list(dys))
    grads = {name: (None if p.grad is None else p.grad.clone()) for name, p in model.named_parameters()}
    return out.sample.detach(), out.audio_sample.detach(), grads


def test_patch_swaps_norm_out_and_unpatch_restores_it():
    model = make_model(0, "fp32")
    original = model.norm_out
    assert adaln_lab.patch(model, backend="torch", table_backend="torch", parts="norm_out") == ["norm_out"]
    assert type(model.norm_out) is AdaLNOut
    assert (model.norm_out.backend, model.norm_out.table_backend) == ("torch", "torch")
    assert model.norm_out.norm is original.norm and model.norm_out.linear is original.linear
    assert adaln_lab.patch(model, parts="norm_out") == []  # patching twice is a no-op
    assert model.norm_out.backend == "torch"
    assert adaln_lab.unpatch(model) == ["norm_out"]
    assert type(model.norm_out) is MiniMaxH3AdaLayerNormOut
    assert model.norm_out.norm is original.norm and model.norm_out.linear is original.linear
    assert adaln_lab.unpatch(model) == []
    assert not any(isinstance(m, AdaLNOut) for m in model.modules())


def test_patch_keeps_parameters_state_dict_and_training_flag():
    model = make_model(1, "mixed").eval()
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    adaln_lab.patch(model, parts="norm_out")
    assert list(model.state_dict()) == keys
    assert all(params[name] is p for name, p in model.named_parameters())
    assert dict(model.named_parameters()).keys() == params.keys()
    assert not model.norm_out.training
    assert model.norm_out.linear.weight.dtype == torch.bfloat16
    assert all(k in keys for k in NORM_OUT_KEYS)


@pytest.mark.parametrize("precision", ["fp32", "mixed", "bf16"])
def test_patched_model_bitwise_equals_unpatched_on_cpu(precision):
    model = make_model(2, precision)
    inputs = make_inputs(3)
    dys = upstreams(4, model, inputs)
    video_a, audio_a, grads_a = forward_backward(model, inputs, dys)
    assert adaln_lab.patch(model, parts="norm_out") == ["norm_out"]
    video_b, audio_b, grads_b = forward_backward(model, inputs, dys)
    assert torch.equal(video_a, video_b) and torch.equal(audio_a, audio_b)
    assert grads_a.keys() == grads_b.keys()
    for key in NORM_OUT_KEYS:
        assert grads_b[key] is not None and torch.isfinite(grads_b[key]).all(), key
        assert grads_b[key].abs().max() > 0, key
    for name in grads_a:  # every parameter of the model, the AdaLN ones and upstream of norm_out alike
        assert (grads_a[name] is None) == (grads_b[name] is None), name
        if grads_a[name] is not None:
            assert torch.equal(grads_a[name], grads_b[name]), name
    adaln_lab.unpatch(model)
    video_c, audio_c, grads_c = forward_backward(model, inputs, dys)
    assert torch.equal(video_a, video_c) and all(torch.equal(grads_a[k], grads_c[k]) for k in NORM_OUT_KEYS)


def test_state_dicts_load_both_ways():
    source, patched = make_model(5, "mixed"), make_model(6, "mixed")
    adaln_lab.patch(patched, parts="norm_out")
    inputs = make_inputs(7)
    with torch.no_grad():
        want = source(**inputs).sample
        patched.load_state_dict(source.state_dict())  # patched model loads an unpatched state dict
        assert torch.equal(patched(**inputs).sample, want)
        plain = make_model(8, "mixed")
        plain.load_state_dict(patched.state_dict())  # and the other way round
        assert torch.equal(plain(**inputs).sample, want)
    assert list(plain.state_dict()) == list(patched.state_dict())


def test_patch_finds_every_module_in_any_tree_and_shared_ones_once():
    shared = MiniMaxH3AdaLayerNormOut(32, 16, 1e-5)
    tree = nn.ModuleDict({"a": nn.Sequential(nn.Identity(), shared),
                          "b": nn.ModuleList([MiniMaxH3AdaLayerNormOut(32, 16, 1e-6)]),
                          "c": shared})
    assert adaln_lab.patch(tree, parts="norm_out") == ["a.1", "b.0", "c"]
    assert tree["a"][1] is tree["c"] and type(tree["c"]) is AdaLNOut and tree["c"].norm is shared.norm
    assert tree["b"][0].norm.eps == 1e-6
    assert adaln_lab.unpatch(tree) == ["a.1", "b.0", "c"]
    assert tree["a"][1] is tree["c"] and type(tree["c"]) is MiniMaxH3AdaLayerNormOut


def test_patch_refuses_what_it_cannot_swap_and_leaves_the_model_alone():
    model = make_model(9, "fp32")
    with pytest.raises(ValueError, match="backend"):
        adaln_lab.patch(model, backend="triton", parts="norm_out")
    handle = model.norm_out.register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match="norm_out has forward_hooks"):
        adaln_lab.patch(model, parts="norm_out")
    handle.remove()
    model.norm_out._diffusers_hook = object()  # e.g. group offloading at the module itself: a swap drops it
    with pytest.raises(ValueError, match="norm_out carries a _diffusers_hook"):
        adaln_lab.patch(model, parts="norm_out")
    del model.norm_out._diffusers_hook
    assert type(model.norm_out) is MiniMaxH3AdaLayerNormOut
    with pytest.raises(ValueError, match="itself"):
        adaln_lab.patch(model.norm_out, parts="norm_out")


def test_patch_without_diffusers_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # import diffusers now raises ImportError
    with pytest.raises(ImportError, match="need diffusers"):
        adaln_lab.patch(nn.Linear(2, 2), parts="norm_out")
    with pytest.raises(ImportError, match="need diffusers"):
        adaln_lab.unpatch(nn.Linear(2, 2))


# ---------------------------------------------------------------- blocks (issue 11) ---------------------------

BLOCKS = ["transformer_blocks.0", "transformer_blocks.1"]
ALL_PARTS = ("norm_out", "blocks")


def adaln_keys(model):
    """The AdaLN parameters: norm_out's and every block's norm1, norm2 and adaln_proj."""
    return [name for name, _ in model.named_parameters()
            if name.startswith("norm_out.") or (name.startswith("transformer_blocks.")
                                                and any(k in name for k in (".norm1.", ".norm2.", ".adaln_proj.")))]


def test_patch_blocks_and_unpatch_restores_both():
    model = make_model(20, "fp32")
    originals = list(model.transformer_blocks)
    subs = [(b.norm1, b.attn, b.norm2, b.ff, b.adaln_proj) for b in originals]
    assert adaln_lab.patch(model, parts=ALL_PARTS, backend="torch") == ["norm_out", *BLOCKS]
    assert all(type(b) is AdaLNTransformerBlock and b.backend == "torch" for b in model.transformer_blocks)
    assert [(b.norm1, b.attn, b.norm2, b.ff, b.adaln_proj) for b in model.transformer_blocks] == subs
    assert adaln_lab.patch(model, parts=ALL_PARTS) == []
    assert adaln_lab.unpatch(model, parts="blocks") == BLOCKS
    assert type(model.norm_out) is AdaLNOut
    assert all(type(b) is MiniMaxH3TransformerBlock for b in model.transformer_blocks)
    assert [(b.norm1, b.attn, b.norm2, b.ff, b.adaln_proj) for b in model.transformer_blocks] == subs
    assert adaln_lab.patch(model, parts="blocks") == BLOCKS
    assert adaln_lab.unpatch(model) == ["norm_out", *BLOCKS]  # default: both parts
    assert adaln_lab.patch(model, backend="torch") == ["norm_out", *BLOCKS]  # default: both parts
    assert adaln_lab.unpatch(model) == ["norm_out", *BLOCKS]
    assert not any(isinstance(m, (AdaLNOut, AdaLNTransformerBlock)) for m in model.modules())
    for bad in ((), ("blocks", "attention"), "norm"):
        with pytest.raises(ValueError, match="parts"):
            adaln_lab.patch(model, parts=bad)


@pytest.mark.parametrize("precision", ["fp32", "mixed", "bf16"])
def test_patched_blocks_forward_bitwise_gradients_flow_and_adaln_gradients_repeat(precision):
    model = make_model(21, precision)
    inputs = make_inputs(22)
    dys = upstreams(23, model, inputs)
    video_a, audio_a, grads_a = forward_backward(model, inputs, dys)
    adaln_lab.patch(model, parts=ALL_PARTS)
    video_b, audio_b, grads_b = forward_backward(model, inputs, dys)
    assert torch.equal(video_a, video_b) and torch.equal(audio_a, audio_b)
    tol = 1e-5 if precision == "fp32" else 2 ** -4  # the new backward rounds elsewhere: gradients move slightly
    for name, g in grads_a.items():
        assert (g is None) == (grads_b[name] is None), name
        if g is not None:
            assert torch.isfinite(grads_b[name]).all() and grads_b[name].dtype == g.dtype, name
            assert (grads_b[name].double() - g.double()).abs().max() <= tol * g.double().abs().max(), name
    again = forward_backward(model, inputs, dys)[2]
    keys = adaln_keys(model)
    assert len(keys) == 3 + 2 * 4
    assert all(torch.equal(grads_b[k], again[k]) for k in keys)


def test_patched_blocks_with_gradient_checkpointing_match():
    model = make_model(24, "mixed")
    inputs = make_inputs(25)
    dys = upstreams(26, model, inputs)
    adaln_lab.patch(model, parts=ALL_PARTS)
    plain = forward_backward(model, inputs, dys)
    model.enable_gradient_checkpointing()
    checkpointed = forward_backward(model, inputs, dys)
    assert torch.equal(plain[0], checkpointed[0])
    assert all(torch.equal(plain[2][k], checkpointed[2][k]) for k in adaln_keys(model))


def test_state_dicts_load_both_ways_with_blocks_patched():
    source, patched = make_model(27, "mixed"), make_model(28, "mixed")
    adaln_lab.patch(patched, parts=ALL_PARTS)
    assert list(patched.state_dict()) == list(source.state_dict())
    inputs = make_inputs(29)
    with torch.no_grad():
        want = source(**inputs).sample
        patched.load_state_dict(source.state_dict())
        assert torch.equal(patched(**inputs).sample, want)
        plain = make_model(30, "mixed")
        plain.load_state_dict(patched.state_dict())
        assert torch.equal(plain(**inputs).sample, want)


def test_patch_refuses_hooked_blocks_and_swaps_nothing():
    model = make_model(31, "fp32")
    model.transformer_blocks[0]._diffusers_hook = object()  # e.g. context parallelism's split of adaln_indices
    with pytest.raises(ValueError, match="transformer_blocks.0 carries a _diffusers_hook"):
        adaln_lab.patch(model, parts=ALL_PARTS)
    del model.transformer_blocks[0]._diffusers_hook
    assert type(model.norm_out) is MiniMaxH3AdaLayerNormOut  # all or nothing
    assert all(type(b) is MiniMaxH3TransformerBlock for b in model.transformer_blocks)


def test_hooks_and_wrappers_on_submodules_survive_the_patch_and_act():
    """A hook on a block's norm2 and a wrapper in place of norm_out.linear (what PEFT's adapters are) stay on
    the shared submodules: the patched model runs diffusers' forward for those modules, so the hook runs, the
    wrapper's parameters get gradients and the output is the unpatched model's bit for bit, with a warning."""
    from adaln_lab.nn import AdaLNFallbackWarning

    model = make_model(32, "fp32")
    inputs = make_inputs(33)
    dys = upstreams(34, model, inputs)
    calls = []
    model.transformer_blocks[1].norm2.register_forward_hook(lambda *args: calls.append(1))
    model.norm_out.linear = nn.Sequential(model.norm_out.linear)
    want_v, want_a, want_grads = forward_backward(model, inputs, dys)
    assert adaln_lab.patch(model, parts=ALL_PARTS) == ["norm_out", *BLOCKS]
    calls.clear()
    with pytest.warns(AdaLNFallbackWarning) as record:
        got_v, got_a, got_grads = forward_backward(model, inputs, dys)
    reasons = " ".join(str(w.message) for w in record)
    assert "norm2 has forward_hooks" in reasons and "linear is a Sequential" in reasons
    assert calls == [1]
    assert torch.equal(got_v, want_v) and torch.equal(got_a, want_a)
    assert got_grads["norm_out.linear.0.weight"] is not None
    assert torch.equal(got_grads["norm_out.linear.0.weight"], want_grads["norm_out.linear.0.weight"])


# ---------------------------------------------------------------- GPU (H200) ----------------------------------


def _bf16_ulp(value: float) -> float:
    return 2.0 ** (math.floor(math.log2(value)) - 7)


def _capture(model):
    seen = {}

    def hook(module, args, output):
        seen["args"], seen["output"] = tuple(a.detach() for a in args), output.detach()

    return seen, model.norm_out.register_forward_hook(hook)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["mixed", "bf16"])
@pytest.mark.parametrize("table_backend,min_equal,max_ulps", [("torch", 0.9999, 2), ("cuda", 0.999, 4)])
def test_patched_model_cuda_matches_unpatched(precision, table_backend, min_equal, max_ulps):
    """norm_out's output against diffusers on the same input: with table_backend="torch" the table is
    diffusers' own (same F.linear, same GPU), so only the row pass can move an element, by a rounding
    of the normalised value (<= 2 ulps of the output's scale); with "cuda" a table entry may also sit
    1 bf16 ulp from cuBLAS's, which moves `1 + scale` and `shift` by an ulp each (<= 4 ulps). The heads
    are linear, so the model outputs move by at most max row-sum |W_head| times norm_out's largest move."""
    model = make_model(10, precision, SMALL).cuda()
    inputs = make_inputs(11, SMALL_ROWS, SMALL, device="cuda")
    reference = model.norm_out
    seen, handle = _capture(model)
    with torch.no_grad():
        ref = model(**inputs)
    ref_args, ref_out = seen["args"], seen["output"]
    handle.remove()
    assert adaln_lab.patch(model, table_backend=table_backend, parts="norm_out") == ["norm_out"]
    seen, handle = _capture(model)
    with torch.no_grad():
        out = model(**inputs)
    handle.remove()
    # the stack before norm_out runs the same kernels on the same data: norm_out saw the same input
    assert all(torch.equal(a, b) for a, b in zip(seen["args"], ref_args))
    assert seen["args"][1].dtype == (torch.float32 if precision == "mixed" else torch.bfloat16)  # temb
    got = seen["output"]
    with torch.no_grad():
        want = reference(*ref_args)
    assert torch.equal(want, ref_out)
    assert got.dtype == want.dtype == torch.bfloat16
    frac = (got == want).float().mean().item()
    ulp = _bf16_ulp(want.abs().max().float().item())
    move = (got.float() - want.float()).abs().max().item()
    assert frac >= min_equal, frac
    assert move <= max_ulps * ulp, (move, ulp)
    # the whole model: the heads are linear in norm_out's output, so they move by at most their largest
    # row sum |W| times norm_out's move, plus each run's own rounding (fp32 accumulation over H terms,
    # one rounding to the head's dtype)
    xmax = got.abs().max().float().item()
    for head, a, b in ((model.proj_out, out.sample, ref.sample),
                       (model.audio_proj_out, out.audio_sample, ref.audio_sample)):
        gain = head.weight.float().abs().sum(dim=1).max().item()
        unit = torch.finfo(head.weight.dtype).eps / 2
        amax = max(a.abs().max().item(), b.abs().max().item())
        bound = gain * move + 2 * (head.in_features * 2.0 ** -24 * gain * xmax + unit * amax)
        assert (a.float() - b.float()).abs().max().item() <= bound


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["mixed", "bf16"])
def test_patched_model_cuda_adaln_gradients_repeat_bitwise(precision):
    model = make_model(12, precision, SMALL).cuda()
    inputs = make_inputs(13, SMALL_ROWS, SMALL, device="cuda")
    dys = upstreams(14, model, inputs)
    adaln_lab.patch(model, parts="norm_out")
    first = forward_backward(model, inputs, dys)[2]
    second = forward_backward(model, inputs, dys)[2]
    for key in NORM_OUT_KEYS:
        assert first[key] is not None and torch.isfinite(first[key]).all(), key
        assert first[key].abs().max() > 0, key
        assert torch.equal(first[key], second[key]), key


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["mixed", "bf16"])
@pytest.mark.parametrize("table_backend", ["torch", "cuda"])
def test_patched_blocks_model_cuda_matches_unpatched_within_bf16_noise(precision, table_backend):
    """norm_out and both blocks on the kernels. Each kernel moves an element by a rounding, rarely, and
    attention spreads such moves; the bound: patched and unpatched bf16 models differ by at most twice the
    unpatched model's own distance from the same model in float32 (bf16 rounding noise), and the patched
    model is no further from float32 than 1.25x the unpatched one (L2 over the outputs)."""
    model = make_model(32, precision, SMALL).cuda()
    inputs = make_inputs(33, SMALL_ROWS, SMALL, device="cuda")
    wide = make_model(32, "fp32", SMALL).cuda()
    wide.load_state_dict(model.state_dict())
    with torch.no_grad():
        ref = model(**inputs)
        f32 = wide(**inputs)
        assert adaln_lab.patch(model, parts=ALL_PARTS, table_backend=table_backend) == ["norm_out", *BLOCKS]
        out = model(**inputs)
    for got, want, exact in ((out.sample, ref.sample, f32.sample), (out.audio_sample, ref.audio_sample,
                                                                     f32.audio_sample)):
        noise = (want.float() - exact.float()).abs().max().item()
        assert (got.float() - want.float()).abs().max().item() <= 2 * noise
        assert (got.float() - exact.float()).norm().item() <= 1.25 * (want.float() - exact.float()).norm().item()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["mixed", "bf16"])
def test_patched_blocks_model_cuda_adaln_gradients_repeat_bitwise(precision):
    """Every AdaLN gradient (norm_out and each block's norm1, norm2, adaln_proj) twice, bit for bit. Attention
    runs SDPA's math backend: the flash / memory-efficient backwards accumulate dq with atomics, which
    would make every gradient upstream of an attention vary from run to run, whatever the AdaLN does."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = make_model(34, precision, SMALL).cuda()
    inputs = make_inputs(35, SMALL_ROWS, SMALL, device="cuda")
    dys = upstreams(36, model, inputs)
    adaln_lab.patch(model, parts=ALL_PARTS)
    with sdpa_kernel(SDPBackend.MATH):
        first = forward_backward(model, inputs, dys)[2]
        second = forward_backward(model, inputs, dys)[2]
    for key in adaln_keys(model):
        assert first[key] is not None and torch.isfinite(first[key]).all(), key
        assert torch.equal(first[key], second[key]), key


def test_patch_of_a_model_with_nothing_to_swap_warns_naming_what_it_looked_for():
    """A model without any of the modules patch swaps (a bare Linear, another architecture) returns [] with a
    NothingToPatchWarning naming the diffusers classes of the parts asked for; patching an already patched
    model returns [] silently."""
    from adaln_lab.nn.patch import NothingToPatchWarning

    assert issubclass(NothingToPatchWarning, UserWarning)
    with pytest.warns(NothingToPatchWarning, match="Linear holds no MiniMaxH3AdaLayerNormOut or "
                                                   "MiniMaxH3TransformerBlock"):
        assert adaln_lab.patch(nn.Linear(4, 4)) == []
    with pytest.warns(NothingToPatchWarning, match=r"Sequential holds no MiniMaxH3TransformerBlock \("):
        assert adaln_lab.patch(nn.Sequential(nn.Linear(4, 4)), parts="blocks") == []
    model = make_model(30, "fp32")
    assert adaln_lab.patch(model, parts="norm_out", backend="torch") == ["norm_out"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert adaln_lab.patch(model, parts="norm_out") == []
