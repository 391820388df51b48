"""What the shipped exact sums (kernels_cu/exact_sums.cu, exact_row_pass.cu) cost beside norm_out's fwd+bwd."""

# Issue 40, the kernels' route (NOTES v39). At MiniMax-H3's width (H 5376, D 2688, T 3) and each row count: the
# states of `kernel_sums` (exact_sums' every form, and the row pass's) and the row pass's dx checked first against
# ExactSum.add of the same float32 terms formed by torch (limb for limb) and the plain backward's dx,
# then CUDA-graph replays between CUDA events (GPU time, medians) of
#   fwd_bwd     the launch ops' forward and backward (what norm_out's graph fwd+bwd runs)
#   exact_sums  zeroing the states, the rows' sort by timestep and exact_sums_bf16 (the states alone in a pass of
#               their own: `kernel_sums` without dx), shipped
#   exact_sums_cache<k>  the same with TUNING's EXACT_CACHE = k for the other forms (0: every add in shared memory,
#               1: a register cache of the last limb pair, 2: the caches alone, sent out by integer atomics), each
#               checked the same way
#   carry       the states' carries (exact_state.cu's exact_carry, one launch a state)
#   exact_route the exact route's kernels as ExactNormOut runs them on a bf16 norm weight: the forward, then
#               `kernel_sums` with dx (the backward's row pass with its sums exact, exact_row_pass.cu's
#               norm_modulate_bwd_exact_bf16, its fixups, the norm weight's copy; the carries and factors wait for
#               `NormOutSums.ready` after the backward, as the recorder's fold runs them: not in these figures)
#   exact_route_cast  the same without the norm weight's copy (weight_copy False: a cast made for the call, as
#               under autocast with float32 masters)
#   exact_route[KNOB=V]  the same with TUNING's KNOB = V for each --forms setting other than the shipped one
#               (EXACT_ROW_DOUBLE 0: int64 windows, 1: float64 windows checked at their close, exact_row_windows.cu,
#               and its fixup kernel; EXACT_CLOSE_STAGED: those windows sent out through the pass's stages;
#               EXACT_SORTED_MIN_T 1: the pass over the rows in table-row order, row_order.cu first), each checked the
#               same way first; `fixups` counts the entries each setting's pass appended
#   exact_route_no_close_atomics  with --no-close-atomics, the shipped route with its windows' atomics left out of
#               the unit's text (a timing only: wrong sums, never checked): what the closes' atomics cost
# and exact_route / fwd_bwd, the ratio (bar 1.10x at 32768 rows, 1.15x at 4097). The recorder's host work
# (one state per temb row, read on the CPU at write) is not in these figures. Floor: exact_sums' bytes (x and dy
# read) at the run's copy bandwidth.
#
#     python3 bench/tools/exact_kernel_cost.py [--rows 4097,32768] [--forms EXACT_ROW_DOUBLE=0,...]
#                                               [--no-close-atomics] [--out FILE.json]

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import re

import torch

from adaln_lab.bench.timing import graph_us
from adaln_lab.core import launchers, loader, plan as plan_module, tensors
from adaln_lab.core.exact import LIMBS, ExactSum
from adaln_lab.core.exact_kernels import ExactKernels
from adaln_lab.core.plan import forward_bytes
from adaln_lab.harness.latency import copy_bandwidth
from adaln_lab.ops.final_adaln_out import launch
from adaln_lab.ops.final_adaln_out.exact import kernel_sums
from adaln_lab.ops.row_sums import exact_row_order, launch_sums

H, D, T = 5376, 2688, 3


KNOBS = (0, 1, 2)  # TUNING's EXACT_CACHE forms


def cache_knob(value: int) -> None:
    """TUNING's EXACT_CACHE set to value, every plan and compiled kernel forgotten."""
    plan_module.TUNING["EXACT_CACHE"] = value
    launchers.forget_compiled()


CLOSE_ATOMIC = "if (piece[j]) atomicAdd("  # exact_row_windows.cu's double_limbs: a window's pieces sent out
OPAQUE = ('__device__ __forceinline__ unsigned long long opaque_piece(unsigned long long v) {\n'
          '    asm volatile("" : "+l"(v));\n    return v;\n}\n')


@contextlib.contextmanager
def no_close_atomics():
    """The unit's text with double_limbs' atomics never taken, each piece still formed (passed through an empty asm
    the compiler cannot see into: else it drops the pieces it can prove below 2^32, and their arithmetic with them):
    wrong sums, a timing only; every compiled kernel forgotten on entry and on exit."""
    shipped = loader.source

    def source(plan):
        text = shipped(plan)
        if CLOSE_ATOMIC not in text:
            raise AssertionError(f"exact_row_windows.cu no longer sends its pieces as `{CLOSE_ATOMIC}...`")
        marker = "#line 1 \"kernels_cu/"  # the unit's first file: the opaque helper goes before it
        at = text.index(marker)
        return (text[:at] + OPAQUE + text[at:]).replace(CLOSE_ATOMIC, "if (opaque_piece(piece[j]) == 0x1ffffffffull) "
                                                                      "atomicAdd(")  # a 32-bit piece: never

    loader.source = source
    launchers.forget_compiled()
    try:
        yield
    finally:
        loader.source = shipped
        launchers.forget_compiled()


def form_name(setting: tuple) -> str:
    return f"exact_route[{setting[0]}={setting[1]}]"


def route_forms(dy, x, nw, idx, workspace, rows: int, want, dx_want, forms) -> dict:
    """{form name: fixup entries} of the --forms settings (the shipped route is checked by `measure`), each route's dx
    and integers checked first; the shipped values restored."""
    counts = {}
    for name, value in forms:
        with launchers.tuned(**{name: value}):
            dx = torch.empty_like(x)
            got = kernel_sums(dy, x, nw, idx, workspace, T, D, dx=dx)
            got.check()
            got.ready()
            if not (torch.equal(dx, dx_want) and torch.equal(got.table.limbs, want.limbs)):
                raise AssertionError(f"the row pass with {name} {value} at {rows} rows: dx or the integers differ")
            counts[form_name((name, value))] = int(got.entries)
    return counts


def measure(rows: int, copy_TBps: float, forms=(), without_atomics: bool = False) -> dict:
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(1, rows, H, device="cuda", generator=g).bfloat16()
    dy = (torch.randn(1, rows, H, device="cuda", generator=g) * 1e-3).bfloat16()
    nw = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()
    temb = torch.randn(T, D, device="cuda", generator=g)
    weight = (0.02 * torch.randn(2 * H, D, device="cuda", generator=g)).bfloat16()
    bias = (0.02 * torch.randn(2 * H, device="cuda", generator=g)).bfloat16()
    idx = torch.randint(0, T, (rows,), device="cuda", generator=g)
    out, workspace = torch.empty_like(x), x.new_empty(forward_bytes(T, H, rows, D), dtype=torch.uint8)
    grads = (torch.empty_like(x), torch.empty_like(nw), torch.empty_like(temb), torch.empty_like(weight),
             torch.empty_like(bias))
    launch.forward(x, nw, temb, weight, bias, idx, 1e-5, "cupy", "cuda", out, workspace)
    _, table_f32, rstd = launch.saved_views(workspace, T, H, rows, D)
    p = dy[0].float() * (x[0].float() * rstd[:, None])
    want_table = ExactSum((T, 2 * H), x.device).add(torch.cat([dy[0].float(), p], dim=1), idx)
    shipped = plan_module.TUNING["EXACT_CACHE"]
    others = [knob for knob in KNOBS if knob != shipped]
    for knob in (*others, shipped):  # the shipped kernel last: the steps below launch it
        cache_knob(knob)
        got = kernel_sums(dy, x, nw, idx, workspace, T, D)
        got.check()
        got.ready()
        if not torch.equal(got.table.limbs, want_table.limbs):
            raise AssertionError(f"exact_sums (EXACT_CACHE {knob}) at {rows} rows: the states differ from the exact "
                                 "sums of their terms")
    launch.backward(dy, x, nw, temb, weight, idx, workspace, "cupy", *grads)
    dx = torch.empty_like(x)
    fused = kernel_sums(dy, x, nw, idx, workspace, T, D, dx=dx)
    fused.check()
    fused.ready()
    if not torch.equal(dx, grads[0]):
        raise AssertionError(f"the exact route's dx differs from the backward's at {rows} rows")
    if not torch.equal(fused.table.limbs, want_table.limbs):
        raise AssertionError(f"the row pass's exact sums at {rows} rows differ from the exact sums of their terms")
    fixups = {"exact_route": int(fused.entries), **route_forms(dy, x, nw, idx, workspace, rows, want_table, grads[0],
                                                                forms)}
    del p, want_table, dx, fused
    kernels = {}
    for knob in (*others, shipped):
        cache_knob(knob)
        kernels[knob] = tensors.context(x.get_device(), H, D, T, rows)
    plan, _, k = kernels[shipped]
    table = torch.zeros((LIMBS, T, 2 * H), dtype=torch.int64, device="cuda")
    flags = torch.zeros(1, dtype=torch.int32, device="cuda")

    def fwd_bwd():
        launch.forward(x, nw, temb, weight, bias, idx, 1e-5, "cupy", "cuda", out, workspace)
        launch.backward(dy, x, nw, temb, weight, idx, workspace, "cupy", *grads)

    def exact_sums(context=kernels[shipped]):
        table.zero_(), flags.zero_()
        order = exact_row_order(idx, rows)
        launch_sums(context[2], context[0], tensors.current_stream(x.get_device()), x.data_ptr(), dy.data_ptr(),
                    rstd.data_ptr(), idx.data_ptr(), order.data_ptr(), table.data_ptr(), flags.data_ptr(), rows, rows)

    def exact_route(weight_copy=True):
        launch.forward(x, nw, temb, weight, bias, idx, 1e-5, "cupy", "cuda", out, workspace)
        kernel_sums(dy, x, nw, idx, workspace, T, D, dx=grads[0], weight_copy=weight_copy)

    def carry(exact=ExactKernels(kernels[shipped][2], x.get_device())):
        exact.carry(table)

    def route_form(name, value):  # graph_us captures the kernels of the form set now
        with launchers.tuned(**{name: value}):
            return graph_us(exact_route)

    def route_without_atomics():
        with no_close_atomics():
            return graph_us(exact_route)

    steps = (("fwd_bwd", fwd_bwd), ("exact_sums", exact_sums),
             *((f"exact_sums_cache{knob}", lambda knob=knob: exact_sums(kernels[knob])) for knob in others),
             ("carry", carry),
             ("exact_route", exact_route), ("exact_route_cast", lambda: exact_route(False)))
    us = {name: graph_us(step) for name, step in steps}
    us.update({form_name(setting): route_form(*setting) for setting in forms})
    failed = {}
    if without_atomics:  # a timing only: its failure (a compile error of the patched text, say) is recorded, not fatal
        try:
            us["exact_route_no_close_atomics"] = route_without_atomics()
        except Exception as error:  # noqa: BLE001 (reported in the JSON and the log)
            failed["exact_route_no_close_atomics"] = f"{type(error).__name__}: {error}"[:2000]
            print(f"rows {rows}: --no-close-atomics failed: {failed['exact_route_no_close_atomics']}", flush=True)
    routes = [name for name in us if name.startswith("exact_route")]
    return {"rows": rows, "us": us, "exact_floor_us": 4 * rows * H / (copy_TBps * 1e12) * 1e6,
            "grid": list(plan.exact_grid(rows)), "fixups": fixups, **({"failed": failed} if failed else {}),
            **{f"{name}_over_fwd_bwd": us[name] / us["fwd_bwd"] for name in routes}}


def settings(text: str) -> list[tuple[str, int]]:
    """--forms' KNOB=V settings, those equal to the shipped TUNING left out."""
    out = []
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in plan_module.TUNING or not re.fullmatch(r"-?\d+", value):
            raise SystemExit(f"--forms: {item!r} is not KNOB=INTEGER of a TUNING knob")
        if plan_module.TUNING[name] != int(value) and (name, int(value)) not in out:
            out.append((name, int(value)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="4097,32768")
    parser.add_argument("--forms", default="EXACT_ROW_DOUBLE=0,EXACT_CLOSE_STAGED=0,EXACT_CLOSE_STAGED=1,"
                        "EXACT_SORTED_MIN_T=1,EXACT_SORTED_MIN_T=3073",
                        help="TUNING settings checked and timed beside the shipped one (the shipped values skipped)")
    parser.add_argument("--no-close-atomics", action="store_true",
                        help="also time the route with its windows' atomics left out (wrong sums: a timing only)")
    parser.add_argument("--out")
    args = parser.parse_args()
    forms = settings(args.forms)
    copy = copy_bandwidth(torch.device("cuda"), 2 ** 31)
    result = {"gpu": torch.cuda.get_device_name(0), "copy_TBps": copy, "H": H, "D": D, "T": T, "sizes": []}
    for rows in (int(r) for r in args.rows.split(",")):
        entry = measure(rows, copy, forms, args.no_close_atomics)
        result["sizes"].append(entry)
        routes = ", ".join(f"{k[:-len('_over_fwd_bwd')]} {v:.3f}x" for k, v in entry.items()
                           if k.endswith("_over_fwd_bwd"))
        print(f"rows {rows}: fwd_bwd {entry['us']['fwd_bwd']:.1f} us, exact_sums {entry['us']['exact_sums']:.1f} "
              f"({', '.join(f'{k}: {v:.1f}' for k, v in entry['us'].items() if k.startswith('exact_sums_cache'))}) "
              f"(floor {entry['exact_floor_us']:.1f}), carry {entry['us']['carry']:.1f}; {routes}; fixup entries "
              f"{entry['fixups']}", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
