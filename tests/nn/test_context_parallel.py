"""diffusers' context parallelism on the patched model, emulated on one device.

`MiniMaxH3Transformer3DModel._cp_plan` splits, for rank r of W, the packed rows at the first block
(`hidden_states.chunk(W, dim=1)[r]`) and every row index with them (`adaln_indices.chunk(W, 0)[r]` at each block,
`timestep_indices.chunk(W, 0)[r]` at norm_out); temb and the parameters are whole on every rank. So under context
parallelism an AdaLN op sees one contiguous slice of the rows with their indices. What holds: every rank's slice
through the op gives each of its rows the output and row gradient (dx) bits that row gets unsharded, for the block's
AdaLN path (row-wise stand-ins for attention and the feed-forward, so that only the AdaLN ops decide) and for
norm_out, on the CPU (the ops' torch code) and on the GPU (the kernels, no fallback). Each rank's parameter
gradients are its rows' part (checked to repeat bitwise); their sum over the ranks is the data-parallel all-reduce's,
for a run of several GPUs to measure.
"""

import warnings

import pytest
import torch

from adaln_lab import block_adaln_path, final_adaln_out
from adaln_lab.harness.block_protocol import rowwise_attn, rowwise_ff
from adaln_lab.ops import KernelFallbackWarning

pytestmark = pytest.mark.integration  # gloo ranks in processes of their own

WORLDS = (2, 4)


def _leaves(seed, S, H, D, T, table_rows, device):
    g = torch.Generator().manual_seed(seed)
    leaves = dict(x=(torch.randn(1, S, H, generator=g) * 2).bfloat16(), temb=torch.randn(T, D, generator=g),
                  weight=(torch.randn(table_rows * H, D, generator=g) * D ** -0.5).bfloat16(),
                  bias=(torch.randn(table_rows * H, generator=g) * 0.02).bfloat16(),
                  norm1_weight=(0.5 + torch.rand(H, generator=g)).bfloat16(),
                  norm2_weight=(0.5 + torch.rand(H, generator=g)).bfloat16())
    dy = torch.randn(1, S, H, generator=g).bfloat16()
    return {k: v.to(device) for k, v in leaves.items()}, dy.to(device)


def _block(leaves, index):
    return block_adaln_path(leaves["x"], leaves["temb"], leaves["weight"], leaves["bias"], leaves["norm1_weight"],
                            leaves["norm2_weight"], index, rowwise_attn, rowwise_ff)


def _norm_out(leaves, index):
    return final_adaln_out(leaves["x"], leaves["norm1_weight"], leaves["temb"], leaves["weight"], leaves["bias"], index)


def _leaky(leaves, index):
    """A planted counter-example: each row also reads the mean of all the rows it is sharded with."""
    return _block(leaves, index) + leaves["x"].mean(dim=1, keepdim=True)


# op, table rows per H, table rows per timestep
OPS = {"block_adaln_path": (_block, 18, 3), "final_adaln_out": (_norm_out, 2, 1), "leaky": (_leaky, 18, 3)}


def _run(op, leaves, index, dy):
    """out and dx of `op` on these rows, and the parameter gradients of their part."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}
    out = op(leaves, index)
    out.backward(dy)
    return out.detach(), leaves["x"].grad, {k: v.grad for k, v in leaves.items() if k != "x" and v.grad is not None}


def _emulate(name, device, S, H, D=32, T=3):
    op, table_rows, per_timestep = OPS[name]
    leaves, dy = _leaves(11, S, H, D, T, table_rows, device)
    index = torch.randint(0, per_timestep * T, (S,), generator=torch.Generator().manual_seed(12)).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        out, dx, _ = _run(op, leaves, index, dy)
        for world in WORLDS:
            shards = []
            for r in range(world):
                rank_leaves = dict(leaves, x=leaves["x"].chunk(world, dim=1)[r])
                first = _run(op, rank_leaves, index.chunk(world, 0)[r], dy.chunk(world, dim=1)[r])
                again = _run(op, rank_leaves, index.chunk(world, 0)[r], dy.chunk(world, dim=1)[r])
                for key, g in first[2].items():
                    assert torch.equal(g, again[2][key]), (name, world, r, key)
                shards.append(first)
            assert torch.equal(torch.cat([s[0] for s in shards], dim=1), out), (name, world)
            assert torch.equal(torch.cat([s[1] for s in shards], dim=1), dx), (name, world)


@pytest.mark.parametrize("name", ["block_adaln_path", "final_adaln_out"])
def test_each_ranks_rows_get_their_unsharded_bits(name):
    _emulate(name, "cpu", S=48, H=64)


def test_the_emulation_catches_a_row_that_reads_other_rows():
    with pytest.raises(AssertionError):
        _emulate("leaky", "cpu", S=48, H=64)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["block_adaln_path", "final_adaln_out"])
def test_cuda_each_ranks_rows_get_their_unsharded_bits_on_the_kernels(name):
    _emulate(name, "cuda", S=4096, H=512, D=256, T=3)


def test_the_plans_names_reach_the_patched_modules_arguments():
    """The plan's hooks key on module names and forward argument names: patching keeps both."""
    import inspect

    import adaln_lab

    from .test_patch import ALL_PARTS, make_model

    model = make_model(3, "fp32")
    assert adaln_lab.patch(model, parts=ALL_PARTS)
    modules = dict(model.named_modules())
    for key, plan in model._cp_plan.items():
        names = [n for n in modules if n == key or (key.endswith(".*") and n.startswith(key[:-1])
                                                       and "." not in n[len(key) - 1:])]
        assert names, key
        for name in names:
            if isinstance(plan, dict):
                params = inspect.signature(modules[name].forward).parameters
                assert all(isinstance(arg, int) or arg in params for arg in plan), (name, list(plan), list(params))
