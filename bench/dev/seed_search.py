import torch
from adaln_lab.harness.inputs import make
from adaln_lab.reference import replay, golden
from adaln_lab.harness.accuracy import rel_err
for S in (4097, 32768):
    for s in range(0, 8):
        i = make(s, S, "cuda")
        with torch.no_grad():
            e = rel_err(replay(*i.args), golden(*i.args))
        print(S, s, e)
