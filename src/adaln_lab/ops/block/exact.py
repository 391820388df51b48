"""An H3 block's AdaLN recording its exact cross-row sums (inside `adaln_lab.nn.ExactGradients`).

The block runs its own ops (`block_adaln_path`, on their routes) on detached parameters and temb, with its table
computed a temb row at a time where the torch code makes it (`table_rows`: each row's bits whatever T; the table
kernel's rows are so already), so x's, attn's and ff's gradients are the ops' and nothing reaches the AdaLN
parameters or temb: each row op's backward adds its rows' terms to this part's BlockSums (`ops/row_sums.py`: B =
dy and A = dy x rstd for a modulated norm, A = dy y for a gated residual, per table row; on the kernels each op's
own row pass keeps them (`modulated_rms_norm.launch.backward_exact`, `gated_residual.launch.backward_exact`), in
torch code otherwise):

    chunk (3T, H) state      shift_msa, shift_mlp: B      scale_msa, scale_mlp: A      gate_msa, gate_mlp: A of dy y

The recorder (`adaln_lab.nn.ExactGradients`) merges the parts' states by temb row and rounds each sum once at write
(`ops/modulation_table/exact.py`'s TableSums): the table's gradient per distinct temb row, d_table = the chunks'
states times their columns' factors (w1, w2 for the scale chunks, the forward's norm weights in float32; 1
elsewhere: `host_factors`), then d_weight, d_bias and d_temb from it; each norm weight's the sum over the distinct temb
rows and the three modalities of s1 = float32(1 + scale) (`scales`, from the forward's table) times its scale chunk's
A (`SCALE_COLUMNS`). All exact: the gradients are the exact functions of the exact sums, each rounded once.

    sums = BlockSums(T, H, (norm1_weight, norm2_weight), table)
    sums.norm(chunk, x, dy, rstd, row_index, kernels)   # a modulated norm's rows (chunk: its shift chunk)
    sums.add_norm(chunk, state, flags)                  # or the state its own row pass kept
    sums.gate(chunk, y, dy, row_index, kernels)         # a gated residual's rows (chunk: its gate chunk)
    sums.add_gate(chunk, state, flags)
    sums.state(), sums.host_factors(*sums.sources), sums.check()   # at the recorder's settle and write
    table, row_tables = exact_table(temb, weight, bias, kernel, with_row_tables, adapt_table)
"""

from __future__ import annotations

import torch

from ...core.exact import LIMBS, ExactSum
from ...core.exact_kernels import ExactKernels
from ...core.library import apply
from ...core.table_gradient import SCALE_MLP, SCALE_MSA
from ...reference.block import CHUNKS, MODALITIES
from ...reference.final_adaln_out import table_rows
from ..modulation_table.op import ModulationTable
from ..row_sums import half, raise_flags, row_sums

OP = "block_adaln_path"
# the norms' scale chunks as table columns (T, 18H): norm1's scale_msa of modality m at m 6H + H, then norm2's
# scale_mlp at m 6H + 4H; `scales` holds their s1 in this order (TableSums.norm_weight_sums' columns, 2 norms)


def scale_columns(H: int) -> list[slice]:
    return [slice(m * 6 * H + c * H, m * 6 * H + (c + 1) * H) for c in (SCALE_MSA, SCALE_MLP)
            for m in range(MODALITIES)]


class BlockSums:
    """A block's exact states for one part (module docstring): `chunks`, six ExactSum (3T, H) (CHUNKS order);
    `scales` (T, 6H) float32 each temb row's s1 of the norms' scale chunks (`scale_columns`' order), from the
    forward's table (T, 18H); `weights` the norm weights as the forward used them (float32); `kernels` the row
    kernels' compiled unit where they run, kept as core.exact_kernels.ExactKernels (the states' carries, write's
    products and roundings, and the projection's gradient run on it), else None. The backward adds
    integers only (no host sync); every product waits for write."""

    def __init__(self, T: int, H: int, norm_weights, table: torch.Tensor, kernels: dict | None = None):
        self.T, self.H = T, H
        self.kernels = None if kernels is None else ExactKernels(kernels, table.device.index)
        self.chunks = [ExactSum((MODALITIES * T, H), table.device, self.kernels) for _ in CHUNKS]
        with torch.no_grad():
            self.scales = 1.0 + torch.cat([table[:, c].float() for c in scale_columns(H)], dim=1)
        self.weights = [w.detach().float().clone() for w in norm_weights]  # kept past FSDP2's reshard
        self.flags: list[torch.Tensor] = []  # the kernels' error flags, read by `check`
        self.closed = False  # set when the accumulator folds these states in (its `with` ended)

    def _open(self) -> None:
        if self.closed:
            raise RuntimeError(f"{OP}: this part's backward ran after its `with ExactGradients()` ended; run the "
                               "backward inside the `with`")

    def _sums(self, x, dy, rstd, row_index, kernels: bool) -> ExactSum:
        self._open()
        state, flags = row_sums(x, dy, rstd, row_index, MODALITIES * self.T, kernels, OP)
        if flags is not None:
            self.flags.append(flags)
        return state

    def norm(self, chunk: int, x, dy, rstd, row_index, kernels: bool) -> None:
        """Add a modulated norm's rows: x, dy (..., S, H) (its input and its output's gradient), rstd (rows,),
        row_index (S,); chunk its shift chunk."""
        self.add_norm(chunk, self._sums(x, dy, rstd, row_index, kernels))

    def add_norm(self, chunk: int, state: ExactSum, flags: torch.Tensor | None = None) -> None:
        """Add a modulated norm's state (3T, 2H) B | A made by its own row pass (`modulated_rms_norm.launch.
        backward_exact`), with its kernels' flags; chunk its shift chunk."""
        self._open()
        if flags is not None:
            self.flags.append(flags)
        self.chunks[chunk].merge(half(state, 0), carry=False)  # carried once, when read
        self.chunks[chunk + 1].merge(half(state, 1), carry=False)

    def gate(self, chunk: int, y, dy, row_index, kernels: bool) -> None:
        """Add a gated residual's rows: y (..., S, H) the branch output, dy its output's gradient; chunk its gate
        chunk (`kernels`: exact_sums.cu, a pass of its own)."""
        self.add_gate(chunk, half(self._sums(y, dy, None, row_index, kernels), 1))

    def add_gate(self, chunk: int, state: ExactSum, flags: torch.Tensor | None = None) -> None:
        """Add a gated residual's state (3T, H) (its sums of dy y) made by its own pass
        (`gated_residual.launch.backward_exact`), with its kernel's flags; chunk its gate chunk."""
        self._open()
        if flags is not None:
            self.flags.append(flags)
        self.chunks[chunk].merge(state, carry=False)

    def table(self) -> ExactSum:
        """The table gradient's raw state (T, 18H): chunk c of the (3T, 6H) view's row 3t + m is columns
        m 6H + c H .. of table row t (diffusers' `view(-1, 6H).chunk(6)`)."""
        limbs = torch.cat([c.limbs for c in self.chunks], dim=2)  # the chunks' merges uncarried: one carry here
        return ExactSum.from_limbs(limbs.reshape(LIMBS, self.T, -1), kernels=self.kernels).carried()

    def state(self) -> ExactSum:
        """The table state (T, 18H), carried: `TableSums.add`'s (with `host_factors` of `sources`)."""
        return self.table()

    @property
    def sources(self) -> tuple[torch.Tensor, ...]:
        """(the norms' s1 (T, K), w1, w2 float32): what `host_factors` takes, as host copies."""
        return (self.scales, *self.weights)

    @staticmethod
    def host_factors(scales: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norms' s1 (T, K), the columns' factors (18H,) float32: w1 / w2 for the scale chunks' columns, 1
        elsewhere) from `sources` (host copies): `TableSums.add`'s."""
        ones = torch.ones_like(w1)
        row = [w1 if c == SCALE_MSA else w2 if c == SCALE_MLP else ones for c in range(len(CHUNKS))]
        return scales, torch.cat(row * MODALITIES)

    def check(self) -> None:
        """Raise what the kernels flagged (a host read of each flag; `ops.row_sums.raise_flags`)."""
        for flag in self.flags:
            raise_flags(flag, OP)
        self.flags.clear()


def exact_table(temb, weight, bias, kernel: bool, with_row_tables: bool, adapt_table=None):
    """(table (T, 18H) float32 holding the table dtype's values, a leaf, the table kernel's bf16 row tables or None)
    without a graph, each row's bits whatever T: the table kernel's (`kernel`, with its row tables where
    `with_row_tables`) or `table_rows`' (a temb row at a time); adapt_table: None, or the LoRA adapters' terms,
    applied to its values (the recorder forms the adapters' gradients from the exact table gradient)."""
    with torch.no_grad():
        if kernel:
            table, row_tables = apply(ModulationTable, temb, weight, bias, "cupy", "cuda", with_row_tables)
        else:
            table, row_tables = table_rows(temb, weight, bias), None
        if adapt_table is not None:
            table = adapt_table(table.float()).to(table.dtype)
    # a leaf that wants a gradient, so that the ops' backwards run (and record) even where nothing else wants one
    # (a frozen model's first block); what reaches it is dropped with it
    return table.float().requires_grad_(True), row_tables
