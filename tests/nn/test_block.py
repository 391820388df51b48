"""`adaln_lab.nn.block.AdaLNTransformerBlock`: a drop-in for diffusers' `MiniMaxH3TransformerBlock` (shared
submodules, same state dict, forward bit for bit on the CPU, gradients close), refusing what it cannot take;
GPU: the kernels against diffusers' block within bf16 noise. The op under it, `block_adaln_path`:
tests/ops/test_block_adaln.py."""

import pytest
import torch
import torch.nn as nn

from adaln_lab import AdaLNTransformerBlock
from adaln_lab.core import support

diffusers = pytest.importorskip("diffusers", reason="the test extra brings diffusers 0.42")
from diffusers.models.transformers.transformer_minimax_h3 import (  # noqa: E402
    MiniMaxH3RotaryPosEmbed, MiniMaxH3TransformerBlock)

# hidden_size, heads, head_dim, ffn_dim, time_embed_dim, norm_eps, qk_norm_eps; rope_freq_dim (6 * it rotated)
TINY = (32, 2, 16, 64, 16, 1e-5, 1e-6), 2
SMALL = (256, 2, 64, 512, 256, 1e-5, 1e-5), 4


def make_block(seed=0, dtype=torch.float32, config=TINY, device="cpu"):
    torch.manual_seed(seed)
    block = MiniMaxH3TransformerBlock(*config[0])
    with torch.no_grad():
        for norm in (block.norm1, block.norm2, block.attn.norm_q, block.attn.norm_k):
            norm.weight.uniform_(0.5, 1.5)
        block.adaln_proj.linear.bias.normal_(0, 0.1)
    return block.to(device=device, dtype=dtype)


def block_inputs(seed=1, S=17, batch=2, T=3, x_dtype=torch.float32, temb_dtype=torch.float32, config=TINY,
                 device="cpu"):
    """hidden_states (batch, S, H), temb (T, D), adaln_indices (S,) = timestep * 3 + tag, rotary_emb."""
    (H, _, _, _, D, _, _), rope = config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, S, H, generator=g).to(x_dtype)
    temb = torch.randn(T, D, generator=g).to(temb_dtype)
    adaln_indices = torch.randint(0, T, (S,), generator=g) * 3 + torch.randint(0, 3, (S,), generator=g)
    rotary_emb = MiniMaxH3RotaryPosEmbed(rope_freq_dim=rope)(torch.randint(0, 8, (S, 3), generator=g))
    x, temb, adaln_indices = x.to(device), temb.to(device), adaln_indices.to(device)
    return x, temb, adaln_indices, tuple(t.to(device) for t in rotary_emb)


def _block_grads(block, inputs, dy):
    block.zero_grad(set_to_none=True)
    x = inputs[0].detach().clone().requires_grad_(True)
    temb = inputs[1].detach().clone().requires_grad_(True)
    out = block(x, temb, *inputs[2:])
    out.backward(dy)
    return out.detach(), {"x": x.grad, "temb": temb.grad,
                          **{name: p.grad.clone() for name, p in block.named_parameters()}}


def test_from_diffusers_shares_everything_and_to_diffusers_gives_it_back():
    block = make_block().eval()
    ours = AdaLNTransformerBlock.from_diffusers(block, backend="torch", table_backend="torch")
    for name in ("norm1", "attn", "norm2", "ff", "adaln_proj"):
        assert getattr(ours, name) is getattr(block, name)
    assert not ours.training and (ours.backend, ours.table_backend) == ("torch", "torch")
    assert list(ours.state_dict()) == list(block.state_dict())
    assert all(a is b for a, b in zip(ours.parameters(), block.parameters()))
    back = ours.to_diffusers()
    assert type(back) is MiniMaxH3TransformerBlock and not back.training
    assert all(getattr(back, n) is getattr(block, n) for n in ("norm1", "attn", "norm2", "ff", "adaln_proj"))
    assert "backend='torch'" in repr(ours)
    fresh = AdaLNTransformerBlock(*TINY[0])
    assert list(fresh.state_dict()) == list(block.state_dict())
    fresh.load_state_dict(block.state_dict())
    block.load_state_dict(fresh.state_dict())


# (block dtype, x dtype, temb dtype): fp32, bf16 blocks with the checkpoint's fp32 temb, a block cast wholesale
PRECISIONS = {"fp32": (torch.float32,) * 3, "mixed": (torch.bfloat16, torch.bfloat16, torch.float32),
              "bf16": (torch.bfloat16,) * 3}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_forward_bitwise_diffusers_and_gradients_close(precision):
    dtype, x_dtype, temb_dtype = PRECISIONS[precision]
    block = make_block(2, dtype)
    inputs = block_inputs(3, x_dtype=x_dtype, temb_dtype=temb_dtype)
    dy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(4)).to(x_dtype)
    want, theirs = _block_grads(block, inputs, dy)
    ours_block = AdaLNTransformerBlock.from_diffusers(block)
    got, ours = _block_grads(ours_block, inputs, dy)
    assert torch.equal(got, want)
    tol = 2 ** -5 if dtype == torch.bfloat16 else 1e-5
    for name, g in theirs.items():
        assert ours[name] is not None and ours[name].dtype == g.dtype and torch.isfinite(ours[name]).all(), name
        assert (ours[name].double() - g.double()).abs().max() <= tol * g.double().abs().max(), name
    again = _block_grads(ours_block, inputs, dy)[1]
    assert all(torch.equal(ours[n], again[n]) for n in ours)  # repeatable bit for bit
    replayed = _block_grads(AdaLNTransformerBlock.from_diffusers(block, backend="torch"), inputs, dy)
    assert torch.equal(replayed[0], want) and all(torch.equal(replayed[1][n], theirs[n]) for n in theirs)


class LoRALinear(nn.Module):  # what PEFT puts in place of a Linear
    def __init__(self, base):
        super().__init__()
        self.base_layer = base

    def forward(self, x):
        return self.base_layer(x)


def test_hooks_or_an_adapter_on_what_it_reads_run_diffusers_forward_with_a_warning():
    """A hook on norm1 or an adapter layer in place of adaln_proj.linear would be skipped by the ops: the block
    runs diffusers' own forward for those calls (the hook runs, the adapter's parameters get gradients, the
    output is diffusers' bit for bit) and says so once per reason."""
    from adaln_lab.nn import AdaLNFallbackWarning

    block = make_block()
    inputs = block_inputs()
    want = block(*inputs)
    calls = []
    handle = block.norm1.register_forward_hook(lambda *args: calls.append(1))
    ours = AdaLNTransformerBlock.from_diffusers(block)
    with pytest.warns(AdaLNFallbackWarning, match="norm1 has forward_hooks"):
        got = ours(*inputs)
    assert calls == [1] and torch.equal(got, want)
    handle.remove()
    block.adaln_proj.linear = LoRALinear(block.adaln_proj.linear)
    ours = AdaLNTransformerBlock.from_diffusers(block)
    with pytest.warns(AdaLNFallbackWarning, match="adaln_proj.linear is a LoRALinear"):
        got = ours(*inputs)
    assert torch.equal(got, want)
    got.sum().backward()
    assert block.adaln_proj.linear.base_layer.weight.grad is not None


def test_refusals_name_what_cannot_be_taken():
    block = make_block()
    with pytest.raises(ValueError, match="backend"):
        AdaLNTransformerBlock.from_diffusers(block, backend="triton")
    with pytest.raises(ValueError, match="table_backend"):
        AdaLNTransformerBlock.from_diffusers(block, table_backend="cublas")
    linear = block.adaln_proj.linear
    block.adaln_proj.linear = nn.Linear(16, 6 * 32)
    with pytest.raises(TypeError, match="18 \\* H"):
        AdaLNTransformerBlock.from_diffusers(block)
    block.adaln_proj.linear = linear
    block.norm2 = nn.LayerNorm(32)
    with pytest.raises(TypeError, match="norm2 must be an nn.RMSNorm"):
        AdaLNTransformerBlock.from_diffusers(block)


# ---------------------------------------------------------------- GPU (H200) ----------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("table_backend", ["torch", "cuda"])
@pytest.mark.parametrize("precision", ["mixed", "bf16"])
def test_cuda_block_matches_diffusers_within_bf16_noise(precision, table_backend):
    """The patched block against diffusers' on the same inputs. The kernels move an element of a norm's
    output by a rounding, rarely (and table.cu a table entry by a bf16 ulp), and attention spreads that over
    the rows; the bound: the two bf16 blocks differ by at most twice diffusers' own distance from the same
    block in float32, i.e. by bf16 rounding noise, not by a different function."""
    dtype, x_dtype, temb_dtype = PRECISIONS[precision]
    block = make_block(6, dtype, SMALL, device="cuda")
    inputs = block_inputs(7, S=1024, x_dtype=x_dtype, temb_dtype=temb_dtype, config=SMALL, device="cuda")
    ours = AdaLNTransformerBlock.from_diffusers(block, table_backend=table_backend)
    assert support.block(inputs[0], inputs[1], block.adaln_proj.linear.weight, block.adaln_proj.linear.bias,
                         block.norm1.weight, block.norm2.weight) is None  # the kernels do run
    with torch.no_grad():
        want = block(*inputs)
        got = ours(*inputs)
        wide = make_block(6, torch.float32, SMALL, device="cuda")
        wide.load_state_dict(block.state_dict())
        ref = wide(inputs[0].float(), inputs[1].float(), *inputs[2:])
    assert got.dtype == want.dtype == torch.bfloat16
    noise = (want.float() - ref).abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= 2 * noise
    assert (got.float() - ref).norm().item() <= 1.25 * (want.float() - ref).norm().item()
