"""The table's parameter gradients from exact table-gradient states, over the distinct temb rows.

    sums = TableSums()
    sums.add(temb, state)        # temb (T, D); state: core.exact.ExactSum (T, N), table row t's exact sum
    sums.add(temb, state, scale, factors)   # each row's s1 (T, K) of its norms and the columns' factors (N,)
    sums.merge(other)            # another part's, in any order
    rows, d_temb, d_weight, d_bias = sums.gradients(weight, bias_dtype)
    d_act, lora = sums.lora_gradients(adapters)   # LoRA adapters on the projection: their gradients, temb's part

Rows of temb with the same bits are one timestep: their states are merged (integers: any order), so the parts of a
batch (micro-batches, ranks) may hold a timestep each, or several, in any order. `gradients` takes the distinct rows
in the order of their bytes (a function of the set of rows alone), rounds each row's exact sum once to float32
(d_table), and forms d_weight and d_temb from those in float64 on the parameters' device (`weight_grad`,
`input_grad`: elementwise products and adds in an order fixed by the shapes alone, so every device and every block of
rows gives the same bits; SiLU and its derivative of the rows on the CPU); d_bias is the exact sum over every row,
rounded once. norm_out's states hold sums that its gradients take times a column's
float32 factor (its norm weight for the scale half: `factors`) and times a row's (1 + scale[t]: `scale`), both
applied exactly before the one rounding (`core.exact.products`): d_table = factors A, and `norm_weight_sums` the exact
sum over the distinct rows of scale A (a block: its two norms' scale chunks, each norm's three modalities summed).
LoRA adapters (A (r, D), B (N, r), scaling s: table += s B A act, act = silu(temb)) get theirs from the same
d_table and rows in float64: dB = s d_table^T (act A^T), dA = s (d_table B)^T act, and temb's gradient the part
s (d_table B) A of d_act (the caller adds it times SiLU's derivative, `silu_grad`).
rows (U, D) are the distinct temb rows, d_temb (U, D) their gradient (float64, rounded by the caller), d_weight
(N, D) in weight's dtype, d_bias (N,) in bias_dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core import launchers, tensors
from ...core.exact import E_MIN, LIMBS, ExactSum, products
from ...core.transfers import no_wait, to_device

_F64 = torch.float64
PRODUCT_ELEMENTS = 1 << 25  # float64 elements a block of weight_grad's / input_grad's products (two at once: 512 MB)


def silu_grad(rows: torch.Tensor) -> torch.Tensor:
    """d silu(t) / dt at rows, float64 (the factor modulation_table_backward applies to d_act)."""
    sig = torch.sigmoid(rows.to(_F64))
    return sig * (1.0 + rows.to(_F64) * (1.0 - sig))


def weight_grad(d_table: torch.Tensor, act: torch.Tensor, dtype: torch.dtype, device,
                rows: slice | None = None, kernels: dict | None = None) -> torch.Tensor:
    """d_weight (N, D) = d_table^T act cast to `dtype` (torch's cast), on `device`, from d_table (U, N) float32 and act
    (U, D) float64 (SiLU of the distinct rows): element (n, d) is the float64 sum over u in order of d_table[u, n]
    act[u, d], each product and each add one rounding (separate elementwise ops, no fused multiply-add): the same bits
    on every device and for every block of rows (a NaN's payload aside); `rows`: only those rows of d_weight (a
    shard's). With `kernels` (a compiled unit of `device`) on the GPU and rows in steps of 1: exact_products.cu's one
    pass, the same bits; else torch ops in blocks of rows."""
    g = d_table.to(device=device, dtype=_F64)
    act = to_device(act, device, _F64)  # a host tensor: no wait for the device's queue
    picked = range(g.shape[1])[rows if rows is not None else slice(None)]
    if kernels is not None and tensors.gpu(g) and dtype in WEIGHT_PRODUCTS and picked.step == 1:
        out = torch.empty(len(picked), act.shape[1], dtype=dtype, device=device)
        launch_weight_products(kernels, g.contiguous(), act.contiguous(), out, picked.start)
        return out
    g = g if rows is None else g[:, rows]
    (U, N), D = g.shape, act.shape[1]
    out = torch.empty(N, D, dtype=dtype, device=device)
    step = max(1, PRODUCT_ELEMENTS // max(D, 1))
    for n in range(0, N, step):
        part = g[0, n:n + step, None] * act[0]
        for u in range(1, U):
            part += g[u, n:n + step, None] * act[u]
        out[n:n + step] = part
    return out


WEIGHT_PRODUCTS = {torch.float32: "exact_weight_products_f32", torch.bfloat16: "exact_weight_products_bf16"}
WEIGHT_ROWS = 8  # rows of d_weight a thread sums (exact_products.cu)
WEIGHT_TILES_MAX = 65535  # the grid's y (tiles of rows): a stride loop over the tiles past it


def launch_weight_products(k: dict, g: torch.Tensor, act: torch.Tensor, out: torch.Tensor, r0: int) -> None:
    """exact_products.cu's exact_weight_products_(f32|bf16) on torch's current stream: out (rows, D) = rows r0 ..
    of d_weight from g (U, N) and act (U, D), contiguous float64 (`weight_grad`)."""
    (U, N), (rows, D) = g.shape, out.shape
    if rows * D == 0:
        return
    index = g.device.index
    launchers.bind(index)
    tiles = min(-(-rows // WEIGHT_ROWS), WEIGHT_TILES_MAX)
    k[WEIGHT_PRODUCTS[out.dtype]]((-(-D // 256), tiles, 1), (256, 1, 1), 0, tensors.current_stream(index), g.data_ptr(),
                                  act.data_ptr(), out.data_ptr(), U, N, D, r0, rows)


def input_grad(d_table: torch.Tensor, weight: torch.Tensor, device, kernels: dict | None = None) -> torch.Tensor:
    """d_act (U, D) float64 = d_table weight on `device`, from d_table (U, N) float32 and weight (N, D): each product
    exact (float32 times a float32 or bf16 value: at most 48 significant bits), a column's N products added in one
    pairwise tree fixed by N (the upper half of the rows added elementwise onto the lower, the odd middle row kept,
    until one row is left): the same bits on every device and for every block of columns. With `kernels` (a compiled
    unit of `device`) on the GPU: exact_products.cu's input passes, five levels of the tree a launch; else torch ops
    in blocks of columns."""
    g, weight = d_table.to(device=device, dtype=_F64), weight.detach().to(device)
    (U, N), D = g.shape, weight.shape[1]
    if kernels is not None and tensors.gpu(g) and weight.dtype in INPUT_PRODUCTS and N and U * D:
        return launch_input_products(kernels, g.contiguous(), weight.contiguous())
    out = torch.zeros(U, D, dtype=_F64, device=device)  # N = 0: the empty sum
    step = max(1, PRODUCT_ELEMENTS // max(N, 1))
    for d in range(0, D if N else 0, step):
        columns = weight[:, d:d + step].to(_F64)  # widened once a block, for every u
        for u in range(U):
            part = g[u, :, None] * columns
            n = N
            while n > 1:
                half = (n + 1) // 2
                part[:n - half] += part[half:n]
                n = half
            out[u, d:d + step] = part[0]
    return out


INPUT_PRODUCTS = {torch.float32: "exact_input_products_f32", torch.bfloat16: "exact_input_products_bf16"}
INPUT_FOLD = 5  # levels of the tree a launch (exact_products.cu)


def launch_input_products(k: dict, g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """exact_products.cu's exact_input_products_(f32|bf16), then exact_input_fold until one position is left, on
    torch's current stream: d_act (U, D) float64 from g (U, N) float64 and weight (N, D), contiguous, N >= 1
    (`input_grad`)."""
    (U, N), D = g.shape, weight.shape[1]
    index = g.device.index
    launchers.bind(index)
    stream = tensors.current_stream(index)
    level, n, name = None, N, INPUT_PRODUCTS[weight.dtype]
    while level is None or n > 1:
        up = n
        for _ in range(INPUT_FOLD):
            up = (up + 1) // 2
        out = torch.empty(U, up, D, dtype=_F64, device=g.device)
        blocks = min(-(-U * up * D // 256), 1 << 16)  # a grid-stride loop past this
        if level is None:
            k[name]((blocks, 1, 1), (256, 1, 1), 0, stream, g.data_ptr(), weight.data_ptr(), out.data_ptr(), U, N, D)
        else:
            k["exact_input_fold"]((blocks, 1, 1), (256, 1, 1), 0, stream, level.data_ptr(), out.data_ptr(), U, n, D)
        level, n = out, up
    return level[:, 0]


def row_keys(rows: torch.Tensor) -> list[bytes]:
    """Each temb row's identity, of rows (n, D): its dtype and bytes (rows with the same key are one timestep), from
    one copy of the rows to the CPU (a row's key does not depend on the other rows)."""
    host = rows.detach().cpu().contiguous()
    prefix = str(host.dtype).encode()
    return [prefix + raw.tobytes() for raw in host.view(torch.uint8).numpy()]


class TableSums:
    """Exact table-gradient states keyed by temb row (module docstring)."""

    def __init__(self):
        self.rows: dict[bytes, tuple[torch.Tensor, ExactSum]] = {}
        self.scales: dict[bytes, torch.Tensor] = {}  # the norms' s1 row (K,) float32 a temb row
        self.factors: torch.Tensor | None = None      # the columns' factors (N,) float32
        # device index -> the states' core.exact_kernels.ExactKernels there: their carries, write's products and
        # roundings, and d_weight (`weight_grad`) on its unit
        self.kernels: dict = {}

    def add(self, temb: torch.Tensor, state: ExactSum, scale: torch.Tensor | None = None,
            factors: torch.Tensor | None = None) -> "TableSums":
        """Merge state's row t into the state of temb's row t, for every t (temb (T, D), state (T, N)); the norms'
        `scale` (T, K) and `factors` (N,) float32 with them (the same for every part of one temb row: ValueError
        otherwise). The state's kernels (if any) carry the rows' states and run write on its device."""
        T = state.shape[0]
        if temb.dim() != 2 or temb.shape[0] != T:
            raise ValueError(f"temb must be (T, D) with T = the state's {T} rows, got {tuple(temb.shape)}")
        if scale is not None and (scale.dim() != 2 or scale.shape[0] != T or scale.dtype != torch.float32):
            raise ValueError(f"scale must be float32 (T, K) with T = {T}, got {scale.dtype} {tuple(scale.shape)}")
        if factors is not None and (factors.shape != state.shape[1:] or factors.dtype != torch.float32):
            raise ValueError(f"factors must be float32 ({state.shape[1]},), got {factors.dtype} "
                             f"{tuple(factors.shape)}")
        host = temb.detach().cpu().contiguous()  # one copy a tensor (each a wait for the device)
        rows, keys = host.unbind(0), row_keys(host)
        scales = None if scale is None else list(scale.detach().cpu())
        self._check(None if factors is None else factors.detach().cpu(), zip(keys, scales or [None] * T))
        if factors is not None:
            self.factors = factors.detach().cpu()
        if state.kernels is not None:  # the unit the part's row ops ran, on the state's device
            self.kernels.setdefault(state.limbs.device.index, state.kernels)
        for t, (key, row) in enumerate(zip(keys, rows)):
            self._merge_row(key, row, ExactSum.from_limbs(state.limbs[:, t:t + 1].clone(), kernels=state.kernels),
                            None if scales is None else scales[t])
        return self

    def merge(self, other: "TableSums") -> "TableSums":
        """Add another part's states (any order of merging gives the same states)."""
        self._check(other.factors, ((key, other.scales.get(key)) for key in other.rows))
        if other.factors is not None:
            self.factors = other.factors
        for index, kernels in other.kernels.items():
            self.kernels.setdefault(index, kernels)
        for key, (row, part) in other.rows.items():
            self._merge_row(key, row, ExactSum.from_limbs(part.limbs.clone(), kernels=part.kernels),
                            other.scales.get(key))
        return self

    def _check(self, factors, rows) -> None:
        """Raise ValueError, before anything is merged, where `factors` or a (row's key, scale) differs from what this
        holds already (so a refused part leaves the states as they were)."""
        if factors is not None and self.factors is not None and not torch.equal(self.factors, factors):
            raise ValueError("TableSums: parts with other column factors (another norm weight)")
        for key, scale in rows:
            held = self.scales.get(key)
            if scale is not None and held is not None and not torch.equal(held, scale):
                raise ValueError("TableSums: one temb row with two table rows (parts on other routes or weights)")

    def _merge_row(self, key: bytes, row: torch.Tensor, part: ExactSum, scale: torch.Tensor | None = None) -> None:
        if key in self.rows:
            self.rows[key][1].merge(part)
        else:
            self.rows[key] = (row, part)
        if scale is not None:
            self.scales[key] = scale

    def all_reduce(self, columns: int, group=None, device=None) -> set:
        """Sum the states of every rank of the process `group` over the union of their rows (integers: any order; a
        rank without rows adds zeros, made on `device`, the states' device where it holds rows), `columns` = N;
        returns the keys of the rows whose lowest holder is this rank."""
        import torch.distributed as dist

        everyone = [None] * dist.get_world_size(group)
        mine = {key: (row, self.scales.get(key)) for key, (row, _) in self.rows.items()}
        dist.all_gather_object(everyone, (mine, self.factors), group=group)
        rows = {}
        for held, factors in everyone:
            self._check(factors, ((key, scale) for key, (_, scale) in held.items()))
            self.factors = self.factors if factors is None else factors
            for key, (row, scale) in held.items():
                rows.setdefault(key, row)
                if scale is not None:
                    self.scales[key] = scale
        everyone = [held for held, _ in everyone]
        if not rows:  # every rank sees it: they raise together
            raise ValueError("TableSums.all_reduce: no rank recorded a row")
        keys = sorted(rows)
        device = next(iter(self.rows.values()))[1].limbs.device if self.rows else device
        limbs = torch.zeros((LIMBS, len(keys), columns), dtype=torch.int64, device=device)
        for u, key in enumerate(keys):
            if key in self.rows:
                limbs[:, u] = self.rows[key][1].limbs[:, 0]
        dist.all_reduce(limbs, group=group)
        kernels = self._exact(device)
        total = ExactSum.from_limbs(limbs, kernels=kernels)._carry()
        self.rows = {key: (rows[key], ExactSum.from_limbs(total.limbs[:, u:u + 1].clone(), kernels=kernels))
                     for u, key in enumerate(keys)}
        rank = dist.get_rank(group)
        return {key for key in keys if next(r for r, held in enumerate(everyone) if key in held) == rank}

    def _d_table(self):
        """(rows (U, D) on the CPU, d_table (U, N) float32 on the states' device, d_bias's state) over the distinct
        rows in the order of their bytes; with `factors`, d_table and d_bias are the exact products' roundings (each
        value rounded once: the same bits on every device, so d_table stays where it was formed)."""
        if not self.rows:
            raise ValueError("no rows were added: the gradients of an empty batch are zeros, not computed here")
        keys = sorted(self.rows)
        limbs = torch.cat([self.rows[k][1].limbs for k in keys], dim=1)
        total = ExactSum.from_limbs(limbs, kernels=self._exact(limbs.device))  # carried
        bias = total.total()
        if self.factors is not None:
            d_table = products(total, self.factors).value(torch.float32)
            bias = products(bias, self.factors)
        else:
            d_table = total.value(torch.float32)
        return torch.stack([self.rows[k][0] for k in keys]), d_table, bias

    def norm_weight_sums(self, columns: list[slice], norms: int = 1) -> list[ExactSum]:
        """The norm weights' sums before their rounding, product states (H,): over the distinct rows, the row's scale
        (its K float32 factors, s1 = 1 + scale) times its sums in `columns` (slices of H columns, K / H of them,
        in the scale's order), the slices split into `norms` consecutive groups, one a norm, each group summed
        (norm_out: [slice(H, 2H)], 1; a block: its three modalities' scale_msa chunks, then their scale_mlp ones, 2)."""
        keys = sorted(self.rows)
        missing = [k for k in keys if k not in self.scales]
        if not keys:
            raise ValueError("TableSums.norm_weight_sums: no rows were added")
        if missing:
            raise ValueError("TableSums.norm_weight_sums: a row without its scale (only the norms' sums hold them)")
        limbs = torch.cat([torch.cat([self.rows[k][1].limbs[..., c] for c in columns], dim=-1) for k in keys], dim=1)
        kernels = self._exact(limbs.device)
        total = ExactSum.from_limbs(limbs, kernels=kernels)
        scale = torch.stack([self.scales[k] for k in keys])
        limbs = products(total, scale).total().limbs            # (2 LIMBS, K)
        limbs = limbs.reshape(limbs.shape[0], norms, -1, columns[0].stop - columns[0].start).sum(2)
        return [ExactSum.from_limbs(limbs[:, k].contiguous(), 2 * E_MIN, kernels)._carry() for k in range(norms)]

    def lora_gradients(self, adapters):
        """(d_act (U, D) float64 or None, [(dA (r, D), dB (N, r)) float64]) of the LoRA adapters [(A, B, scaling)]
        over the distinct rows (module docstring), in `gradients`' row order."""
        if not adapters:
            return None, []
        rows, d_table, _ = self._d_table()
        d_table, act = d_table.to("cpu", _F64), F.silu(rows.to(_F64))  # float64 products on the CPU
        d_act, grads = torch.zeros_like(act), []
        for A, B, s in adapters:
            A, B = A.detach().cpu().to(_F64), B.detach().cpu().to(_F64)
            g = s * (d_table @ B)  # (U, r): d of A act
            grads.append((g.T @ act, s * (d_table.T @ (act @ A.T))))
            d_act += g @ A
        return d_act, grads

    def _exact(self, device):
        """The ExactKernels a part recorded on `device`'s index, or None (the torch code)."""
        return self.kernels.get(torch.device(device).index)

    def gradients(self, weight: torch.Tensor | None, bias_dtype: torch.dtype, weight_dtype: torch.dtype | None = None,
                  weight_rows: slice | None = None, device=None, with_temb: bool = True):
        """(rows (U, D) on the CPU, d_temb (U, D) float64 on `device` (the CPU while core.transfers.NO_WAIT is 0),
        d_weight (N, D) on `device` (default: weight's, else the CPU), d_bias (N,)) over the distinct rows (module
        docstring). weight None: no d_temb (None), d_weight in weight_dtype (the projection's values are not
        needed), and with `weight_rows` only those rows of it (a rank's shard: each row is its own sum over the
        distinct rows, so a shard has the bits of the whole gradient's rows; also with weight given). with_temb
        False: no d_temb either (nothing wants temb's gradient)."""
        rows, d_table, bias = self._d_table()
        device = device if device is not None else weight.device if weight is not None else "cpu"
        exact = self._exact(device)
        unit = None if exact is None else exact.unit  # the states' compiled unit there: the products' kernels
        d_weight = weight_grad(d_table, F.silu(rows.to(_F64)), weight_dtype if weight is None else weight.dtype,
                               device, weight_rows, unit)
        d_temb = None
        if weight is not None and with_temb:
            where = device if no_wait() else "cpu"  # d_temb's products on the device, or (NO_WAIT 0) the host
            d_temb = input_grad(d_table, weight, device, unit).to(where) * to_device(silu_grad(rows), where)
        return rows, d_temb, d_weight, bias.value(bias_dtype)
