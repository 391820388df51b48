"""adaln_lab.bench.multi_gpu, the run prepared for a machine of several GPUs, emulated on the CPU: 2 gloo ranks
run FSDP2 and diffusers' ulysses context parallelism on the patched tiny model, each against the model unsharded,
and the planted leaky norm_out is caught; exact gradients under FSDP2 give world sizes 1 and 2 the same bits; ring
is skipped there with its reason (no CPU attention backend returns the log-sum-exp)."""

import json
import subprocess
import sys

import pytest

from ..paths import ROOT

pytestmark = pytest.mark.integration  # gloo ranks in processes of their own

pytest.importorskip("diffusers", reason="the test extra brings diffusers 0.42")

MODULE = [sys.executable, "-m", "adaln_lab.bench.multi_gpu"]  # from the checkout's root: its adaln_lab


def test_the_multi_gpu_script_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "multi_gpu.json"
    done = subprocess.run([*MODULE, "--device", "cpu", "--world", "2", "--steps", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["checks_failed"] == [] and result["world"] == 2
    runs = result["runs"]
    for run, names in {"fsdp": {"forward_bitwise_unsharded", "adaln_grads_reduce_scatter_mean", "adaln_grads_repeat"},
                       "ulysses": {"norm_out_rows_bitwise_unsharded", "norm_out_rank_rows_alone_bitwise",
                                   "adaln_grads_summed_repeat", "out_bitwise_where_diffusers_is"},
                       "planted": {"planted_leaky_norm_out_caught", "planted_rank_rows_alone_bitwise",
                                   "planted_adaln_grads_summed_repeat"},
                       "exact": {"exact_adaln_grads_bitwise_every_world",
                                 "planted_fp32_reduce_scatter_caught"}}.items():
        assert [set(rank["checks"]) for rank in runs[run]] == [names, names], run
        assert all(all(rank["checks"].values()) for rank in runs[run]), run
    assert all("log-sum-exp" in rank["skipped"] for rank in runs["ring"])
    assert runs["fsdp"][0]["figures"]["adaln_grad_max_abs_vs_mean"] == 0.0
    exact = runs["exact"][0]["figures"]
    assert exact["worlds"] == [1, 2] and exact["all_reduce_bytes_per_rank"] > 0
    assert (tmp_path / "multi_gpu.json.ranks" / "rank1.json").is_file()  # what each rank finished, kept


def test_the_multi_gpu_script_refuses_an_unknown_run_and_no_ranks(tmp_path, capsys):
    from adaln_lab.bench.multi_gpu import main  # in this process: argparse refuses before any rank starts

    for args, says in ((["--runs", "fsdp,tensor"], "--runs: unknown ['tensor']"),
                       (["--world", "0"], "--world must be >= 1, got 0")):
        with pytest.raises(SystemExit) as done:
            main(["--device", "cpu", *args, "--out", str(tmp_path / "x.json")])
        stderr = capsys.readouterr().err
        assert done.value.code == 2 and says in stderr, stderr[-500:]
    assert not (tmp_path / "x.json").exists()
