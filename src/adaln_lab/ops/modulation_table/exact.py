"""The table's parameter gradients from exact table-gradient states, over the distinct temb rows.

    sums = TableSums()
    sums.add(temb, state)        # temb (T, D); state: core.exact.ExactSum (T, N), table row t's exact sum
    sums.merge(other)            # another part's, in any order
    rows, d_temb, d_weight, d_bias = sums.gradients(weight, bias_dtype)
    d_act, lora = sums.lora_gradients(adapters)   # LoRA adapters on the projection: their gradients, temb's part

Rows of temb with the same bits are one timestep: their states are merged (integers: any order), so the parts of a
batch (micro-batches, ranks) may hold a timestep each, or several, in any order. `gradients` takes the distinct rows
in the order of their bytes (a function of the set of rows alone), rounds each row's exact sum once to float32
(d_table), and forms d_weight and d_temb from those with the reference's float64 backward
(reference.backward.modulation_table_backward, on the CPU for states on any device) on that order; d_bias is the
exact sum over every row, rounded once.
LoRA adapters (A (r, D), B (N, r), scaling s: table += s B A act, act = silu(temb)) get theirs from the same
d_table and rows in float64: dB = s d_table^T (act A^T), dA = s (d_table B)^T act, and temb's gradient the part
s (d_table B) A of d_act (the caller adds it times SiLU's derivative, `silu_grad`).
rows (U, D) are the distinct temb rows, d_temb (U, D) their gradient (float64, rounded by the caller), d_weight
(N, D) in weight's dtype, d_bias (N,) in bias_dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core.exact import LIMBS, ExactSum
from ...reference.backward import modulation_table_backward, table_weight_grad

_F64 = torch.float64


def silu_grad(rows: torch.Tensor) -> torch.Tensor:
    """d silu(t) / dt at rows, float64 (the factor modulation_table_backward applies to d_act)."""
    sig = torch.sigmoid(rows.to(_F64))
    return sig * (1.0 + rows.to(_F64) * (1.0 - sig))


def row_key(row: torch.Tensor) -> bytes:
    """A temb row's identity: its dtype and bytes (rows with the same key are one timestep)."""
    row = row.detach().cpu().contiguous()
    return str(row.dtype).encode() + row.view(-1).view(torch.uint8).numpy().tobytes()


class TableSums:
    """Exact table-gradient states keyed by temb row (module docstring)."""

    def __init__(self):
        self.rows: dict[bytes, tuple[torch.Tensor, ExactSum]] = {}

    def add(self, temb: torch.Tensor, state: ExactSum) -> "TableSums":
        """Merge state's row t into the state of temb's row t, for every t (temb (T, D), state (T, N))."""
        if temb.dim() != 2 or state.shape[0] != temb.shape[0]:
            raise ValueError(f"temb must be (T, D) with T = the state's {state.shape[0]} rows, got "
                             f"{tuple(temb.shape)}")
        for t in range(temb.shape[0]):
            row = temb[t].detach().cpu().contiguous()
            self._merge_row(row, ExactSum.from_limbs(state.limbs[:, t:t + 1].clone()))
        return self

    def merge(self, other: "TableSums") -> "TableSums":
        """Add another part's states (any order of merging gives the same states)."""
        for row, part in other.rows.values():
            self._merge_row(row, ExactSum.from_limbs(part.limbs.clone()))
        return self

    def _merge_row(self, row: torch.Tensor, part: ExactSum) -> None:
        key = row_key(row)
        if key in self.rows:
            self.rows[key][1].merge(part)
        else:
            self.rows[key] = (row, part)

    def all_reduce(self, columns: int, group=None) -> set:
        """Sum the states of every rank of the process `group` over the union of their rows (integers: any order; a
        rank without rows adds zeros), `columns` = N; returns the keys of the rows whose lowest holder is this rank."""
        import torch.distributed as dist

        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, {key: row for key, (row, _) in self.rows.items()}, group=group)
        rows = {}
        for held in everyone:
            for key, row in held.items():
                rows.setdefault(key, row)
        if not rows:  # every rank sees it: they raise together
            raise ValueError("TableSums.all_reduce: no rank recorded a row")
        keys = sorted(rows)
        device = next(iter(self.rows.values()))[1].limbs.device if self.rows else None
        limbs = torch.zeros((LIMBS, len(keys), columns), dtype=torch.int64, device=device)
        for u, key in enumerate(keys):
            if key in self.rows:
                limbs[:, u] = self.rows[key][1].limbs[:, 0]
        dist.all_reduce(limbs, group=group)
        total = ExactSum.from_limbs(limbs)._carry()
        self.rows = {key: (rows[key], ExactSum.from_limbs(total.limbs[:, u:u + 1].clone())) for u, key in
                     enumerate(keys)}
        rank = dist.get_rank(group)
        return {key for key in keys if next(r for r, held in enumerate(everyone) if key in held) == rank}

    def _d_table(self):
        """(rows (U, D), their states as one ExactSum (U, N), d_table (U, N) float32 on the CPU) over the distinct
        rows in the order of their bytes (on the CPU, wherever the states are: the same float64 bits after)."""
        if not self.rows:
            raise ValueError("no rows were added: the gradients of an empty batch are zeros, not computed here")
        keys = sorted(self.rows)
        total = ExactSum.from_limbs(torch.cat([self.rows[k][1].limbs for k in keys], dim=1))  # carried
        return torch.stack([self.rows[k][0] for k in keys]), total, total.value(torch.float32).cpu()

    def lora_gradients(self, adapters):
        """(d_act (U, D) float64 or None, [(dA (r, D), dB (N, r)) float64]) of the LoRA adapters [(A, B, scaling)]
        over the distinct rows (module docstring), in `gradients`' row order."""
        if not adapters:
            return None, []
        rows, _, d_table = self._d_table()
        d_table, act = d_table.to(_F64), F.silu(rows.to(_F64))
        d_act, grads = torch.zeros_like(act), []
        for A, B, s in adapters:
            A, B = A.detach().cpu().to(_F64), B.detach().cpu().to(_F64)
            g = s * (d_table @ B)  # (U, r): d of A act
            grads.append((g.T @ act, s * (d_table.T @ (act @ A.T))))
            d_act += g @ A
        return d_act, grads

    def gradients(self, weight: torch.Tensor | None, bias_dtype: torch.dtype, weight_dtype: torch.dtype | None = None,
                  weight_rows: slice | None = None):
        """(rows (U, D), d_temb (U, D), d_weight (N, D), d_bias (N,)) over the distinct rows (module docstring).
        weight None: no d_temb (None), d_weight in weight_dtype (the projection's values are not needed), and with
        `weight_rows` only those rows of it (a rank's shard: each row is its own sum over the distinct rows, so a
        shard has the bits of the whole gradient's rows)."""
        rows, total, d_table = self._d_table()
        if weight is None:
            columns = d_table if weight_rows is None else d_table[:, weight_rows]
            return rows, None, table_weight_grad(columns, rows).to(weight_dtype), total.total().value(bias_dtype)
        d_temb, d_weight, _ = modulation_table_backward(d_table, rows.double(), weight.detach().cpu(), bias_dtype)
        return rows, d_temb, d_weight, total.total().value(bias_dtype)
