"""bench/scripts/host_model.py, the eager path's own host cost on a CPU with the GPU stood in for: it runs the
shipped glue end to end (every kernel of norm_out and of one block reached, each launch's argument block
written) and puts every stand-in back afterwards."""

import importlib.util

import torch

from adaln_lab.cuda import launchers, tensors
from adaln_lab.ops import support

from ..paths import ROOT


def _host_model():
    spec = importlib.util.spec_from_file_location("host_model", ROOT / "bench" / "scripts" / "host_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_host_model_reaches_every_launch_and_restores_the_stand_ins():
    originals = (launchers.kernels, launchers.bind, tensors.current_stream, support._not_cuda,
                 torch.cuda.current_device)
    lines = []
    found = _host_model().measure(rows=8, calls=3, H=1024, D=256, out=lines.append)
    # norm_out: table, rows, then the backward's row pass, reduce, table_bwd and its reduce (tests/cuda/test_launchers.py);
    # a block: the table, the row order, three forward row kernels and the backward's ten
    assert found["final_adaln_out"]["launches"] == 6 and found["block_adaln_path"]["launches"] == 15
    assert all(f["allocations"] > 0 and f["us"] > 0 and f["floor_us"] > 0 for f in found.values())
    assert len(lines) == 3 and lines[1].startswith("final_adaln_out: fwd+bwd")
    assert (launchers.kernels, launchers.bind, tensors.current_stream, support._not_cuda,
            torch.cuda.current_device) == originals
