"""Shared by tests/numba/test_backward.py and tests/numba/test_op.py: the twin backward's cases, its per-element
error bounds against the float64 golden and the analytic CPU backward, and the comparison helpers.

The bounds (all per element, float64, `error_bounds` below). u = 2^-24, u64 = 2^-53; for row r
with timestep t: rstd r, a = dy * norm_weight, s1 = 1 + scale[t], P = sum_h |a s1 x|.
- Inputs: the twin gets fp32 rstd and table_f32. Their errors are measured, not assumed: rho =
  max |rstd / rstd_exact - 1| and sigma[t, h] = |table_f32 - table_exact| (the scale half); against
  the golden they enter linearly (dx is linear in s1 and cubic in rstd: 3 rho).
- Arithmetic of the twin: the row's dot product has at most 8 * bwd_vpt sequential fmas per thread
  plus two 5-step butterflies (dot_depth); dx = rstd * fma(-xhat, mean, g) adds 8 roundings at most:
      E_dx = (3 rho + (dot_depth + 8) u)(T1 + T2) + r |a| sigma + r^3 |x| sum_h(|a x| sigma) / H,
      T1 = |r a s1|, T2 = r^3 |x| P / H.
  A[t, h] = sum dy xhat, B[t, h] = sum dy over the rows of t: (rows_per_range + 1) u for the fp32
  sums inside a row range (rows_per_range u for B), then double sums (u64 per addend); d_table is
  stored fp32 (+ u). d_norm_weight = sum_t s1 A, d_bias = sum_t d_table (double, then fp32: + u).
  d_weight = sum_t d_table * silu(temb) in fp32 fmas (T u) with SiLU within 6 u (expf 2 ulps,
  the add, the division). d_temb = silu'(temb) sum_j d_table W: fp32 fmas down a warp's rows plus
  the warp combine (tb_depth u), then double.
- Every double operation and the golden's own float64 evaluation: c64 u64 per addend, c64 = rows +
  2H + D + 64. A factor 1.05 covers the second-order terms (all first-order terms are below 1e-3).
- Outputs stored in bf16 round once more: |bf16(v) - v| <= 2^-8 |v|, so the bound against the
  golden is E + 2^-8 (|golden| + E).
- Against the analytic CPU backward (the body of `adaln_lab.ops.final_adaln_out.launch.backward` on CPU
  tensors, `adaln_lab.reference.backward` in torch ops: `launch_backward` below) both get the same rstd and
  table_f32 (rho = sigma = 0); each is within E of the exact function of those inputs, E taken with the larger
  of the two implementations' depths (torch's mean over H: H), so |twin - ref| <= 2 E + 2^-8 (|twin| + |ref|)
  * 1.01 (the two bf16 roundings).
"""

import dataclasses

import torch
import torch.nn.functional as F

from adaln_lab.core.plan import forward_workspace, plan as make_plan
from adaln_lab.harness.accuracy import golden_result
from adaln_lab.harness.inputs import make, upstream
from adaln_lab.ops.final_adaln_out import launch
from adaln_lab.ops.final_adaln_out.twin import backward as numba_backward, backward_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
U, U64, HALF_BF16 = 2.0 ** -24, 2.0 ** -53, 2.0 ** -8
NAMES = ("dx", "d_norm_weight", "d_temb", "d_weight", "d_bias")  # backward's order = LEAVES order


def simulating() -> bool:
    backward_kernels._nc()
    from numba import config

    return bool(config.ENABLE_CUDASIM)


# ---------------------------------------------------------------- inputs and the twin's result

@dataclasses.dataclass
class Case:
    inputs: object
    dy: torch.Tensor
    rstd: torch.Tensor       # (rows,) fp32, as the forward saves it
    table_f32: torch.Tensor  # (T, 2H) fp32, the forward's table before its bf16 rounding
    grads: tuple             # the twin's (dx, d_norm_weight, d_temb, d_weight, d_bias)

    def args(self, **replace):
        i = self.inputs
        a = dict(dy=self.dy, x=i.x, rstd=self.rstd, norm_weight=i.norm_weight, table_f32=self.table_f32,
                 timestep_indices=i.timestep_indices, temb=i.temb, weight=i.weight)
        a.update(replace)
        return a


def saved_tensors(inputs):
    """rstd and table_f32 as the forward saves them, up to the forward's own fp32 rounding (the
    backward takes them as given; their distance to the exact values is measured by the bounds)."""
    rstd = torch.rsqrt(inputs.x.float().pow(2).mean(-1) + EPS)
    act = F.silu(inputs.temb).to(torch.bfloat16).double()  # the forward's GEMV takes bf16(silu(temb))
    table_f32 = (act @ inputs.weight.double().T + inputs.bias.double()).float()
    return rstd, table_f32


def launch_backward(dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd, route="cupy"):
    """(dx, d_norm_weight, d_temb, d_weight, d_bias) of `final_adaln_out.launch.backward` from the given table_f32
    and rstd, written into a forward workspace (as the forward leaves them there), the gradients allocated as the
    op's Function allocates them: on CPU tensors the analytic backward, on CUDA tensors route "cupy"'s kernels."""
    (T, D), H = temb.shape, x.shape[-1]
    rows = x.numel() // H
    workspace = torch.zeros(forward_workspace(T, H, rows, D)[1], dtype=torch.uint8, device=x.device)
    _, saved_f32, saved_rstd = launch.saved_views(workspace, T, H, rows, D)
    saved_f32.copy_(table_f32), saved_rstd.copy_(rstd)
    grads = (torch.empty_like(x), torch.empty_like(norm_weight), torch.empty_like(temb), torch.empty_like(weight),
             weight.new_empty(weight.shape[:1]))
    launch.backward(dy, x, norm_weight, temb, weight, timestep_indices, workspace, route, *grads)
    return grads


def make_case(seed: int, timesteps, **shape) -> Case:
    inputs = make(seed, len(timesteps), DEVICE, **shape)
    inputs = dataclasses.replace(inputs, timestep_indices=torch.tensor(timesteps, device=DEVICE))
    dy = upstream(seed, inputs.x)
    rstd, table_f32 = saved_tensors(inputs)
    case = Case(inputs, dy, rstd, table_f32, ())
    case.grads = numba_backward.backward(**case.args())
    return case


@dataclasses.dataclass(frozen=True)
class Depths:
    """Sequential fp32 roundings of one implementation's sums (see the module docstring)."""

    dot: int          # a row's dot product
    range_rows: int   # rows summed in fp32 inside one row range
    nblocks: int      # addends of the double sums over row ranges
    groups: int
    tb: int           # d_temb's fp32 sum over weight rows (a warp's rows, then the warps)
    blocks_j: int
    act: int          # SiLU's fp32 error in u

    @staticmethod
    def twin(plan, rows: int) -> "Depths":
        geometry = plan.rows(rows)
        warps = plan.tb_threads // 32
        tb_rows = plan.tb_rows
        return Depths(dot=8 * plan.bwd_vpt + 10, range_rows=geometry.bwd_rows_per_range,
                      nblocks=max(geometry.bwd_ranges, 1), groups=plan.sum_groups, tb=tb_rows // warps + warps,
                      blocks_j=plan.blocks_j, act=6)

    @staticmethod
    def analytic_cpu(plan, rows: int) -> "Depths":  # the custom op's CPU kernel: fp32 rows, float64 sums
        return Depths(dot=plan.H, range_rows=1, nblocks=rows, groups=0, tb=0, blocks_j=0, act=0)

    def max(self, other: "Depths") -> "Depths":
        return Depths(*(max(a, b) for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def exact_saved(inputs):
    """rstd and the table in float64 from the inputs, no rounding anywhere (the pure golden's)."""
    x = inputs.x.double()
    rstd = torch.rsqrt(x.pow(2).mean(-1) + EPS)
    table = F.silu(inputs.temb.double()) @ inputs.weight.double().T + inputs.bias.double()
    return rstd, table


def error_bounds(inputs, dy, rstd, table, rho: float, sigma, depths: Depths) -> dict:
    """Per-element bounds E on |computed - exact| before the outputs' bf16 rounding (module docstring).

    rstd (rows,), table (T, 2H): the values the magnitudes are taken at; sigma (T, H): the absolute
    error of the scale half of the table the implementation got; rho: rstd's relative error.
    """
    f64 = lambda t: t.detach().double().cpu()  # noqa: E731
    x, dy, nw, temb, weight = f64(inputs.x), f64(dy), f64(inputs.norm_weight), f64(inputs.temb), f64(inputs.weight)
    rstd, table, sigma = f64(rstd), f64(table), f64(sigma)
    R, H = x.shape
    T, D = temb.shape
    c64 = (R + 2 * H + D + 64) * U64
    ts = inputs.timestep_indices.cpu()[torch.arange(R) % inputs.timestep_indices.numel()]
    r = rstd[:, None]
    s1 = 1.0 + table[:, H:]
    a = dy * nw
    S1, SIG = s1[ts], sigma[ts]
    t1 = (r * a * S1).abs()
    t2 = (r ** 3 * x).abs() * (a * S1 * x).abs().sum(-1, keepdim=True) / H
    e_dx = ((3 * rho + (depths.dot + 8) * U + c64) * (t1 + t2) + r * a.abs() * SIG
            + (r ** 3 * x).abs() * ((a * x).abs() * SIG).sum(-1, keepdim=True) / H)

    onehot = F.one_hot(ts, T).double()
    a_abs = onehot.T @ (dy * x * r).abs()  # (T, H)
    b_abs = onehot.T @ dy.abs()
    double_sums = (depths.nblocks + depths.groups + 2) * U64 + c64
    d_a = (rho + (depths.range_rows + 1) * U + double_sums) * a_abs
    d_b = (depths.range_rows * U + double_sums) * b_abs
    e_table = torch.cat([d_b + U * b_abs, nw.abs() * d_a + U * nw.abs() * a_abs], dim=-1)  # d_table, fp32
    table_abs = torch.cat([b_abs, nw.abs() * a_abs], dim=-1)
    s1_abs = s1.abs() + sigma
    e_nw = (sigma * a_abs + s1_abs * d_a + ((T + 2) * U64 + c64 + U) * s1_abs * a_abs).sum(0)
    e_bias = e_table.sum(0) + ((T + 2) * U64 + c64 + U) * table_abs.sum(0)

    act_abs = F.silu(temb).abs()
    e_weight = e_table.T @ act_abs + ((depths.act + T) * U + c64) * (table_abs.T @ act_abs)
    sig = torch.sigmoid(temb)
    dsilu, dsilu_abs = sig * (1 + temb * (1 - sig)), sig * (1 + temb.abs() * (1 - sig))
    m = table_abs @ weight.abs()
    e_temb = (dsilu.abs() * (e_table @ weight.abs() + (depths.tb + 1) * U * m)
              + dsilu_abs * ((depths.blocks_j + depths.groups + 20) * U64 + c64) * m)
    return {name: 1.05 * e for name, e in zip(NAMES, (e_dx, e_nw, e_temb, e_weight, e_bias))}


def tolerance_against_exact(e, exact, stored_bf16: bool):
    """E, plus the output's own bf16 rounding when it is stored in bf16."""
    exact = exact.detach().double().cpu()
    return e + HALF_BF16 * (exact.abs() + e) if stored_bf16 else e


def assert_within(name: str, value, ref, tol) -> float:
    """Raise AssertionError unless |value - ref| <= tol everywhere (NaN anywhere fails); the worst
    ratio |value - ref| / tol otherwise."""
    v, r, tol = (t.detach().double().cpu() for t in (value, ref, tol))
    assert v.shape == r.shape == tol.shape, (name, v.shape, r.shape, tol.shape)
    err = (v - r).abs()
    bad = ~(err <= tol)
    if bool(bad.any()):
        ratio = torch.where(bad & err.isnan(), torch.full_like(err, float("inf")), err / tol)
        worst = int(torch.nan_to_num(ratio, nan=float("inf")).flatten().argmax())
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), v.shape))
        raise AssertionError(f"{name}: {int(bad.sum())} of {v.numel()} elements outside the bound; worst at {at}: "
                             f"value {v[at].item():.9g}, ref {r[at].item():.9g}, |err| {err[at].item():.3g}, "
                             f"bound {tol[at].item():.3g}")
    return float((err / tol.clamp_min(1e-300)).max()) if v.numel() else 0.0


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (a NaN equals a NaN whatever its payload; -0.0 differs from +0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    both_nan = a.isnan() & b.isnan()
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(((a.view(view) == b.view(view)) | both_nan).all())


def golden_tolerances(case) -> tuple[dict, dict]:
    """(golden gradients, per-element tolerances) of the twin against the float64 golden."""
    _, golden = golden_result(case.inputs, case.dy, flavour="pure")
    rstd_exact, table_exact = exact_saved(case.inputs)
    H = case.inputs.x.shape[-1]
    rho = float((case.rstd.double() / rstd_exact - 1).abs().max())
    sigma = (case.table_f32.double() - table_exact)[:, H:].abs()
    plan = make_plan(H, case.inputs.temb.shape[1], case.inputs.temb.shape[0])
    e = error_bounds(case.inputs, case.dy, rstd_exact, table_exact, rho, sigma,
                     Depths.twin(plan, case.inputs.x.shape[0]))
    golden = dict(zip(NAMES, (golden[k] for k in ("x", "norm_weight", "temb", "weight", "bias"))))
    tol = {n: tolerance_against_exact(e[n], golden[n], stored_bf16=(n != "d_temb")) for n in NAMES}
    return golden, tol
