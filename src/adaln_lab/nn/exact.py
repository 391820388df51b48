"""Exact AdaLN gradients over micro-batches: the same bits however the rows are ordered or split.

    acc = ExactGradients()
    for micro in micro_batches:
        with acc:                                    # the AdaLN ops record instead of returning their gradients
            loss_fn(model(micro)).backward()         # dx flows at once; nothing reaches the AdaLN parameters
    acc.write()                                      # each one's .grad, once; temb's gradient into its producer

Inside `with acc` norm_out (`final_adaln_out`) and each block's AdaLN (`block_adaln_path`), on the torch route
(any CPU call, or backend="torch") and on the kernels (CUDA; exact_sums.cu, exact_row_pass.cu), keep the exact
states of their cross-row sums (per-row float32 terms added as integers: ops/row_sums.py, ops/final_adaln_out/exact.py,
ops/block/exact.py) and their temb, graph and all. `write` rounds each sum
once: the norm weights' and the table's gradient per distinct temb row (identical rows are one timestep, merged),
then d_weight, d_bias and d_temb as fixed functions of those (ops/modulation_table/exact.py); the tembs' gradients,
added over the AdaLNs in the order they were first recorded, go back in one backward. The parameters' .grad must
be None before the first part (zero_grad(set_to_none=True)): write sets them, once. `merge` adds another
accumulator's states (another group of micro-batches), in any order; `all_reduce(group)` sums every rank's states
(integers over torch.distributed), so that each rank's write gives one process's bits; under FSDP2 write sets the
sharded masters' gradients (`own`; the time embedding frozen). LoRA adapters on a projection
(`adapt`, noted by the nn layers) get their gradients from the exact table gradient at write
(`TableSums.lora_gradients`). Not recorded yet, and refused inside `with acc` (NotImplementedError naming it):
adapters with a bias or an active dropout, diffusers' own forward
(hooks on a patched module) and AdaLNOut's temb dtypes other than float32 / float64, except a temb of the
projection's dtype (bf16 under autocast) on the kernels, which record it widened and keep the caller's: its
gradient joins the blocks' in float64, rounded once to its dtype. A parameter shared by two AdaLNs is refused.
temb's graph must live until write, so every op that reads temb must record (an H3 model whose AdaLNs all run
here does). The active accumulator is process-wide (a stack in core.exact, which torch.compile can read): one
training thread.
"""

from __future__ import annotations

import torch

from ..core.exact import recording, reset_recording
from ..core.transfers import HostCopies, to_device
from ..ops.block.exact import scale_columns
from ..ops.modulation_table.exact import TableSums, row_keys, silu_grad


class _Group:
    """One AdaLN's parameters, their exact states and the kept tembs: norm_out's (weight, bias, norm_weight) or a
    block's (weight, bias, norm1_weight, norm2_weight); the norm weights' gradients come from the table's scale
    sums (`norm_gradients`); `pending` the parts (temb, BlockSums | NormOutSums, the HostCopies of their temb rows
    and factors' sources) not yet folded into `table`."""

    def __init__(self, weight, bias, norm_weights):
        self.weight, self.bias, self.norm_weights = weight, bias, tuple(norm_weights)
        self.norm_names = ("norm_weight",) if len(self.norm_weights) == 1 else ("norm1_weight", "norm2_weight")
        self.table = TableSums()
        self.tembs: list[torch.Tensor] = []
        self.pending: list = []
        self.owned = None  # after all_reduce: the temb rows (keys) whose gradient this rank sends back
        self.hosts: dict = {}  # id(kept temb) -> its HostCopies, started when it was kept (write's row keys)
        self.checks: list = []  # (folded part, HostCopies of its kernels' flags): read at write's end (`_check`)
        self.adapters: list = []  # LoRA adapters on the projection: (lora_A weight, lora_B weight, scaling)
        self.factors: list = []  # their values as the forward saw them (copies: FSDP2 frees its unsharded ones)

    def keep(self, temb: torch.Tensor, copies: HostCopies | None = None) -> None:
        """Keep temb (if it wants a gradient) and start its host copy, or take `copies` (HostCopies whose first
        tensor is temb: a part's, started with its own)."""
        if temb.requires_grad and not any(t is temb for t in self.tembs):
            self.tembs.append(temb)
            self.hosts.setdefault(id(temb), copies or HostCopies([temb]))

    def norm_gradients(self, targets) -> list[torch.Tensor]:
        """The norm weights' gradients in their targets' dtypes, each rounded once: the exact sum over the distinct
        rows of (1 + scale) times the table's scale sums (norm_out's scale half; a block's scale chunks)."""
        H = targets[0].shape[0]
        columns = [slice(H, 2 * H)] if len(targets) == 1 else scale_columns(H)
        states = self.table.norm_weight_sums(columns, len(targets))
        return [state.value(w.dtype) for w, state in zip(targets, states)]


class ExactGradients:
    """The exact-gradient accumulator (module docstring)."""

    def __init__(self):
        self.groups: dict[tuple, _Group] = {}
        self.reduced = False  # all_reduce ran: nothing more may be recorded, merged or reduced until write
        self.owners: dict[int, tuple] = {}  # id(parameter seen by an op) -> (module, its name there): `own`

    def own(self, module: torch.nn.Module, names) -> None:
        """Note where the parameters an AdaLN module is about to hand its op live (`module.get_parameter(name)`),
        so that write sets the gradient of the parameter registered there at write: under FSDP2 the op sees the
        unsharded parameter and write finds the sharded DTensor again (its gradient, rounded once to the master's
        dtype, is written as that DTensor's shards)."""
        for name in names:
            self.owners[id(module.get_parameter(name))] = (module, name)

    def _target(self, p: torch.Tensor) -> torch.Tensor:
        """Where p's gradient goes: the parameter now registered where p was (`own`), else p."""
        owner = self.owners.get(id(p))
        return p if owner is None else owner[0].get_parameter(owner[1])

    def _open(self, what: str) -> None:
        if self.reduced:
            raise ValueError(f"ExactGradients.{what} after all_reduce: write first (the states are the ranks' sum)")

    def __enter__(self) -> "ExactGradients":
        recording(self)
        return self

    def __exit__(self, *exc) -> None:
        reset_recording()
        self._settle()  # the part's backward ran inside the `with`: fold its states in now

    def _settle(self) -> None:
        """Fold every group's parts in, their backwards done (a block's later hook raises): each part's temb rows,
        scales and factors from the host copies started where they were formed (`core.transfers.HostCopies`: with
        NO_WAIT 1 in the forward, so no wait here), its state carried on the device; the parts' flags copied now and
        read at write's end (`_check`)."""
        folded = set()
        try:
            for group in self.groups.values():
                for _, sums, early in group.pending:
                    temb, *sources = early.get()
                    scale, factors = sums.host_factors(*sources)
                    state = sums.state()
                    sums.closed = True
                    group.table.add(temb, state, scale, factors)  # all or nothing (TableSums checks first)
                    if sums.flags:
                        group.checks.append((sums, HostCopies(sums.flags)))
                    folded.add(id(sums))
        finally:  # a refused part stays pending (and every later one): none is folded twice
            for group in self.groups.values():
                group.pending = [part for part in group.pending if id(part[1]) not in folded]

    def _group(self, weight, bias, norm_weights) -> _Group:
        self._open("recording")
        key = tuple(id(p) for p in (weight, bias, *norm_weights))
        if key not in self.groups:
            taken = {i for k in self.groups for i in k}
            if taken & set(key):
                raise ValueError("ExactGradients: a parameter in two AdaLN ops with different other parameters (a "
                                 "shared projection or norm weight): its gradient would be written twice; not "
                                 "supported")
            for name, p in zip(("weight", "bias", "norm_weight", "norm_weight"), (weight, bias, *norm_weights)):
                if p.dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError(f"ExactGradients: exact gradients take float32 or bfloat16 parameters, got {name} "
                                     f"{p.dtype}")
            self.groups[key] = _Group(weight, bias, norm_weights)
        return self.groups[key]

    def adapt(self, params, terms) -> None:
        """Note the LoRA adapters [(lora_A weight, lora_B weight, scaling)] on the projection of the AdaLN whose
        params are (weight, bias, *norm weights) (`adapters.exact_terms`): write forms their gradients from the
        exact table gradient (`TableSums.lora_gradients`). The same adapters on every part."""
        weight, bias, *norm_weights = params
        group = self._group(weight, bias, norm_weights)
        if group.adapters:
            if [(id(A), id(B), s) for A, B, s in terms] != [(id(A), id(B), s) for A, B, s in group.adapters]:
                raise ValueError("ExactGradients: another part ran other LoRA adapters on the same projection")
            return
        group.adapters = list(terms)
        group.factors = [(A.detach().clone(), B.detach().clone(), s) for A, B, s in terms]

    def keep_temb(self, params, temb: torch.Tensor) -> None:
        """Keep a norm_out part's temb (with its graph) for write's temb gradient; params (norm_weight, weight,
        bias)."""
        norm_weight, weight, bias = params
        self._group(weight, bias, (norm_weight,)).keep(temb)

    def add_norm_out(self, params, temb: torch.Tensor, sums) -> None:
        """Take a norm_out part's NormOutSums (its temb rows as the table states' keys; folded in by `_settle`);
        params as keep_temb's."""
        norm_weight, weight, bias = params
        early = sums.early or HostCopies([temb, *sums.sources])
        self._group(weight, bias, (norm_weight,)).pending.append((temb.detach(), sums, early))

    def add_block(self, params, temb: torch.Tensor, sums) -> None:
        """Take a block part's BlockSums (filled by its backward) and keep its temb; params (weight, bias,
        norm1_weight, norm2_weight)."""
        weight, bias, *norm_weights = params
        group = self._group(weight, bias, norm_weights)
        early = HostCopies([temb, *sums.sources])  # in the forward: temb's rows for the fold and for write
        group.keep(temb, early)
        group.pending.append((temb.detach(), sums, early))

    def merge(self, other: "ExactGradients") -> "ExactGradients":
        """Add another accumulator's states and kept tembs (the same parameters), in any order."""
        other._open("merge")
        for theirs in other.groups.values():
            mine = self._group(theirs.weight, theirs.bias, theirs.norm_weights)
            mine.table.merge(theirs.table)
            mine.pending += theirs.pending  # none once their `with` ended
            mine.checks += theirs.checks
            if not mine.adapters:
                mine.adapters, mine.factors = theirs.adapters, theirs.factors
            mine.hosts.update(theirs.hosts)
            for t in theirs.tembs:
                mine.keep(t)
        self.owners.update(other.owners)
        other.groups.clear()
        other.owners.clear()
        return self

    def state_bytes(self) -> int:
        """Bytes of this accumulator's exact states: the table's limbs, rows and scale rows over this rank's distinct
        timesteps (all_reduce sends the table's over the union of
        the ranks' timesteps)."""
        total = 0
        self._settle()
        for group in self.groups.values():
            total += sum(row.nbytes + state.limbs.nbytes for row, state in group.table.rows.values())
            total += sum(scale.nbytes for scale in group.table.scales.values())
        return total

    def all_reduce(self, group=None) -> "ExactGradients":
        """Sum every rank's exact states over the torch.distributed process `group` (integer sums: one answer for any
        world size, backend or algorithm), so that `write` on each rank sets the same .grad bits, those of one
        accumulator holding every rank's parts. The ranks must have recorded the same AdaLNs in the same order (one
        model); a timestep's gradient to temb goes back on the lowest rank that holds its row, so the time
        embedding's gradients are the ranks' sum (reduce them with a sum, not a mean)."""
        import torch.distributed as dist

        self._open("all_reduce")
        self._settle()
        for mine in self.groups.values():
            _check(mine)
        shapes = [(tuple(g.weight.shape), len(g.norm_weights)) for g in self.groups.values()]
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, shapes, group=group)
        if any(other != shapes for other in everyone):
            raise ValueError(f"ExactGradients.all_reduce: the ranks recorded different AdaLNs ({everyone})")
        for mine in self.groups.values():
            mine.owned = mine.table.all_reduce(mine.weight.shape[0], group, mine.weight.device)
        self.reduced = True
        return self

    def write(self) -> None:
        """Set each recorded parameter's .grad from the exact sums, send d_temb to the kept tembs, forget all.
        Every gradient is formed before any is set: an error leaves every .grad as it was; the kernels' flags are
        read last, once every gradient's work is queued (`_check`). With `core.transfers.NO_WAIT` 1 (shipped 0) its
        host reads were started where their values were formed (`_settle`) and its host tensors go to the device
        without waiting, so the host queues the device's work while the device still runs the backward, and the
        flags' read is the one wait (LoRA adapters' gradients and a temb narrower than float32 also wait: their
        products and rounding are the host's)."""
        self._settle()
        try:
            grads, temb_grads = self._gradients()
        except BaseException:  # a kernel's flag (a non-finite term, say) is the cause to name first
            for group in self.groups.values():
                _check(group)
            raise
        for group in self.groups.values():
            _check(group)
        grads = [(p, _as_grad_of(p, g)) for p, g in grads if p.requires_grad]
        for p, g in grads:
            p.grad = g
        self.groups.clear()
        self.owners.clear()
        self.reduced = False
        _temb_backward(temb_grads)

    def _gradients(self) -> tuple[list, dict]:
        """([(parameter, its gradient)], {id(temb): (temb, its gradient)}) of the folded states, nothing set
        (`write`); raises where a parameter's .grad is set already or FSDP2's layout refuses."""
        for group in self.groups.values():
            params = {"weight": group.weight, "bias": group.bias}
            params.update(zip(group.norm_names, group.norm_weights))
            for k, (A, B, _) in enumerate(group.adapters):
                params.update({f"lora_A[{k}]": A, f"lora_B[{k}]": B})
            for name, p in params.items():
                p = self._target(p)
                if p.requires_grad and p.grad is not None:
                    raise ValueError(f"ExactGradients.write: {name}.grad is set already; zero the gradients with "
                                     "set_to_none=True before the first micro-batch (write sets them once)")
            if _fsdp_unsharded(self.owners, self._target(group.weight)):
                raise ValueError("ExactGradients.write: the AdaLN parameters are FSDP2's unsharded ones (no reshard "
                                 "after the backward: set_reshard_after_backward(False)); call model.reshard() "
                                 "before write, so that it writes the sharded masters' gradients")
            if group.tembs and _sharded(self._target(group.weight)):
                raise NotImplementedError(
                    "ExactGradients.write: temb requires grad and the AdaLN parameters are FSDP2-sharded; FSDP2's "
                    "autograd hooks pass zeros through temb in the backward of each part, which frees temb's graph "
                    "before write can send the exact d_temb back. Freeze the time embedding "
                    "(model.time_embedder.requires_grad_(False)) for exact gradients under FSDP2; nothing was written")
        grads, temb_grads = [], {}
        for group in self.groups.values():
            weight, bias = self._target(group.weight), self._target(group.bias)
            norm_weights = [self._target(w) for w in group.norm_weights]
            d_act, lora = group.table.lora_gradients(group.factors)  # LoRA adapters: from the forward's values
            if _sharded(weight):  # FSDP2: no temb gradient (refused above), d_weight in the master's dtype, and where
                # the shard is a block of rows (FSDP2's Shard(0) on one mesh dimension) only this rank's rows
                rows, d_temb, d_weight, d_bias = group.table.gradients(None, bias.dtype, weight.dtype,
                                                                       _local_rows(weight), weight.device)
            else:
                rows, d_temb, d_weight, d_bias = group.table.gradients(group.weight, bias.dtype,
                                                                       with_temb=bool(group.tembs))
                if d_act is not None and d_temb is not None:  # the adapters' part of temb's gradient
                    d_temb = d_temb + to_device(d_act * silu_grad(rows), d_temb.device)
            for (A, B, _), (d_A, d_B) in zip(group.adapters, lora):  # the masters (`own`), in their dtype
                A, B = self._target(A), self._target(B)
                grads += [(A, d_A.to(A.dtype)), (B, d_B.to(B.dtype))]
            grads += [(weight, d_weight), (bias, d_bias)]
            grads += list(zip(norm_weights, group.norm_gradients(norm_weights)))
            _temb_grads(group.tembs, group.hosts, rows, d_temb, temb_grads, group.owned)
        return grads, temb_grads


def _check(group: _Group) -> None:
    """Raise what a part's kernels flagged (`NormOutSums.check`, `BlockSums.check`: a non-finite term, an index
    outside [0, T), a full fixup list), from the flags' host copies `_settle` started."""
    for sums, flags in group.checks:
        sums.flags = flags.get()
        sums.check()
    group.checks.clear()


def _fsdp_unsharded(owners: dict, p: torch.Tensor) -> bool:
    """Whether p is not sharded although an AdaLN module of the same accumulator is FSDP2's (fully_shard'ed: the
    blocks under fsdp2_shard): the model is sharded, p was left unsharded."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return not _sharded(p) and any(isinstance(module, FSDPModule) for module, _ in owners.values())


def _sharded(p: torch.Tensor) -> bool:
    """Whether p is a DTensor (FSDP2's sharded parameter)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _local_rows(p: torch.Tensor) -> slice | None:
    """The rows of p held on this rank where p is a DTensor sharded by rows on a 1-D mesh (FSDP2's Shard(0): torch's
    chunking, ceil(N / W) rows a rank), checked against its local shard; None for any other layout (the whole
    gradient is formed then, and each rank keeps its part)."""
    from torch.distributed.tensor import Shard

    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        return None
    n, world, rank = p.shape[0], p.device_mesh.size(), p.device_mesh.get_local_rank()
    chunk = -(-n // world)
    rows = slice(min(n, rank * chunk), min(n, (rank + 1) * chunk))
    return rows if rows.stop - rows.start == p.to_local().shape[0] else None


def _as_grad_of(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """g (in p's dtype) as p's .grad: on p's device; for a DTensor, g is the whole gradient (each rank keeps its own
    part of the same full value) or, where its rows are fewer than p's, this rank's shard (`_local_rows`); no
    communication either way."""
    if not _sharded(p):
        return g.to(p.device)
    from torch.distributed.tensor import DTensor, distribute_tensor

    if g.shape[0] != p.shape[0]:
        return DTensor.from_local(g.to(p.device), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return distribute_tensor(g.to(p.device), p.device_mesh, p.placements, src_data_rank=None)


def _temb_grads(tembs, hosts, rows, d_temb, into: dict, owned=None) -> None:
    """Add d_temb of each distinct row (of those `owned`, if given) to the first kept temb that holds it, in float64
    on d_temb's device (into: id -> (temb, its gradient so far)); the groups add theirs in the order they were first
    recorded. A temb's rows are read from its host copy (hosts: id -> core.transfers.HostCopies, temb first). A kept
    temb narrower than the rows (a bf16 temb that norm_out widened) holds a row whose widening, exact, has the row's
    bits."""
    if not tembs:  # nothing wants temb's gradient: no row keys to make
        return
    pending = {key: k for k, key in enumerate(row_keys(rows)) if owned is None or key in owned}
    for temb in tembs:
        _, g = into.setdefault(id(temb), (temb, torch.zeros(temb.shape, dtype=torch.float64, device=d_temb.device)))
        wider = rows.dtype if temb.dtype.itemsize < rows.dtype.itemsize else temb.dtype
        keys = row_keys(hosts[id(temb)].get()[0].to(wider))
        for t, key in enumerate(keys):
            k = pending.pop(key, None)
            if k is not None:
                g[t] += d_temb[k].to(g.device)  # float64 (TableSums.gradients), rounded once in _temb_backward


def _temb_backward(temb_grads: dict) -> None:
    """One backward through every kept temb with its gradient (cast to its dtype once)."""
    if not temb_grads:
        return
    outputs = [temb for temb, _ in temb_grads.values()]
    # float64 -> float32 rounds to nearest even on every device; narrower dtypes are rounded where they always were
    grads = [(g if temb.dtype in (torch.float32, torch.float64) else g.cpu()).to(temb.dtype).to(temb.device)
             for temb, g in temb_grads.values()]
    try:
        torch.autograd.backward(outputs, grads)
    except RuntimeError as e:
        if "second time" not in str(e):
            raise
        raise RuntimeError("ExactGradients.write: temb's graph was freed before write (temb also fed ops whose "
                           "backward ran and that do not record, such as diffusers' own forward); exact gradients "
                           "need every op that reads temb to record") from e
