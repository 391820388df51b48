"""Development check on a GPU: accuracy, parity and latency of adaln_lab at the seed sizes (not the evidence;
the evidence is `python -m adaln_lab report`)."""

import json
import sys

import torch

from adaln_lab.harness.accuracy import accuracy, parity
from adaln_lab.harness.candidates import adaln_lab_candidate, diffusers_candidate
from adaln_lab.harness.inputs import make, upstream
from adaln_lab.harness.latency import copy_bandwidth, latency, memory_floor

copy = copy_bandwidth(torch.device("cuda"), 2 << 30)
out = {"copy_TBps": copy}
for S in (4097, 32768):
    inputs = make(1, S, "cuda")
    floor = memory_floor(S, 5376, 2688, 3, copy)
    entry = {"floor_fwd_us": floor["fwd_us"], "floor_fwd_bwd_us": floor["fwd_bwd_us"]}
    entry.update(accuracy(adaln_lab_candidate().fn, inputs, upstream(1, inputs.x)))
    entry["parity_torch_table"] = parity(adaln_lab_candidate("torch").fn, diffusers_candidate().fn, inputs)
    entry["parity_cuda_table"] = parity(adaln_lab_candidate("cuda").fn, diffusers_candidate().fn, inputs)
    entry.update(latency(adaln_lab_candidate().fn, inputs, 20, 100))
    out[S] = entry
json.dump(out, sys.stdout, indent=1)
