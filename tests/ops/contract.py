"""The op contract, written once: one `OpCase` per public op and the checks the suite (tests/ops/test_contract.py)
runs on every one of them.

An `OpCase` says how to make small seeded inputs (`make(seed, shape)`: the public call's arguments by name), how to call
the public function (`call(args, backend)`), the diffusers replay (`replay(args)`, torch autograd: what diffusers
computes), the float64 golden (`golden(args)`: the op on the upcast inputs, rounding nowhere; where
adaln_lab.reference has none, the replay run in float64), which arguments are differentiable, the arguments that
hold one entry per row (for batch invariance), the gradient contract of its docstring, the launch ops with example
arguments (for `torch.library.opcheck`), and bad inputs with the argument their error must name.

The gradient contracts, read off each op's docstring:

- `exact_grads(args, dys)`: gradients the op's equal bit for bit (final_adaln_out on CPU tensors is the diffusers
  replay under torch's autograd; gated_residual_norm "has the bits of the two ops run one after the other";
  modulated_rms_norm_and_residual those of modulated_rms_norm with x reused; block_adaln_path the ops' numerics).
- `grad_bounds(args, dys, golden_grads)`: per differentiable argument, the bound on |op's gradient - the float64
  golden's| per element. The ops' torch code takes "the exact derivative ... rounded once": its gradient is one
  rounding (to the gradient's dtype) of a value v computed in float32 (the per-row dx) or float64 (the parameter
  sums); with E a bound on |v - golden| from the standard error analysis (gamma_k = k u / (1 - k u), u the unit
  roundoff of the dtype v is computed in, k the roundings along the longest chain), |result - golden| <=
  ulp(|golden| + E) / 2 + E (`rounded`). E = 0 where v is exact (a bf16 product in float32, the residual's identity):
  then the result is the golden rounded once, |err| <= ulp / 2.

Shapes are tiny (S = 7 rows, H = 16, D = 16, T = 2, R = 3T = 6 table rows, a leading dimension of 2 on the row ops)
so that the whole CPU suite runs in seconds.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from adaln_lab import (block_adaln_path, final_adaln_out, gated_residual, gated_residual_norm, modulated_rms_norm,
                       modulation_table, row_order)
from adaln_lab.core import support
from adaln_lab.core.plan import forward_bytes
from adaln_lab.harness.block_protocol import rowwise_attn, rowwise_ff
from adaln_lab.ops.final_adaln_out import launch as final_launch
from adaln_lab.ops.gated_residual import launch as residual_launch
from adaln_lab.ops.gated_residual_norm import launch as pair_launch
from adaln_lab.ops.modulated_rms_norm import launch as norm_launch
from adaln_lab.ops.modulated_rms_norm import modulated_rms_norm_and_residual
from adaln_lab.ops.modulation_table import launch as table_launch
from adaln_lab.ops.row_order import op as row_order_op
from adaln_lab.reference import block as br
from adaln_lab.reference.backward import rstd_of
from adaln_lab.reference.final_adaln_out import golden as final_golden
from adaln_lab.reference.final_adaln_out import replay as final_replay

EPS = 1e-5
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


@dataclasses.dataclass(frozen=True)
class Shape:
    """One case's sizes: S rows of width H (with leading dims `lead` on the row ops), T timesteps of D channels,
    R = 3T table rows (an H3 block's)."""
    S: int = 7
    H: int = 16
    D: int = 16
    T: int = 2
    lead: tuple = (2,)

    @property
    def R(self) -> int:
        return br.MODALITIES * self.T


CPU = Shape()  # the CPU suite's: tiny, so that it runs in seconds


# ---------------------------------------------------------------- rounding: ulps, gamma, one rounding's bound

PRECISION = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24, torch.float64: 53}  # bits, the implicit one too
MIN_EXPONENT = {torch.bfloat16: -126, torch.float16: -14, torch.float32: -126, torch.float64: -1022}


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p of round-to-nearest in dtype (p bits of precision): |fl(v) - v| <= u |v| for normal v."""
    return 2.0 ** -PRECISION[dtype]


def gamma(k: int, dtype: torch.dtype) -> float:
    """gamma_k = k u / (1 - k u): the relative error bound of k roundings in dtype (Higham, Accuracy and Stability
    of Numerical Algorithms, 3.1)."""
    ku = k * unit_roundoff(dtype)
    return ku / (1.0 - ku)


def rel_l2(value: torch.Tensor, ref: torch.Tensor) -> float:
    """||value - ref|| / ||ref|| in float64: one error measure for the ops' accuracy comparisons."""
    ref = ref.double()
    return float((value.double() - ref).norm() / ref.norm())


def ulp(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of dtype's numbers in the binade of each |magnitude| (float64; subnormal spacing below the
    smallest normal and at zero)."""
    magnitude = magnitude.to(F64).abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m 2^exponent, m in [0.5, 1)
    binade = torch.where(magnitude == 0, MIN_EXPONENT[dtype], exponent - 1).clamp_min(MIN_EXPONENT[dtype])
    return torch.ldexp(torch.ones_like(magnitude), binade - (PRECISION[dtype] - 1))


def rounded(golden: torch.Tensor, dtype: torch.dtype, error) -> torch.Tensor:
    """The bound on |fl(v) - golden| for v within `error` of golden and fl one round-to-nearest to dtype:
    ulp(|golden| + error) / 2 + error (error 0: half an ulp of the golden)."""
    error = torch.as_tensor(error, dtype=F64)
    return ulp(golden.to(F64).abs() + error, dtype) / 2 + error


def assert_within(got: torch.Tensor, golden: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """Raise AssertionError (naming `what`, the worst element and its bound) unless |got - golden| <= bound
    elementwise."""
    err = (got.to(F64) - golden.to(F64)).abs()
    over = err > bound
    if bool(over.any()):
        i = int((err - bound).flatten().argmax())
        raise AssertionError(f"{what}: {int(over.sum())} of {err.numel()} elements outside the bound; worst at flat "
                             f"index {i}: |err| = {float(err.flatten()[i]):.3e} > bound {float(bound.flatten()[i]):.3e}"
                             f" (got {float(got.flatten()[i]):.9e}, golden {float(golden.flatten()[i]):.9e})")


# ---------------------------------------------------------------- calling an op: leaves, outputs, gradients


def as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def upstream(outputs: tuple, seed: int) -> tuple[torch.Tensor, ...]:
    """One seeded randn upstream gradient per output, in its dtype and shape."""
    g = generator(1000 + seed)
    return tuple(torch.randn(o.shape, generator=g).to(o.dtype).to(o.device) for o in outputs)


def leaves(args: dict, names) -> dict:
    """args with the named tensors replaced by fresh leaves that require grad (same values)."""
    return {**args, **{n: args[n].detach().clone().requires_grad_(True) for n in names}}


def run(call: Callable, args: dict, dys, differentiable) -> tuple[tuple, dict]:
    """(outputs detached, {name: gradient}) of call(args) with upstream gradients dys into each output."""
    args = leaves(args, differentiable)
    outs = as_tuple(call(args))
    if not differentiable:
        return tuple(o.detach() for o in outs), {}
    grads = torch.autograd.grad(outs, [args[n] for n in differentiable], [d.to(o.dtype) for o, d in zip(outs, dys)],
                                allow_unused=True)
    return tuple(o.detach() for o in outs), dict(zip(differentiable, grads))


def assert_same_bits(got, want, what: str) -> None:
    """Raise AssertionError naming `what` unless got and want are equal tensors (dtype, shape and bits: NaNs
    equal), or both None."""
    if got is None or want is None:
        assert got is None and want is None, f"{what}: one is None ({got is None}, {want is None})"
        return
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype} {tuple(got.shape)} != {want.dtype} {tuple(want.shape)}"
    same = (got == want) | (got.isnan() & want.isnan())
    if not bool(same.all()):
        diff = (got.to(F64) - want.to(F64)).abs()
        raise AssertionError(f"{what}: {int((~same).sum())} of {same.numel()} elements differ (max |diff| "
                             f"{float(diff[~same].max()):.3e})")


def assert_results_equal(got: tuple[tuple, dict], want: tuple[tuple, dict], what: str) -> None:
    """Outputs and gradients of two `run`s bit for bit."""
    (outs, grads), (ref_outs, ref_grads) = got, want
    assert len(outs) == len(ref_outs), f"{what}: {len(outs)} outputs != {len(ref_outs)}"
    for i, (a, b) in enumerate(zip(outs, ref_outs)):
        assert_same_bits(a, b, f"{what}: output {i}")
    assert grads.keys() == ref_grads.keys(), f"{what}: gradients of {sorted(grads)} != {sorted(ref_grads)}"
    for name in grads:
        assert_same_bits(grads[name], ref_grads[name], f"{what}: gradient of {name}")


# ---------------------------------------------------------------- property checks, for any op (or a planted variant)


def recording_backend(graphs: list):
    """A torch.compile backend: AOTAutograd whose forward and backward compilers note each graph's call targets
    and run the graph as traced (aot_eager's numerics: the traced ops themselves)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, example_inputs):
        graphs.append([" ".join(map(str, (n.target, *n.args[:1]))) for n in gm.graph.nodes
                       if n.op == "call_function"])  # a mutating op is auto_functionalized's first argument
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record)


def assert_compiled_matches_eager(call: Callable, args: dict, dys, differentiable) -> list:
    """Raise AssertionError unless torch.compile(call, fullgraph=True) gives eager's outputs and gradients bit for
    bit (a graph break raises too); return the traced graphs' call targets (forward graph first)."""
    eager = run(call, args, dys, differentiable)
    torch._dynamo.reset()
    graphs: list = []
    compiled = torch.compile(call, fullgraph=True, backend=recording_backend(graphs))
    assert_results_equal(run(compiled, args, dys, differentiable), eager, "torch.compile(fullgraph=True) vs eager")
    torch._dynamo.reset()
    return graphs


def slice_rows(t: torch.Tensor, dim: int, rows) -> torch.Tensor:
    return t.narrow(dim, rows.start, rows.stop - rows.start)


def assert_rows_invariant(call: Callable, args: dict, dys, differentiable, rows: dict, out_dim: int) -> None:
    """Raise AssertionError unless every output row and the gradient rows of the row arguments (`rows`: name ->
    the dim of its rows) computed in the whole batch equal, bit for bit, those computed for each row alone and for
    a sub-batch of three rows (`dys` sliced alike; every other argument as given)."""
    n = next(iter(args[name].shape[dim] for name, dim in rows.items()))
    outs, grads = run(call, args, dys, differentiable)
    failures = []
    for part in [range(s, s + 1) for s in range(n)] + [range(1, min(4, n))]:
        sub_args = {**args, **{name: slice_rows(args[name], dim, part) for name, dim in rows.items()}}
        sub_outs, sub_grads = run(call, sub_args, [slice_rows(d, out_dim, part) for d in dys], differentiable)
        for i, (a, b) in enumerate(zip(sub_outs, outs)):
            if not torch.equal(a, slice_rows(b, out_dim, part)):
                failures.append(f"output {i} of rows {part.start}..{part.stop - 1}")
        for name, dim in rows.items():
            if name in differentiable and not torch.equal(sub_grads[name], slice_rows(grads[name], dim, part)):
                failures.append(f"gradient of {name} of rows {part.start}..{part.stop - 1}")
    assert not failures, f"not batch-invariant: {len(failures)} differ: " + "; ".join(failures[:6])


def golden_grads(case: "OpCase", args: dict, dys) -> tuple[tuple, dict]:
    """(outputs, gradients) of the float64 golden at args, the upstream gradients widened to float64."""
    wide = {n: (v.detach().to(F64) if isinstance(v, torch.Tensor) and v.dtype.is_floating_point else v)
            for n, v in args.items()}
    return run(case.golden, wide, [d.to(F64) for d in dys], case.differentiable)


def plant_refusal(monkeypatch, error: Exception) -> None:
    """Every kernel rule of `adaln_lab.core.support` (the one rule) answers `error` for any inputs."""
    for name in ("final_adaln_out", "table", "rows", "table_dtype", "on_device", "block", "numba_final_adaln_out"):
        monkeypatch.setattr(support, name, lambda *args, **kwargs: error)


def names_argument(message: str, argument: str) -> bool:
    """Whether `argument` appears in message as a word of its own (shift, not shift_msa)."""
    return re.search(rf"(?<![\w.]){re.escape(argument)}(?!\w)", message) is not None


# ---------------------------------------------------------------- the cases


@dataclasses.dataclass(frozen=True)
class BadInput:
    """One bad argument: `change(args)` returns args with it, the call must raise `error` naming `argument`.
    `gap`: where the op does not do so yet, why; the test then fails, strictly as expected, with `gap_error`
    (`NOT_RAISED`: nothing raised; RuntimeError: torch's own error; AssertionError: another name in the message)."""
    label: str
    argument: str
    change: Callable[[dict], dict]
    error: type = Exception
    gap: str = ""
    gap_error: type = AssertionError


NOT_RAISED = pytest.fail.Exception  # what pytest.raises raises when the call raised nothing


@dataclasses.dataclass(frozen=True)
class OpCase:
    """One public op as the suite sees it (module docstring). `make(seed, shape=CPU)` returns the call's arguments
    by name (CPU tensors, no leaf requiring grad); `call(args, backend="auto")` the public function's result (a tensor
    or a tuple); `replay(args)` diffusers' ops (torch autograd); `golden(args)` the float64 function of float64
    args."""
    name: str
    make: Callable[..., dict]
    call: Callable[..., object]
    replay: Callable[[dict], object]
    golden: Callable[[dict], object]
    differentiable: tuple[str, ...]
    rows: dict = dataclasses.field(default_factory=dict)  # the row arguments: name -> dim of its rows
    out_row_dim: int = -2
    exact_grads: Callable | None = None  # (args, dys) -> {name: gradient} the op's equal bit for bit
    grad_bounds: Callable | None = None  # (args, dys, golden gradients) -> {name: bound on |op - golden|}
    launch_ops: Callable | None = None  # args -> [(label, launch function, example arguments)]
    compiled_ops: tuple[str, ...] = ()  # adaln_lab custom ops the compiled forward / backward graphs call
    bad_inputs: tuple[BadInput, ...] = ()
    asks_the_rule: bool = True  # has backend= ("cupy" raises the rule's refusal)


def _with(**changes) -> Callable[[dict], dict]:
    return lambda args: {**args, **{k: (v(args) if callable(v) else v) for k, v in changes.items()}}


def _meta(name):
    return lambda args: torch.empty_like(args[name], device="meta")


def _norm_weight(g, shape: Shape) -> torch.Tensor:
    return (0.5 + torch.rand(shape.H, generator=g)).to(BF16)


def _x(g, shape: Shape, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(*shape.lead, shape.S, shape.H, generator=g) * scale).to(BF16)


def _projection(g, shape: Shape, columns: int) -> dict:
    """temb (T, D) float32, weight (columns, D) and bias (columns,) bf16: an AdaLN projection."""
    return dict(temb=torch.randn(shape.T, shape.D, generator=g),
                weight=(torch.randn(columns, shape.D, generator=g) * shape.D ** -0.5).to(BF16),
                bias=(torch.randn(columns, generator=g) * 0.1).to(BF16))


def _chunks(g, shape: Shape) -> tuple[torch.Tensor, ...]:
    """The six (R, H) chunks of a block's table (float32 holding bf16 values: diffusers' table upcast), as leaves of
    their own (contiguous copies), in `reference.block.CHUNKS` order."""
    p = _projection(g, shape, 18 * shape.H)
    table = br.replay_table(p["temb"], p["weight"], p["bias"]).float()
    return tuple(chunk.contiguous() for chunk in br.table_chunks(table, shape.H))


def _row_index(g, shape: Shape) -> torch.Tensor:
    return torch.randint(0, shape.R, (shape.S,), generator=g)


def _upcast(args: dict) -> dict:
    """args with every floating tensor in float64 (the replay run in float64 is the golden of an op without one)."""
    return {n: (v.to(F64) if isinstance(v, torch.Tensor) and v.dtype.is_floating_point else v) for n, v in args.items()}


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


# --- final_adaln_out


def _final_make(seed: int, shape: Shape = CPU) -> dict:
    g = generator(seed)
    return dict(x=_x(g, shape), norm_weight=_norm_weight(g, shape), **_projection(g, shape, 2 * shape.H),
                timestep_indices=torch.randint(0, shape.T, (shape.S,), generator=g), eps=EPS)


_FINAL = ("x", "norm_weight", "temb", "weight", "bias", "timestep_indices")


def _final_call(a, backend="auto"):
    return final_adaln_out(*(a[n] for n in _FINAL), a["eps"], backend=backend)


def _final_launch(a):
    x, norm_weight, temb, weight = a["x"], a["norm_weight"], a["temb"], a["weight"]
    H = x.shape[-1]
    workspace = torch.empty(forward_bytes(temb.shape[0], H, x.numel() // H, temb.shape[1]), dtype=torch.uint8,
                            device=x.device)
    forward = (*(a[n] for n in _FINAL), a["eps"], "torch", "cuda", torch.empty_like(x), workspace)
    final_launch.forward(*forward)
    grads = (torch.empty_like(x), torch.empty_like(norm_weight), torch.empty_like(temb), torch.empty_like(weight),
             torch.empty_like(a["bias"]))
    backward = (torch.randn(x.shape, generator=generator(7)).to(x), x, norm_weight, temb, weight,
                a["timestep_indices"], workspace, "torch", *grads)
    return [("forward", final_launch.forward, forward), ("backward", final_launch.backward, backward)]


FINAL_ADALN_OUT = OpCase(
    name="final_adaln_out", make=_final_make, call=_final_call,
    replay=lambda a: final_replay(*(a[n] for n in _FINAL), a["eps"]),
    golden=lambda a: final_golden(*(a[n] for n in _FINAL), a["eps"], flavour="pure"),
    differentiable=("x", "norm_weight", "temb", "weight", "bias"),
    rows={"x": -2, "timestep_indices": 0},
    # "torch" (and "auto" on CPU tensors) is the diffusers replay under torch's autograd
    exact_grads=lambda a, dys: run(lambda b: final_replay(*(b[n] for n in _FINAL), b["eps"]), a, dys,
                                   ("x", "norm_weight", "temb", "weight", "bias"))[1],
    launch_ops=_final_launch,
    bad_inputs=(
        BadInput("dtype", "x", _with(x=lambda a: a["x"].long()), TypeError),
        BadInput("dtype", "timestep_indices", _with(timestep_indices=lambda a: a["timestep_indices"].int()),
                 TypeError),
        BadInput("dtype", "temb", _with(temb=lambda a: a["temb"].half()), TypeError),
        BadInput("shape", "norm_weight", _with(norm_weight=lambda a: a["norm_weight"][:-1]), ValueError),
        BadInput("shape", "bias", _with(bias=lambda a: a["bias"][:-1]), ValueError),
        BadInput("device", "weight", _with(weight=_meta("weight")), ValueError),
        BadInput("option", "backend", lambda a: {**a, "backend": "cuda"}, ValueError),
    ),
)


# --- modulation_table


def _table_make(seed: int, shape: Shape = CPU) -> dict:
    """temb (T + 1, D): one timestep more than the other cases, so that the table has three rows on the CPU."""
    return _projection(generator(seed), dataclasses.replace(shape, T=shape.T + 1), 18 * shape.H)


def _table_bounds(a, dys, golden):
    """float64 sums of products of exact values (d_table float32, SiLU of temb in float64: a few ulps), op and
    golden alike, each rounded once: d_weight and d_bias to bf16, d_temb to float32 (modulation_table_backward)."""
    temb, weight, d_table = a["temb"].to(F64), a["weight"].to(F64), dys[0].to(F64)
    T1, N = d_table.shape
    sig = torch.sigmoid(temb)
    e_weight = 2 * gamma(T1 + 4, F64) * (d_table.abs().T @ F.silu(temb).abs())
    e_bias = 2 * gamma(T1, F64) * d_table.abs().sum(0)
    e_temb = 2 * gamma(N + 10, F64) * (d_table.abs() @ weight.abs()) * sig * (1 + temb.abs() * (1 - sig))
    return {"temb": rounded(golden["temb"], F32, e_temb), "weight": rounded(golden["weight"], BF16, e_weight),
            "bias": rounded(golden["bias"], BF16, e_bias)}


def _table_launch(a):
    temb, weight, bias = a["temb"], a["weight"], a["bias"]
    table = torch.empty(temb.shape[0], weight.shape[0], dtype=F32, device=temb.device)
    d_table = torch.randn(table.shape, generator=generator(7)).to(temb.device)
    grads = (torch.empty_like(temb), torch.empty_like(weight), torch.empty_like(bias))
    return [("forward", table_launch.forward, (temb, weight, bias, "torch", "cuda", table, None, None)),
            ("backward", table_launch.backward, (d_table, temb, weight, "torch", *grads))]


MODULATION_TABLE = OpCase(
    name="modulation_table", make=_table_make,
    call=lambda a, backend="auto": modulation_table(a["temb"], a["weight"], a["bias"], backend=backend),
    replay=lambda a: br.replay_table(a["temb"], a["weight"], a["bias"]).to(br.table_dtype_of(a["weight"])),
    golden=lambda a: br.golden_table(a["temb"], a["weight"], a["bias"]),
    differentiable=("temb", "weight", "bias"), rows={"temb": 0}, out_row_dim=0,
    grad_bounds=_table_bounds, launch_ops=_table_launch,
    compiled_ops=("adaln_lab.modulation_table_fwd", "adaln_lab.modulation_table_bwd"),
    bad_inputs=(
        BadInput("dtype", "temb", _with(temb=lambda a: a["temb"].long()), TypeError),
        BadInput("dtype", "weight", _with(weight=lambda a: a["weight"].long()), TypeError),
        BadInput("shape", "bias", _with(bias=lambda a: a["bias"][:-1]), ValueError),
        BadInput("shape", "weight", _with(weight=lambda a: a["weight"][:, :-1]), ValueError),
        BadInput("device", "weight", _with(weight=_meta("weight")), ValueError),
        BadInput("option", "backend", lambda a: {**a, "backend": "cuda"}, ValueError),
    ),
)


# --- modulated_rms_norm and modulated_rms_norm_and_residual


def _norm_make(seed: int, shape: Shape = CPU) -> dict:
    """norm2's chunks (shift_mlp, scale_mlp) of a real table."""
    g = generator(seed)
    chunks = _chunks(g, shape)
    return dict(x=_x(g, shape), norm_weight=_norm_weight(g, shape), shift=chunks[3], scale=chunks[4],
                row_index=_row_index(g, shape), eps=EPS)


_NORM = ("x", "norm_weight", "shift", "scale", "row_index")


def _norm_call(a, backend="auto"):
    return modulated_rms_norm(*(a[n] for n in _NORM), a["eps"], backend=backend)


def _norm_residual_call(a, backend="auto"):
    return modulated_rms_norm_and_residual(*(a[n] for n in _NORM), a["eps"], backend=backend)


def _norm_replay(a):
    dtype = a["x"].dtype  # table_dtype's default
    return br.replay_modulated_rms_norm(a["x"], a["norm_weight"], a["shift"].to(dtype), a["scale"].to(dtype),
                                        a["row_index"], a["eps"])


def _norm_errors(a, dy):
    """E of the norm's gradients (per element, float64): dx computed per row in float32 (c) as
    rstd * (g - xhat * mean(g * xhat)) with g = dy (1 + scale[i]) norm_weight, xhat = x rstd: rstd carries
    gamma_{H+6} (a length-H sum, eps, sqrt and a division), xhat gamma_{H+7}, g gamma_3, the mean gamma_{2H+11},
    the difference gamma_{3H+20}, so |dx_c - dx| <= gamma_{4H+27}(c) rstd (|g| + |xhat| mean|g xhat|);
    the parameter sums take float32 products dy * xhat (gamma_{H+8}) summed in float64 (op and golden:
    gamma_n(float64) each)."""
    x, dy = _rows_of(a["x"].to(F64)), _rows_of(dy.to(F64))
    idx = a["row_index"].repeat(x.shape[0] // a["row_index"].shape[0])
    c = torch.promote_types(a["x"].dtype, F32)
    n = x.shape[1]
    rstd = rstd_of(x, a["eps"])[:, None]
    xhat = x * rstd
    one_plus = 1 + a["scale"].to(F64)[idx]
    g = dy * one_plus * a["norm_weight"].to(F64)
    e_dx = (gamma(4 * n + 27, c) + 2 * gamma(4 * n + 27, F64)) * rstd * (g.abs() + xhat.abs() * (g * xhat).abs()
                                                                          .mean(-1, keepdim=True))
    rows = x.shape[0]
    per_row = gamma(n + 8, c) + 2 * gamma(rows + 8, F64)

    def table_sum(v):
        return torch.zeros(a["shift"].shape[0], n, dtype=F64, device=v.device).index_add_(0, idx, v)

    e_nw = per_row * (one_plus * dy * xhat).abs().sum(0)
    e_shift = 2 * gamma(rows, F64) * table_sum(dy.abs())
    e_scale = per_row * a["norm_weight"].to(F64).abs() * table_sum((dy * xhat).abs())
    return e_dx.reshape(a["x"].shape), e_nw, e_shift, e_scale


def _norm_bounds(a, dys, golden):
    e_dx, e_nw, e_shift, e_scale = _norm_errors(a, dys[0])
    return {"x": rounded(golden["x"], a["x"].dtype, e_dx),
            "norm_weight": rounded(golden["norm_weight"], a["norm_weight"].dtype, e_nw),
            "shift": rounded(golden["shift"], a["shift"].dtype, e_shift),
            "scale": rounded(golden["scale"], a["scale"].dtype, e_scale)}


def _norm_residual_bounds(a, dys, golden):
    """The norm's, and dx = fl(fl(norm's dx) + d_residual) in x's dtype ("added in x's dtype as autograd adds"):
    two roundings, the norm's dx being golden's dx - dy1 (float64: one rounding more)."""
    bounds = _norm_bounds(a, dys, golden)
    e_dx = _norm_errors(a, dys[0])[0]
    g_norm = golden["x"] - dys[1].to(F64)
    e_dx = e_dx + unit_roundoff(F64) * g_norm.abs()
    bounds["x"] = rounded(golden["x"], a["x"].dtype, rounded(g_norm, a["x"].dtype, e_dx))
    return bounds


def _norm_launch(a, residual=False):
    x, norm_weight, shift, scale, row_index = (a[n] for n in _NORM)
    (R, H), device = shift.shape, x.device
    out, rstd = torch.empty_like(x), torch.empty(x.numel() // H, dtype=F32, device=device)
    forward = (x, norm_weight, shift, scale, row_index, a["eps"], x.dtype, "torch", None, 0, out, rstd)
    norm_launch.forward(*forward)
    dy = torch.randn(x.shape, generator=generator(7)).to(x)
    d_residual = torch.randn(x.shape, generator=generator(8)).to(x) if residual else None
    order = row_order(row_index, R, H) if residual else None
    backward = (dy, x, norm_weight, shift, scale, row_index, rstd, d_residual, order, "torch", torch.empty_like(x),
                torch.empty_like(norm_weight), torch.full((R, 6 * H), float("nan"), device=device), 2 * H, None)
    return [("forward", norm_launch.forward, forward), ("backward", norm_launch.backward, backward)]


def _norm_bad_inputs(op: str) -> tuple[BadInput, ...]:
    return (
        BadInput("dtype", "row_index", _with(row_index=lambda a: a["row_index"].int()), TypeError),
        BadInput("dtype", "x", _with(x=lambda a: a["x"].long()), TypeError),
        BadInput("dtype", "norm_weight", _with(norm_weight=lambda a: a["norm_weight"].long()), TypeError),
        BadInput("shape", "shift", _with(shift=lambda a: a["shift"][:, :-1]), ValueError),
        BadInput("shape", "norm_weight", _with(norm_weight=lambda a: a["norm_weight"][:-1]), ValueError),
        BadInput("shape", "row_index", _with(row_index=lambda a: a["row_index"][:-1]), ValueError),
        BadInput("device", "scale", _with(scale=_meta("scale")), ValueError),
        BadInput("option", "backend", lambda a: {**a, "backend": "cuda"}, ValueError),
    )


MODULATED_RMS_NORM = OpCase(
    name="modulated_rms_norm", make=_norm_make, call=_norm_call, replay=_norm_replay,
    golden=lambda a: br.golden_modulated_rms_norm(*(a[n] for n in _NORM), a["eps"]),
    differentiable=("x", "norm_weight", "shift", "scale"), rows={"x": -2, "row_index": 0},
    grad_bounds=_norm_bounds, launch_ops=_norm_launch,
    compiled_ops=("adaln_lab.modulated_rms_norm_fwd", "adaln_lab.modulated_rms_norm_bwd"),
    bad_inputs=_norm_bad_inputs("modulated_rms_norm"),
)

MODULATED_RMS_NORM_AND_RESIDUAL = OpCase(
    name="modulated_rms_norm_and_residual", make=_norm_make, call=_norm_residual_call,
    replay=lambda a: (_norm_replay(a), a["x"]),
    golden=lambda a: (_norm_replay(_upcast(a)), a["x"].to(F64)),
    differentiable=("x", "norm_weight", "shift", "scale"), rows={"x": -2, "row_index": 0},
    # "Same values and gradients, bit for bit, as modulated_rms_norm with the caller then using x"
    exact_grads=lambda a, dys: run(lambda b: (_norm_call(b), b["x"]), a, dys,
                                   ("x", "norm_weight", "shift", "scale"))[1],
    grad_bounds=_norm_residual_bounds, launch_ops=lambda a: _norm_launch(a, residual=True),
    compiled_ops=("adaln_lab.modulated_rms_norm_fwd", "adaln_lab.modulated_rms_norm_bwd"),
    bad_inputs=_norm_bad_inputs("modulated_rms_norm_and_residual") + (
        BadInput("shape", "row_order", lambda a: {**a, "row_order": torch.zeros(3, dtype=torch.int32)},
                 ValueError),),
)


# --- gated_residual


def _residual_make(seed: int, shape: Shape = CPU) -> dict:
    """The last residual's chunk (gate_mlp) of a real table."""
    g = generator(seed)
    chunks = _chunks(g, shape)
    return dict(x=_x(g, shape), gate=chunks[5], y=_x(g, shape, 1.0), row_index=_row_index(g, shape))


def _residual_call(a, backend="auto"):
    return gated_residual(a["x"], a["gate"], a["y"], a["row_index"], backend=backend)


def _residual_bounds(a, dys, golden):
    """dx = dout (exact); d_y = dout * gate[i], a product of two bf16 values, exact in float32, rounded once to y's
    dtype; d_gate a float64 sum of exact products (op and golden: gamma_n(float64) each), rounded once to float32."""
    dout, y = _rows_of(dys[0].to(F64)), _rows_of(a["y"].to(F64))
    idx = a["row_index"].repeat(dout.shape[0] // a["row_index"].shape[0])
    e_gate = 2 * gamma(dout.shape[0], F64) * torch.zeros(a["gate"].shape, dtype=F64, device=y.device).index_add_(
        0, idx, (dout * y).abs())
    return {"x": rounded(golden["x"], a["x"].dtype, 0.0), "y": rounded(golden["y"], a["y"].dtype, 0.0),
            "gate": rounded(golden["gate"], a["gate"].dtype, e_gate)}


def _residual_launch(a):
    x, gate, y, row_index = a["x"], a["gate"], a["y"], a["row_index"]
    R, H = gate.shape
    dout = torch.randn(x.shape, generator=generator(7)).to(x)
    d_table = torch.full((R, 6 * H), float("nan"), device=x.device)
    return [("forward", residual_launch.forward, (x, gate, y, row_index, x.dtype, "torch", torch.empty_like(x))),
            ("backward", residual_launch.backward, (dout, gate, y, row_index, row_order(row_index, R, H), x.dtype,
                                                    "torch", torch.empty_like(y), d_table, 5 * H, None))]


GATED_RESIDUAL = OpCase(
    name="gated_residual", make=_residual_make, call=_residual_call,
    replay=lambda a: br.replay_gated_residual(a["x"], a["gate"].to(a["x"].dtype), a["y"], a["row_index"]),
    golden=lambda a: br.golden_gated_residual(a["x"], a["gate"], a["y"], a["row_index"]),
    differentiable=("x", "gate", "y"), rows={"x": -2, "y": -2, "row_index": 0},
    grad_bounds=_residual_bounds, launch_ops=_residual_launch,
    compiled_ops=("adaln_lab.gated_residual_fwd", "adaln_lab.gated_residual_bwd"),
    bad_inputs=(
        BadInput("dtype", "y", _with(y=lambda a: a["y"].long()), TypeError),
        BadInput("dtype", "gate", _with(gate=lambda a: a["gate"].long()), TypeError),
        BadInput("dtype", "row_index", _with(row_index=lambda a: a["row_index"].int()), TypeError),
        BadInput("shape", "y", _with(y=lambda a: a["y"][..., :-1, :]), ValueError),
        BadInput("shape", "gate", _with(gate=lambda a: a["gate"][:, :-1]), ValueError),
        BadInput("device", "gate", _with(gate=_meta("gate")), ValueError),
        BadInput("option", "backend", lambda a: {**a, "backend": "cuda"}, ValueError),
    ),
)


# --- gated_residual_norm


def _pair_make(seed: int, shape: Shape = CPU) -> dict:
    """The first residual's gate (gate_msa) and norm2's chunks (shift_mlp, scale_mlp) of a real table."""
    g = generator(seed)
    chunks = _chunks(g, shape)
    return dict(x=_x(g, shape), gate=chunks[2], y=_x(g, shape, 1.0), norm_weight=_norm_weight(g, shape),
                shift=chunks[3], scale=chunks[4], row_index=_row_index(g, shape), eps=EPS)


_PAIR = ("x", "gate", "y", "norm_weight", "shift", "scale", "row_index")
_PAIR_LEAVES = ("x", "gate", "y", "norm_weight", "shift", "scale")


def _pair_call(a, backend="auto"):
    return gated_residual_norm(*(a[n] for n in _PAIR), a["eps"], backend=backend)


def _pair_replay(a):
    dtype = a["x"].dtype
    x_out = br.replay_gated_residual(a["x"], a["gate"].to(dtype), a["y"], a["row_index"])
    return x_out, br.replay_modulated_rms_norm(x_out, a["norm_weight"], a["shift"].to(dtype), a["scale"].to(dtype),
                                               a["row_index"], a["eps"])


def _pair_separate(a):
    """The two public ops one after the other: x_out's two gradients added by autograd."""
    x_out = gated_residual(a["x"], a["gate"], a["y"], a["row_index"])
    return x_out, modulated_rms_norm(x_out, a["norm_weight"], a["shift"], a["scale"], a["row_index"], a["eps"])


def _pair_launch(a):
    x, gate, y, norm_weight, shift, scale, row_index = (a[n] for n in _PAIR)
    (R, H), device = shift.shape, x.device
    x_out, out, rstd = torch.empty_like(x), torch.empty_like(x), torch.empty(x.numel() // H, dtype=F32, device=device)
    forward = (x, gate, y, row_index, norm_weight, shift, scale, a["eps"], x.dtype, "torch+torch", None, x_out, out,
               rstd)
    pair_launch.forward(*forward)
    g = generator(7)
    d_x_out, d_out = (torch.randn(x.shape, generator=g).to(x) for _ in range(2))
    backward = (d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, None, x.dtype,
                "torch+torch", torch.empty_like(x), torch.empty_like(y), torch.empty_like(norm_weight),
                torch.full((R, 6 * H), float("nan"), device=device), 2 * H, None)
    return [("forward", pair_launch.forward, forward), ("backward", pair_launch.backward, backward)]


GATED_RESIDUAL_NORM = OpCase(
    name="gated_residual_norm", make=_pair_make, call=_pair_call, replay=_pair_replay,
    golden=lambda a: _pair_replay(_upcast(a)),
    differentiable=_PAIR_LEAVES, rows={"x": -2, "y": -2, "row_index": 0},
    # "Every output and gradient has the bits of the two ops run one after the other"
    exact_grads=lambda a, dys: run(_pair_separate, a, dys, _PAIR_LEAVES)[1],
    launch_ops=_pair_launch,
    compiled_ops=("adaln_lab.gated_residual_norm_fwd", "adaln_lab.gated_residual_norm_bwd"),
    bad_inputs=(
        BadInput("dtype", "y", _with(y=lambda a: a["y"].long()), TypeError),
        BadInput("dtype", "shift", _with(shift=lambda a: a["shift"].long()), TypeError),
        BadInput("shape", "norm_weight", _with(norm_weight=lambda a: a["norm_weight"][:-1]), ValueError),
        BadInput("shape", "scale", _with(scale=lambda a: a["scale"][:-1]), ValueError),
        BadInput("shape", "row_order", lambda a: {**a, "row_order": torch.zeros(3, dtype=torch.int32)}, ValueError),
        BadInput("device", "shift", _with(shift=_meta("shift")), ValueError),
        BadInput("option", "backend", lambda a: {**a, "backend": "cuda"}, ValueError),
    ),
)


# --- block_adaln_path


def _block_make(seed: int, shape: Shape = CPU) -> dict:
    g = generator(seed)
    return dict(x=_x(g, shape), **_projection(g, shape, 18 * shape.H), norm1_weight=_norm_weight(g, shape),
                norm2_weight=_norm_weight(g, shape), row_index=_row_index(g, shape), attn=rowwise_attn,
                ff=rowwise_ff, eps1=1e-5, eps2=1e-6)


_BLOCK = ("x", "temb", "weight", "bias", "norm1_weight", "norm2_weight", "row_index", "attn", "ff", "eps1", "eps2")
_BLOCK_LEAVES = ("x", "temb", "weight", "bias", "norm1_weight", "norm2_weight")


def _block_call(a, backend="auto"):
    return block_adaln_path(*(a[n] for n in _BLOCK), backend=backend)


def _block_separate(a):
    """The block from the public ops (norm1 with x handed on, the fused first residual and norm2, the last
    residual), the six chunks' gradients gathered into the table's by autograd (float32, disjoint columns)."""
    table = modulation_table(a["temb"], a["weight"], a["bias"])
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = br.table_chunks(table, a["x"].shape[-1])
    kw = dict(table_dtype=a["weight"].dtype)
    h, x = modulated_rms_norm_and_residual(a["x"], a["norm1_weight"], shift_msa, scale_msa, a["row_index"],
                                           a["eps1"], **kw)
    x, h = gated_residual_norm(x, gate_msa, a["attn"](h), a["norm2_weight"], shift_mlp, scale_mlp, a["row_index"],
                               a["eps2"], **kw)
    return gated_residual(x, gate_mlp, a["ff"](h), a["row_index"], **kw)


BLOCK_ADALN_PATH = OpCase(
    name="block_adaln_path", make=_block_make, call=_block_call,
    replay=lambda a: br.replay_block_adaln(*(a[n] for n in _BLOCK)),
    golden=lambda a: br.golden_block_adaln(*(a[n] for n in _BLOCK)),
    differentiable=_BLOCK_LEAVES, rows={"x": -2, "row_index": 0},
    # "Numerics: the ops'": the gradients of the public ops composed (each op's own contract checked above)
    exact_grads=lambda a, dys: run(_block_separate, a, dys, _BLOCK_LEAVES)[1],
    compiled_ops=("adaln_lab.modulation_table_fwd", "adaln_lab.modulated_rms_norm_fwd",
                  "adaln_lab.gated_residual_norm_fwd", "adaln_lab.gated_residual_fwd",
                  "adaln_lab.gated_residual_bwd", "adaln_lab.gated_residual_norm_bwd",
                  "adaln_lab.modulated_rms_norm_bwd", "adaln_lab.modulation_table_bwd"),
    bad_inputs=(
        BadInput("dtype", "temb", _with(temb=lambda a: a["temb"].long()), TypeError),
        BadInput("dtype", "row_index", _with(row_index=lambda a: a["row_index"].int()), TypeError),
        BadInput("dtype", "norm1_weight", _with(norm1_weight=lambda a: a["norm1_weight"].long()), TypeError),
        BadInput("shape", "weight", _with(weight=lambda a: a["weight"][:-1]), ValueError),
        BadInput("shape", "bias", _with(bias=lambda a: a["bias"][:-1]), ValueError),
        BadInput("shape", "norm2_weight", _with(norm2_weight=lambda a: a["norm2_weight"][:-1]), ValueError),
        BadInput("device", "temb", _with(temb=_meta("temb")), ValueError),
        BadInput("option", "backend", lambda a: {**a, "backend": "cuda"}, ValueError),
    ),
)


# --- row_order (no backend, no gradient: the properties that apply)


def _order_make(seed: int, shape: Shape = CPU) -> dict:
    g = generator(seed)
    return dict(row_index=torch.randint(0, shape.R, (3 * shape.S,), generator=g), table_rows=shape.R, H=shape.H)


def _order_launch(a):
    order = torch.empty(a["table_rows"] + 1 + a["row_index"].shape[0], dtype=torch.int32,
                        device=a["row_index"].device)
    return [("launch", row_order_op.launch, (a["row_index"], a["table_rows"], a["H"], order))]


ROW_ORDER = OpCase(
    name="row_order", make=_order_make,
    call=lambda a, backend="auto": row_order(a["row_index"], a["table_rows"], a["H"]),
    replay=lambda a: row_order_op.order_torch(a["row_index"], a["table_rows"]),
    golden=lambda a: row_order_op.order_torch(a["row_index"], a["table_rows"]),
    differentiable=(), launch_ops=_order_launch, compiled_ops=("adaln_lab.row_order",), asks_the_rule=False,
    bad_inputs=(
        BadInput("dtype", "row_index", _with(row_index=lambda a: a["row_index"].int()), ValueError),
        BadInput("shape", "row_index", _with(row_index=lambda a: a["row_index"][None]), ValueError),
        BadInput("value", "table_rows", _with(table_rows=0), ValueError),
    ),
)


CASES = {case.name: case for case in (FINAL_ADALN_OUT, MODULATION_TABLE, MODULATED_RMS_NORM,
                                      MODULATED_RMS_NORM_AND_RESIDUAL, GATED_RESIDUAL, GATED_RESIDUAL_NORM,
                                      BLOCK_ADALN_PATH, ROW_ORDER)}


def cases(where: Callable[[OpCase], bool] = lambda case: True) -> list:
    """pytest params of the cases `where` holds for, each with its name as id."""
    return [pytest.param(case, id=case.name) for case in CASES.values() if where(case)]


def bad_input_params() -> list:
    """pytest params (case, BadInput) of every case's bad inputs; a known gap is a strict xfail naming it."""
    params = []
    for case in CASES.values():
        for bad in case.bad_inputs:
            marks = [pytest.mark.xfail(strict=True, reason=bad.gap, raises=bad.gap_error)] if bad.gap else []
            params.append(pytest.param(case, bad, id=f"{case.name}-{bad.label}-{bad.argument}", marks=marks))
    return params


def call_with(case: OpCase, args: dict):
    """case.call on args, with a `backend` or `row_order` key of args passed on as the keyword."""
    args = dict(args)
    backend = args.pop("backend", "auto")
    order = args.pop("row_order", None)
    if order is None:
        return case.call(args, backend)
    fn = {"modulated_rms_norm_and_residual": modulated_rms_norm_and_residual,
          "gated_residual_norm": gated_residual_norm}[case.name]
    names = _NORM if case.name == "modulated_rms_norm_and_residual" else _PAIR
    return fn(*(args[n] for n in names), args["eps"], row_order=order, backend=backend)


def assert_eager_bits_under_compiled_autograd_and_checkpointing(fn, leaves, row_index, upstream, grads) -> None:
    """fn(*leaves, row_index) under torch.utils.checkpoint (the forward run again in the backward, reentrant or not)
    and under compiled autograd (its backward traced, the launch ops opaque nodes) gives eager's bits, output and
    gradients. grads(fn, leaves, row_index, upstream) -> (output, the leaves' gradients), the eager run."""
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
    from torch._dynamo.utils import counters
    from torch.utils.checkpoint import checkpoint

    want_out, want = grads(fn, leaves, row_index, upstream)
    runs = [grads(lambda *a, r=r: checkpoint(fn, *a, use_reentrant=r), leaves, row_index, upstream)
            for r in (False, True)]
    traced_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    out = fn(*traced_leaves, row_index)
    captures = counters["compiled_autograd"]["captures"]
    with compiled_autograd._enable(torch.compile(backend="eager")):
        out.backward(upstream.to(out.dtype))
    assert counters["compiled_autograd"]["captures"] == captures + 1  # the backward was traced
    runs.append((out.detach(), [t.grad for t in traced_leaves]))
    for got_out, got in runs:
        assert torch.equal(got_out, want_out)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
