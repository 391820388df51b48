"""Shared pieces of the exact-gradient tests: seeded parameters and time embedding, the splits of a batch, and the
gloo ranks of the multi-process ones (`ranks`).

A batch is a tuple of tensors: (B, S, H) ones (x, the cotangent) are per sample and per row; (S,) ones (indices) per
row; the rest (temb's features) whole in every part."""


import torch


def time_embedding(g: torch.Generator, D: int) -> torch.nn.Linear:
    """Linear(4, D) with weight and bias drawn from `g` (the default init would draw the bias from torch's global
    generator: other data in every process and every call)."""
    embed = torch.nn.Linear(4, D)
    torch.nn.init.normal_(embed.weight, generator=g)
    torch.nn.init.normal_(embed.bias, generator=g)
    return embed


def norm_out_batch(g: torch.Generator, B: int, S: int, H: int, T: int) -> tuple:
    """norm_out's batch drawn from `g`: x (B, S, H) bf16 (rows scaled by 2^-4 .. 2^4), timestep features (T, 4), the
    indices (S,) and a cotangent (B, S, H) float32 spread over 2^-12 .. 2^3."""
    x = (torch.randn(B, S, H, generator=g) * torch.exp2(torch.randint(-4, 5, (B, S, 1), generator=g))).bfloat16()
    feats = torch.randn(T, 4, generator=g)
    idx = torch.randint(0, T, (S,), generator=g)
    cot = torch.randn(B, S, H, generator=g) * torch.exp2(torch.randint(-12, 4, (B, S, H), generator=g))
    return x, feats, idx, cot


def block_params(g: torch.Generator, H: int, D: int, dtype=torch.bfloat16) -> list[torch.nn.Parameter]:
    """A block's AdaLN parameters drawn from `g`: weight (18H, D), bias (18H,), norm1_weight, norm2_weight (H,)."""
    return [torch.nn.Parameter((0.1 * torch.randn(18 * H, D, generator=g)).to(dtype)),
            torch.nn.Parameter((0.1 * torch.randn(18 * H, generator=g)).to(dtype)),
            torch.nn.Parameter((1 + 0.1 * torch.randn(H, generator=g)).to(dtype)),
            torch.nn.Parameter((1 + 0.1 * torch.randn(H, generator=g)).to(dtype))]


def by_sample(batch, n: int) -> list[tuple]:
    """n parts, part k the samples k, k + n, .."""
    return [tuple(t[k::n] if t.dim() == 3 else t for t in batch) for k in range(n)]


def within(batch, n: int) -> list[tuple]:
    """n parts of consecutive rows of every sample."""
    S = batch[0].shape[-2]
    cuts = [round(S * k / n) for k in range(n + 1)]
    return [tuple(t[:, a:b] if t.dim() == 3 else t[a:b] if t.dim() == 1 else t for t in batch)
            for a, b in zip(cuts, cuts[1:])]


def ranks(worker, nprocs: int, tmp_path, backend: str = "gloo"):
    """worker(rank, nprocs, out) in `nprocs` spawned processes, joined into one world of `backend` (gloo; nccl: rank
    r on cuda:r) through a file store in tmp_path (no port to race for beside other test processes; the group
    destroyed after); returns what it saved to `out` (torch.save)."""
    import torch.multiprocessing as mp

    out, store = tmp_path / "found.pt", tmp_path / "store"
    mp.start_processes(_in_world, args=(worker, nprocs, store.as_uri(), str(out), backend), nprocs=nprocs, join=True,
                       start_method="spawn")
    return torch.load(out)


def _in_world(rank, worker, nprocs, store, out, backend):
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=store, rank=rank, world_size=nprocs)
    try:
        worker(rank, nprocs, out)
    finally:
        dist.destroy_process_group()


def waits(fn) -> int:
    """fn()'s waits for the device, as torch's sync debug mode counts them (tests/core/test_transfers.py checks that
    it counts a planted one)."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in seen)
