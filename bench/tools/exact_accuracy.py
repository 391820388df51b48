"""Exact gradients' accuracy at MiniMax-H3's width against the float64 golden, beside today's."""

# The seed report's accuracy inputs (`adaln_lab.harness.protocol.FULL`: its accuracy seed and shape, H 5376, D 2688,
# T 3) at --rows rows, its randn upstream gradient: norm_out's five gradients by `adaln_lab.nn.ExactGradients` (the
# torch route: every cross-row sum exact, rounded once) and by the torch route's plain autograd (diffusers' ops), each
# against the float64 `pure` golden: max|err| / max|ref| and the share of elements equal to the golden rounded once
# (`adaln_lab.harness.accuracy`). Beside them, the kernels' (backend "cupy", plain autograd): on a GPU computed on
# the same inputs, moved there, with the kernels' exact route (exact_sums.cu) on them too; without one read off a
# committed report at the same rows (--report, default bench/results/h100/report.json, candidate adaln_lab), whose
# inputs CUDA's generator drew: other values, so only the shares compare, not the errors. And whether every exact
# gradient's error is at most the kernels'.
#
#     PYTHONPATH=src python3 bench/tools/exact_accuracy.py [--rows 4097] [--report FILE] --out FILE.json

from __future__ import annotations

import argparse
import json
import pathlib

import torch

from adaln_lab import final_adaln_out
from adaln_lab.harness.accuracy import GRAD_KEYS, correctly_rounded, golden_result, rel_err
from adaln_lab.harness.inputs import LEAVES, make, upstream
from adaln_lab.harness.protocol import FULL
from adaln_lab.nn import ExactGradients

ROOT = pathlib.Path(__file__).resolve().parents[2]


def gradients(inputs, dy, exact: bool, backend: str = "torch", device: str = "cpu") -> dict:
    """{leaf name: gradient, on the CPU} of norm_out on fresh leaves on `device`, exact (the torch route) or by
    plain autograd on `backend`."""
    leaves = [t.detach().to(device).clone().requires_grad_(True) for t in inputs.leaves]
    acc = ExactGradients()
    with acc if exact else torch.enable_grad():
        final_adaln_out(*leaves, inputs.timestep_indices.to(device), backend=backend).backward(dy.to(device))
    if exact:
        acc.write()
    return {name: leaf.grad.cpu() for name, leaf in zip(LEAVES, leaves)}


def figures(grads: dict, ref: dict) -> dict:
    return {"grad_rel_err": {key: rel_err(grads[name], ref[name]) for name, key in GRAD_KEYS.items()},
            "grad_correctly_rounded": {key: correctly_rounded(grads[name], ref[name])
                                       for name, key in GRAD_KEYS.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4097)
    parser.add_argument("--report", type=pathlib.Path, default=ROOT / "bench/results/h100/report.json")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    inputs = make(FULL.accuracy_seed, args.rows, "cpu", **FULL.shape)
    dy = upstream(FULL.accuracy_seed, inputs.x)
    _, ref = golden_result(inputs, dy)
    result = {"rows": args.rows, "shape": FULL.shape, "device": "cpu", "torch": torch.__version__,
              "exact": figures(gradients(inputs, dy, True), ref),
              "torch_plain": figures(gradients(inputs, dy, False), ref)}
    if torch.cuda.is_available():  # the kernels on the same inputs, plain and exact (exact_sums.cu)
        result["kernels"] = dict(figures(gradients(inputs, dy, False, "cupy", "cuda"), ref),
                                 inputs="the same", gpu=torch.cuda.get_device_name())
        result["exact_kernels"] = figures(gradients(inputs, dy, True, "cupy", "cuda"), ref)
    else:
        report = json.loads(args.report.read_text())
        kernels = report["results"]["plain"]["adaln_lab"]["accuracy_latency"].get(str(args.rows))
        if kernels is not None:
            result["kernels"] = {"inputs": "other (CUDA's generator): compare the shares, not the errors",
                                 "report": str(args.report.relative_to(ROOT)),
                                 "commit": report.get("adaln_lab_commit"), "grad_rel_err": kernels["grad_rel_err"],
                                 "grad_correctly_rounded": kernels["grad_correctly_rounded"]}
    if result.get("kernels", {}).get("inputs") == "the same":
        for exact in ("exact", "exact_kernels"):
            result[f"{exact}_no_worse_than_kernels"] = {
                key: result[exact]["grad_rel_err"][key] <= err
                for key, err in result["kernels"]["grad_rel_err"].items()}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name in ("exact", "torch_plain", "kernels", "exact_kernels"):
        if name in result:
            errs = ", ".join(f"{k} {v:.3g}" for k, v in result[name]["grad_rel_err"].items())
            shares = ", ".join(f"{k} {v:.4f}" for k, v in result[name]["grad_correctly_rounded"].items())
            print(f"{name}: grad_rel_err {errs}; correctly rounded {shares}")
    for exact in ("exact", "exact_kernels"):
        if f"{exact}_no_worse_than_kernels" in result:
            print(f"{exact} no worse than the kernels: {result[f'{exact}_no_worse_than_kernels']}")


if __name__ == "__main__":
    main()
