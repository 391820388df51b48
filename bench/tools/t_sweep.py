"""norm_out's graph forward and forward+backward against T (packed timesteps), its kernels' times, and its peers'."""

# At norm_out's width (H 5376, D 2688), `--rows` rows of the seed protocol's inputs (`adaln_lab.harness.inputs.make`)
# for each T of `--ts`:
# - adaln_lab's CUDA-graph forward and forward+backward (`adaln_lab.harness.latency.graph_latency`: GPU time, no
#   host), and whether the call left the kernels (a KernelFallbackWarning);
# - the time of each kernel of one eager forward+backward (`adaln_lab.lab.latency_sweep.kernel_profile`: mean of
#   5 profiled calls), largest first;
# - diffusers and torch.compile in the same run at the T of `--peer-ts` (each a minute or so of compiles), as ratios.
#
#     python3 bench/tools/t_sweep.py [--rows 8192] [--ts 1,3,8,10,16,32] [--peer-ts 1,32] [--out FILE.json]

from __future__ import annotations

import argparse
import json
import pathlib
import warnings

import torch

from adaln_lab.harness.candidates import adaln_lab_candidate, diffusers_candidate, torch_compile_candidate
from adaln_lab.harness.inputs import make
from adaln_lab.harness.latency import graph_latency
from adaln_lab.lab.latency_sweep import kernel_profile


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def graph(fn, inputs) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = graph_latency(fn, inputs, warmup=5, iters=15)
    out["fallback"] = any(type(w.message).__name__ == "KernelFallbackWarning" for w in caught)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--ts", type=ints, default=[1, 3, 8, 10, 16, 32], help="T values, comma-separated")
    parser.add_argument("--peer-ts", type=ints, default=[1, 32], help="T values that also time diffusers and "
                        "torch.compile ('' for none)")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)
    ours = adaln_lab_candidate().fn
    peers = {"diffusers": diffusers_candidate("cuda"), "torch_compile": torch_compile_candidate("cuda")}
    result = {"gpu": torch.cuda.get_device_name(), "rows": args.rows, "sweep": []}
    for T in args.ts:
        inputs = make(0, args.rows, "cuda", T=T)
        row = {"T": T, "adaln_lab": graph(ours, inputs)}
        if T in args.peer_ts:
            for name, peer in peers.items():
                row[name] = graph(peer.fn, inputs)
                row[name]["name"] = peer.name
                mine, theirs = row["adaln_lab"]["fwd_bwd_us_graph"], row[name]["fwd_bwd_us_graph"]
                row[f"{name}_over_adaln_lab"] = theirs / mine if mine and theirs else None
        row["kernels_us"] = {k["name"]: k["us"] for k in kernel_profile(ours, inputs)}  # largest first
        print(json.dumps({k: v for k, v in row.items() if k != "kernels_us"}), flush=True)
        print("  " + "; ".join(f"{k[:48]} {v:.1f}" for k, v in list(row["kernels_us"].items())[:8]), flush=True)
        result["sweep"].append(row)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
