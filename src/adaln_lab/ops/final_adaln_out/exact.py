"""norm_out's cross-row sums as exact states: the same bits for any order of the rows and any split into parts.

Per row r of table row t = timestep_indices[s] (s the row's position in its sequence), two float32 terms a column,
the row's own (the CUDA row pass's: xhat = x rstd, rstd the forward's `rms_norm` one, products rounded to float32
as written), each added exactly into its table row's state:

    shift sum   B[t] = exact sum of dy_r over the rows of t
    scale sum   A[t] = exact sum of p_r = dy_r xhat_r over the rows of t
and from those, each rounded once (w = norm_weight, s1[t] = float32(1 + scale[t]), the table row's factor):
    d_shift[t] = float32(B[t])      d_scale[t] = float32(w A[t])      d_norm_weight = sum_t s1[t] A[t]
    d_bias     = the exact sum over t of (B[t] | w A[t])
(`core.exact.products`: a state times float32 factors, exactly). The backward row pass's own partial sums are the
same two (norm_modulate_bwd.cu), so the kernels can keep them exactly where they are formed.

    sums = NormOutSums(T, H)
    sums.add(x, dy, norm_weight, table_f32, timestep_indices, eps)   # a part's rows (any number of calls)
    sums = kernel_sums(dy, x, norm_weight, timestep_indices, workspace, T, D)  # the same terms on the kernels
    sums.merge(other)                                                # another part's state, in any order
    d_table, d_norm_weight, d_bias = sums.gradients(torch.bfloat16)  # (T, 2H) fp32, (H,), (2H,) rounded once

Shapes: x, dy (..., S, H); norm_weight (H,); table_f32 (T, 2H) float32 (shift | scale); timestep_indices (S,)
int64 in [0, T). The states are integers (core.exact.ExactSum), so merging parts is associative: micro-batches and
ranks give one answer. The CPU reference of the exact-gradient contract. A sums' `scale` (T, H) holds s1 and
`norm_weight` (H,) w as float32 (the forward's: parts of one table row hold the same ones); kernel_sums' sums form
them, and carry their table, at the first read (`ready`).

On the kernels (route "cupy", `kernel_sums`: kernels_cu/exact_row_pass.cu, or exact_sums.cu's pass of its own) the
terms are the same products of the same float32 values, with the kernels' rstd (the forward's, from its own reduction
tree) in place of torch's and their float32 table: the same integers wherever the two agree, and on CUDA fp32
subnormal products flush to zero (-ftz).
So a batch's CPU and GPU gradients may differ in the last bits; each route alone gives one answer for every order
and split. A call takes at most MAX_TERMS (2^30) rows on the kernels (every limb stays below 2^62); a non-finite
term or a timestep index outside [0, T) raises when the sums are read (`NormOutSums.check`), never a wrong sum.
"""

from __future__ import annotations

import torch

from ...core import launchers, tensors
from ...core.exact import ExactSum, products
from ...core.exact_kernels import ExactKernels
from ...core.library import eager
from ...core.plan import forward_bytes
from ...core.transfers import HostCopies, no_wait
from ...reference.backward import rows_index
from ...reference.final_adaln_out import replay, table_rows
from ..row_sums import (check_rows, exact_row_order, fixup_capacity, half, launch_fixups, launch_sorted_row_sums,
                        launch_sums, pass_buffers, raise_flags)
from .. import row_order
from . import launch


def normed_terms(x, dy, eps):
    """(rows, H) float32 float32(dy_r float32(x_r rstd_r)), rstd_r = rsqrt(mean(x_r^2) + eps) in float32, and dy's
    rows in float32: each row's own (x, dy (..., S, H)). A norm weight's per-row terms."""
    H = x.shape[-1]
    xf, g = x.reshape(-1, H).float(), dy.reshape(-1, H).float()
    return g * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)), g


def row_terms(x, dy, timestep_indices, eps):
    """(rows, 2H) float32 terms (dy | dy xhat) and (rows,) their table rows t: per row."""
    p, g = normed_terms(x, dy, eps)
    return torch.cat([g, p], dim=1), rows_index(timestep_indices, x)


def table_factors(norm_weight, table_f32) -> tuple[torch.Tensor, torch.Tensor]:
    """(s1 (T, H), w (H,)) float32: float32(1 + scale[t]) from table_f32 (T, 2H), and the norm weight."""
    H = norm_weight.shape[0]
    # a copy: a float32 weight's .float() is the parameter itself, which FSDP2 may free before the parts are read
    return (1.0 + table_f32[:, H:].float()).contiguous(), norm_weight.detach().to(torch.float32, copy=True)


def column_factors(norm_weight: torch.Tensor) -> torch.Tensor:
    """(2H,) float32: the table gradient's columns' exact factors, 1 for the shift sums and w for the scale sums."""
    return torch.cat([torch.ones_like(norm_weight), norm_weight])


class NormOutSums:
    """Exact states of norm_out's cross-row sums (module docstring): `table` (T, 2H) (B | A), `scale` (T, H) s1 and
    `norm_weight` (H,) w float32 (of kernel_sums' sums: after `ready`)."""

    def __init__(self, T: int, H: int, device=None):
        self.table = ExactSum((T, 2 * H), device)
        self.scale = self.norm_weight = None
        self.flags: list[torch.Tensor] = []  # the kernels' error flags (kernel_sums), read by `check`
        self.entries = None  # kernel_sums' (1,) int32: the fixup entries its row pass appended (a diagnostic)
        self.sources = None  # (table_f32 (T, 2H), norm weight (H,)): what the factors come from (`host_factors`)
        self.carry_due = False  # kernel_sums' table is carried at the first read (`state`, `ready`)
        self.early = None  # kernel_sums': the forward's core.transfers.HostCopies of (temb, *sources), or None

    def state(self) -> ExactSum:
        """The table state (T, 2H), carried (kernel_sums leaves its carries to the first read, after the backward)."""
        if self.carry_due:
            self.carry_due = False
            self.table.carried()
        return self.table

    def ready(self) -> "NormOutSums":
        """Finish what kernel_sums left for the first read, after the backward (none of it in the backward's time):
        the table's carries and the factors `scale` and `norm_weight` on the state's device (`table_factors`). Every
        read below calls it; a caller reading `table`, `scale` or `norm_weight` of kernel_sums' sums calls it first."""
        self.state()
        if self.scale is None and self.sources is not None:
            self.scale, self.norm_weight = table_factors(self.sources[1], self.sources[0])
        return self

    @staticmethod
    def host_factors(table_f32: torch.Tensor, norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(s1 (T, H), the columns' factors (2H,)) float32 from host copies of `sources`: `TableSums.add`'s, the
        same bits as on the device (float32's 1 + scale rounds alike everywhere; the widening is exact)."""
        scale, w = table_factors(norm_weight, table_f32)
        return scale, column_factors(w)

    def _factors(self, scale: torch.Tensor, norm_weight: torch.Tensor) -> None:
        if self.scale is None:
            self.scale, self.norm_weight = scale, norm_weight
        elif not (torch.equal(self.scale, scale.to(self.scale.device))
                  and torch.equal(self.norm_weight, norm_weight.to(self.norm_weight.device))):
            raise ValueError("NormOutSums: parts with other table rows or norm weights (one forward's sums only)")

    def add(self, x, dy, norm_weight, table_f32, timestep_indices, eps: float = 1e-5) -> "NormOutSums":
        """Add the rows of x and dy (..., S, H) (their terms, module docstring)."""
        self.ready()
        terms, t = row_terms(x, dy, timestep_indices, eps)
        self._factors(*table_factors(norm_weight, table_f32))  # checked before any row goes in
        self.table.add(terms, t)
        self.sources = self.sources or (table_f32, self.norm_weight)  # the float32 copy (FSDP2 may free the weight)
        return self

    def merge(self, other: "NormOutSums") -> "NormOutSums":
        """Add another part's states (any order of merging gives the same state)."""
        self.ready(), other.ready()
        if other.scale is not None:
            self._factors(other.scale, other.norm_weight)
        self.sources = self.sources or other.sources
        self.table.merge(other.table)
        self.flags += other.flags
        return self

    def check(self) -> None:
        """Raise what the kernels flagged (a host read of each flag): ValueError for a non-finite term,
        IndexError for a timestep index outside [0, T); the states are then not sums of every term."""
        for flag in self.flags:
            raise_flags(flag, "final_adaln_out", "a timestep index outside [0, T) (check_indices=True finds it "
                        "before the kernels run)")
        self.flags.clear()

    def gradients(self, dtype: torch.dtype = torch.bfloat16):
        """(d_table (T, 2H) float32, d_norm_weight (H,), d_bias (2H,)) in `dtype`, each rounded once from its
        exact value (module docstring)."""
        self.check()
        if self.ready().scale is None:
            raise ValueError("NormOutSums: no rows were added")
        factors = column_factors(self.norm_weight)
        d_table = products(self.table, factors).value(torch.float32)
        d_norm_weight = products(half(self.table, 1), self.scale).total().value(dtype)
        return d_table, d_norm_weight, products(self.table.total(), factors).value(dtype)


def launch_row_sums(k: dict, plan, rows, stream: int, dy: int, x: int, rstd: int, norm_weight: int, table_f32: int,
                    timestep_indices: int, dx: int, table_limbs: int, flags: int, fixups: int, S: int) -> None:
    """exact_row_pass.cu's norm_modulate_bwd_exact_bf16: the backward row pass (dx (rows, H) bf16,
    norm_modulate_bwd_bf16's bits and grid) with its two column sums a table row added exactly into table_limbs
    (LIMBS, T, 2H) (uncarried), flags (2,) int32 and fixups as `row_sums.pass_buffers` makes them, then
    exact_fixup_rows_bf16 where plan.exact_row_double; nothing with no rows."""
    if rows.rows:
        capacity, per = fixup_capacity(plan, rows, False), rows.bwd_rows_per_range
        k["norm_modulate_bwd_exact_bf16"]((rows.bwd_ranges, 1, 1), (plan.bwd_threads, 1, 1), plan.bwd_smem, stream,
                                          dy, x, rstd, norm_weight, table_f32, timestep_indices, dx, table_limbs,
                                          flags, fixups, S, rows.rows, per, 2 * plan.H, capacity)
        launch_fixups(k, plan, stream, "exact_fixup_rows_bf16", capacity, x, dy, rstd, timestep_indices, fixups,
                      flags, table_limbs, S, rows.rows, per)


def kernel_sums(dy, x, norm_weight, timestep_indices, workspace, T: int, D: int, dx=None,
                weight_copy: bool = True) -> NormOutSums:
    """This part's NormOutSums from the kernels on CUDA tensors: dy, x (..., S, H) bf16 contiguous, norm_weight (H,)
    bf16, timestep_indices (S,) int64, workspace the forward's (`launch.saved_views`: table_f32, rstd; s1 from its
    table_f32). With dx (x's shape) given, the backward's row pass with exact sums writes dx and the states in one
    read of x and dy (exact_row_pass.cu's norm_modulate_bwd_exact_bf16, or from TUNING's EXACT_SORTED_MIN_T
    timesteps on its sorted pass over the rows in table-row order, `ops.row_order`); without, exact_sums.cu's
    exact_sums_bf16 walks x and dy in table-row order for the states alone (the same integers). The states' limbs
    are added by integer atomics; the kernels' flags are kept for `NormOutSums.check`. The carries (exact_state.cu's
    exact_carry) and the factors wait for `NormOutSums.ready`, after the backward: the sums keep table_f32 (a view
    of the small workspace) and the norm weight, a copy unless weight_copy is False (norm_weight is then the
    caller's own tensor, left as it is until the sums are read: a cast made for this call, never a parameter that
    FSDP2 may free). At most MAX_TERMS rows (ValueError)."""
    H = x.shape[-1]
    rows = x.numel() // H
    check_rows(rows, "final_adaln_out")
    device = x.get_device()
    plan, rows_plan, k = tensors.context(device, H, D, T, rows)
    launchers.bind(device)
    _, table_f32, rstd = launch.saved_views(workspace, T, H, rows, D)
    stream = tensors.current_stream(device)
    sums = NormOutSums.__new__(NormOutSums)
    sort = dx is not None and rows > 0 and T >= dict(plan.tuning)["EXACT_SORTED_MIN_T"]
    table, flags, fixups = pass_buffers(plan, rows_plan, sort, x.device, joined=True)
    (dy, x, norm_weight), at = tensors.aligned_addresses(dy, x, norm_weight)
    if sort:  # the rows in table-row order: a block closes the table rows its positions span, not all T
        order = timestep_indices.new_empty(T + 1 + x.shape[-2], dtype=torch.int32)
        row_order.launch_in(k, plan, stream, timestep_indices, order, x.shape[-2])  # this plan's unit
        launch_sorted_row_sums(k, plan, rows_plan, stream, at[0], at[1], rstd.data_ptr(), at[2],
                               table_f32.data_ptr(), timestep_indices.data_ptr(), order.data_ptr(), dx.data_ptr(),
                               table.data_ptr(), flags.data_ptr(), fixups.data_ptr(), x.shape[-2])
    elif dx is not None:  # the row pass with exact sums: dx and the states in one read of x and dy
        launch_row_sums(k, plan, rows_plan, stream, at[0], at[1], rstd.data_ptr(), at[2], table_f32.data_ptr(),
                        timestep_indices.data_ptr(), dx.data_ptr(), table.data_ptr(), flags.data_ptr(),
                        fixups.data_ptr(), x.shape[-2])
    else:
        order = exact_row_order(timestep_indices, rows)
        launch_sums(k, plan, stream, at[1], at[0], rstd.data_ptr(), timestep_indices.data_ptr(), order.data_ptr(),
                    table.data_ptr(), flags.data_ptr(), rows, x.shape[-2])
    # carried at `ready` by exact_state.cu, whose kernels also form write's products and roundings
    sums.table = ExactSum.from_limbs(table, kernels=ExactKernels(k, x.device.index))
    sums.scale = sums.norm_weight = sums.early = None
    sums.sources = (table_f32, norm_weight.detach().clone() if weight_copy else norm_weight)
    sums.carry_due = True
    sums.flags, sums.entries = [flags[:1]], flags[1:]
    return sums


def record(x, norm_weight, temb, weight, bias, timestep_indices, eps: float, recorder, route: str = "torch",
           cast=None, adapt=None, watched=()) -> torch.Tensor:
    """norm_out inside `adaln_lab.nn.ExactGradients`: `ExactNormOut` on `route` (the caller's decision; "cupy" runs
    on `cast`, the parameters as the kernels take them), the recorder keeping temb and writing the caller's
    (norm_weight, weight, bias). adapt: `ExactNormOut`'s (LoRA adapters; route "torch"); watched: more leaves whose
    gradients the recorder writes (the adapters' weights), inputs of the node so that its backward runs when only
    they want a gradient."""
    params = (norm_weight, weight, bias)
    if route == "cupy":
        norm_weight, weight, bias = cast
    recorder.keep_temb(params, temb)
    x, norm_weight, temb, weight, bias, timestep_indices = (
        t.contiguous() for t in (x, norm_weight, temb.detach(), weight, bias, timestep_indices))
    return ExactNormOut.apply(x, norm_weight, temb, weight, bias, timestep_indices, float(eps), route, recorder,
                              params, adapt, *watched)


class ExactNormOut(torch.autograd.Function):
    """norm_out recording its exact sums (inside `adaln_lab.nn.ExactGradients`): forward(x, norm_weight, temb, weight,
    bias, timestep_indices, eps, route, recorder, params, adapt, *watched) -> out; backward(dy) -> dx at once and no
    other gradient: the recorder gets this part's NormOutSums under `params` (the caller's norm_weight, weight, bias)
    and writes them all once (`ExactGradients.write`). temb comes detached: the recorder keeps the caller's
    (`keep_temb`) and sends d_temb through it when it writes. adapt: None, or (table, temb) -> the table with LoRA
    adapters' terms (route "torch" only; the recorder forms their gradients, `ExactGradients.adapt`); watched: leaves
    that get no gradient here (the recorder writes theirs), inputs so that the backward runs when only they want one.
    route "torch": the replay's out on the table computed a row at a time (`table_rows`: diffusers' bits for each row
    alone), dx the replay's, the sums `NormOutSums.add`'s. route "cupy" (bf16 CUDA inputs the kernels take, in
    eager code): the kernels' out and dx (their table rows do not depend on T), the sums `kernel_sums`'."""

    @staticmethod
    def forward(ctx, x, norm_weight, temb, weight, bias, timestep_indices, eps, route, recorder, params, adapt,
                *watched):
        ctx.eps, ctx.route, ctx.recorder, ctx.params, ctx.watched = eps, route, recorder, params, len(watched)
        if route == "cupy":
            if adapt is not None:
                raise ValueError("ExactNormOut: adapters' tables run on route 'torch'")
            if not eager():
                raise NotImplementedError("final_adaln_out: exact gradients on the kernels run in eager code, not "
                                          "under torch.compile")
            (T, D), H = temb.shape, x.shape[-1]
            out = torch.empty_like(x)
            workspace = x.new_empty(forward_bytes(T, H, x.numel() // H, D), dtype=torch.uint8)
            launch.forward(x, norm_weight, temb, weight, bias, timestep_indices, eps, route, "cuda", out, workspace)
            ctx.save_for_backward(x, norm_weight, temb, weight, timestep_indices, workspace)
            # with NO_WAIT 1 the fold's host copies start here, done long before it reads them
            table_f32 = launch.saved_views(workspace, T, H, x.numel() // H, D)[1]
            ctx.early = HostCopies([temb, table_f32, norm_weight]) if no_wait() else None
            return out
        table = table_rows(temb, weight, bias)  # each row's bits whatever T (the parts may hold other timesteps)
        if adapt is not None:  # LoRA adapters' terms on the projection (`adaln_lab.nn.adapters.adapted_table`)
            table = adapt(table, temb)
        out = replay(x, norm_weight, temb, weight, bias, timestep_indices, eps, table=table)
        ctx.save_for_backward(x, norm_weight, temb, table, timestep_indices)
        return out

    @staticmethod
    def backward(ctx, dy):
        if ctx.route == "cupy":
            x, norm_weight, temb, weight, timestep_indices, workspace = ctx.saved_tensors
            dy = dy.contiguous()
            dx = torch.empty_like(x)
            # no copy where the recorder folds from the forward's host copies (`early`: it reads only `state`)
            sums = kernel_sums(dy, x, norm_weight, timestep_indices, workspace, *temb.shape, dx=dx,
                               weight_copy=ctx.early is None and _same_memory(norm_weight, ctx.params[0]))
            sums.early = ctx.early
        else:
            x, norm_weight, temb, table, timestep_indices = ctx.saved_tensors
            with torch.enable_grad():
                xg = x.detach().requires_grad_(True)
                out = replay(xg, norm_weight.detach(), temb, None, None, timestep_indices, ctx.eps, table=table)
                (dx,) = torch.autograd.grad(out, xg, dy)
            with torch.no_grad():
                sums = NormOutSums(temb.shape[0], x.shape[-1], x.device).add(x, dy, norm_weight, table.float(),
                                                                             timestep_indices, ctx.eps)
        ctx.recorder.add_norm_out(ctx.params, temb, sums)
        return (dx, *([None] * (10 + ctx.watched)))


def _same_memory(tensor: torch.Tensor, parameter: torch.Tensor) -> bool:
    """Whether tensor lies in parameter's storage (the kernels take the parameter itself, not a cast of it), or that
    cannot be told: then the sums copy it (FSDP2 frees an unsharded parameter's storage after the backward)."""
    try:
        return tensor.untyped_storage().data_ptr() == parameter.untyped_storage().data_ptr()
    except (RuntimeError, TypeError, NotImplementedError):
        return True
