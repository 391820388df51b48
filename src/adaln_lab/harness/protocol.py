"""The sizes of the seed protocol (`FULL`) and a small one for CPUs and CI (`QUICK`)."""

from __future__ import annotations

from dataclasses import dataclass, field


def seed_batch_sizes(limit: int) -> list[int]:
    """1..9, then 2^k - 1, 2^k, 2^k + 1 for k >= 4, all up to `limit`."""
    sizes = list(range(1, 10))
    k = 4
    while 2 ** k - 1 <= limit:
        sizes += [s for s in (2 ** k - 1, 2 ** k, 2 ** k + 1) if s <= limit]
        k += 1
    return sizes


@dataclass(frozen=True)
class Protocol:
    H: int
    D: int
    T: int
    all_rows_sizes: tuple[int, ...]
    seeds: tuple[int, ...]
    full_batch: int
    sub_batch_sizes: tuple[int, ...]
    sub_batch_seeds: tuple[int, ...]
    small_limit: int
    small_step: int
    pool_size: int
    probe_rows: tuple[int, ...]
    accuracy_sizes: tuple[int, ...]
    accuracy_seed: int
    warmup: int
    iters: int
    copy_bytes: int
    batch_sizes: tuple[int, ...] = field(default=())

    @property
    def shape(self) -> dict:
        return {"H": self.H, "D": self.D, "T": self.T}

    @property
    def sweep_sizes(self) -> list[int]:
        return list(self.batch_sizes) or seed_batch_sizes(self.pool_size)


FULL = Protocol(
    H=5376, D=2688, T=3,
    all_rows_sizes=(64, 257, 2048), seeds=(3, 4, 5),
    # two seeds of 1062 sub-batches each give the seed report's count of 2124
    full_batch=131072, sub_batch_sizes=(1, 7, 4097, 32768, 65536), sub_batch_seeds=(3, 4),
    small_limit=1024, small_step=256,
    pool_size=2048, probe_rows=(0, 259, 515, 771, 1027, 1283, 1539, 2047),
    accuracy_sizes=(4097, 32768), accuracy_seed=1,
    warmup=20, iters=100, copy_bytes=2 << 30,
)

QUICK = Protocol(
    H=256, D=128, T=3,
    all_rows_sizes=(8, 17), seeds=(3, 4),
    full_batch=512, sub_batch_sizes=(1, 7, 65, 256), sub_batch_seeds=(3,),
    small_limit=64, small_step=32,
    pool_size=64, probe_rows=(0, 21, 63),
    accuracy_sizes=(65, 257), accuracy_seed=1,
    warmup=2, iters=5, copy_bytes=64 << 20,
)


def invariance_calls(protocol: Protocol, repeats: int = 3) -> int:
    """How many differentiated calls of the candidate `report.batch_invariance` makes: each check's
    full batches plus its rows or sub-batches (FULL: 11483 at H = 5376; QUICK: 392 at H = 256)."""
    from .invariance import sub_batch_starts, sweep_positions

    p = protocol
    all_rows = sum(len(p.seeds) * (1 + n) for n in p.all_rows_sizes)
    sub = len(p.sub_batch_seeds) * (1 + sum(len(sub_batch_starts(p.full_batch, s, p.small_limit, p.small_step))
                                            for s in p.sub_batch_sizes))
    sweep = len(p.seeds) * (2 + len(p.probe_rows) * sum(len(sweep_positions(b)) for b in p.sweep_sizes))
    return all_rows + repeats + sub + sweep
