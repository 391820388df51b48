"""ExactGradients.all_reduce over gloo ranks (CPU, one spawn of 4): norm_out and a block's AdaLN, one global batch
dealt to W = 2 and 4 ranks by sample and within samples, one or two micro-batches a rank: after all_reduce every rank
writes the bits one process writes for the whole batch (and for its rows permuted); the time embedding's gradient,
summed over the ranks, is within rounding of one process's; a planted fp32 all-reduce of plain gradients is caught
by the same check."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adaln_lab import block_adaln_path, final_adaln_out
from adaln_lab.nn import ExactGradients

from ..exact_parts import block_params, by_sample, time_embedding, within

pytestmark = pytest.mark.integration  # gloo ranks in processes of their own

B, S, H, D, T = 4, 12, 16, 8, 5


def setup(seed: int = 0):
    """(norm_out params, block params, time embedding, row-wise attn / ff mix, batch (x, feats, idx, row_index,
    cot))."""
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    out_params = [torch.nn.Parameter((1 + 0.1 * torch.randn(H, generator=g)).to(bf)),
                  torch.nn.Parameter((0.1 * torch.randn(2 * H, D, generator=g)).to(bf)),
                  torch.nn.Parameter((0.1 * torch.randn(2 * H, generator=g)).to(bf))]
    blocks = block_params(g, H, D)
    embed = time_embedding(g, D)  # every process builds the same model
    mix = (torch.randn(H, H, generator=g) / H ** 0.5).to(bf)
    x = (torch.randn(B, S, H, generator=g) * torch.exp2(torch.randint(-3, 4, (B, S, 1), generator=g))).to(bf)
    feats = torch.randn(T, 4, generator=g)
    idx = torch.randint(0, T, (S,), generator=g)
    row_index = 3 * idx + torch.randint(0, 3, (S,), generator=g)
    cot = torch.randn(B, S, H, generator=g) * torch.exp2(torch.randint(-10, 4, (B, S, H), generator=g))
    return out_params, blocks, embed, mix, (x, feats, idx, row_index, cot)


def parts_of(batch, world: int, rank: int, how: str, micro: int):
    """This rank's micro-batches: the samples (how "sample") or the rows (how "rows") dealt to `world` ranks, each
    rank's share cut in `micro` parts."""
    return (by_sample if how == "sample" else within)(batch, world * micro)[rank::world]


def own_timesteps(parts):
    """Each part passing only the temb rows its rows use (indices remapped): (x, those feats rows, idx, row_index,
    cot)."""
    out = []
    for x, feats, idx, row_index, cot in parts:
        used = idx.unique()
        out.append((x, feats[used], torch.searchsorted(used, idx), 3 * torch.searchsorted(used, idx) + row_index % 3,
                    cot))
    return out


def run(parts, exact=True, reduce=None):
    """Forward and backward of each part through a block then norm_out, then the AdaLN gradients and the time
    embedding's; with `reduce` (a process group) summed over its ranks: the exact states before write, or (exact
    False, the planted one) the plain gradients in fp32 after."""
    out_params, blocks, embed, mix, _ = setup()
    acc = ExactGradients()
    for x, feats, idx, row_index, cot in parts:
        temb = embed(feats)
        with acc if exact else torch.enable_grad():
            h = block_adaln_path(x, temb, *blocks, row_index, lambda a: torch.tanh(a @ mix),
                                 lambda a: a * torch.sigmoid(a), backend="torch")
            out = final_adaln_out(h, out_params[0], temb, *out_params[1:], idx)
            (out.float() * cot).sum().backward()
    if exact:
        if reduce is not None:
            acc.all_reduce(reduce)
        acc.write()
    grads = [p.grad for p in [*blocks, *out_params]]
    if reduce is not None and not exact:  # the planted one: plain gradients all-reduced in fp32
        for g in grads:
            buf = g.float()
            dist.all_reduce(buf, group=reduce)
            g.copy_(buf)
    embed_grad = embed.weight.grad.clone()
    if reduce is not None:
        dist.all_reduce(embed_grad, group=reduce)
    return grads, embed_grad


CASES = (((0, 1), "rows", 2, True, False), ((0, 1, 2, 3), "sample", 1, True, False),
         ((0, 1, 2, 3), "rows", 1, True, False), ((1, 2), "rows", 1, True, True), ((0, 1), "rows", 1, False, False))
"""(ranks, how, micro-batches a rank, exact, parts with only their own timesteps): each run by those of 4 gloo ranks
(a group of its own; (1, 2): group ranks that are not the global ones, and ranks holding different timesteps), in one
spawn."""


def _worker(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        batch = setup()[4]
        for members, how, micro, exact, own in CASES:
            group = dist.new_group(list(members))  # every rank makes every group, in the same order
            if rank in members:
                parts = parts_of(batch, len(members), members.index(rank), how, micro)
                grads, embed_grad = run(own_timesteps(parts) if own else parts, exact=exact, reduce=group)
                if rank == members[0]:
                    out.put((members, [g.float() for g in grads], embed_grad))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_world_size_and_split_writes_one_process_bits_and_a_planted_fp32_reduce_is_caught():
    batch = setup()[4]
    one, one_embed = run([batch])
    x, feats, idx, row_index, cot = batch
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(2))
    permuted, _ = run([(x[:, perm], feats, idx[perm], row_index[perm], cot[:, perm])])
    assert all(torch.equal(a, b) for a, b in zip(one, permuted))
    plain, _ = run([batch], exact=False)
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(4)]
    for p in procs:
        p.start()
    got = [out.get(timeout=180) for _ in CASES]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [g[0] for g in got] == [c[0] for c in CASES]
    held = [len(part[1]) for r in (0, 1) for part in own_timesteps(parts_of(batch, 2, r, "rows", 1))]
    assert min(held) < T  # the (1, 2) case: a rank without every timestep
    for (members, how, micro, exact, own), (_, grads, embed_grad) in zip(CASES, got):
        want = one if exact else plain
        same = all(torch.equal(a.float(), b) for a, b in zip(want, grads))
        assert same == exact, (members, how, micro, exact)  # the planted fp32 reduce changes some bits
        if exact:
            assert torch.allclose(embed_grad, one_embed, rtol=1e-4, atol=1e-5), (members, how, micro)
