"""The timings of adaln_lab/harness/latency.py: positive where they apply, null with a reason where they cannot run."""

import subprocess
import sys

import pytest
import torch

from adaln_lab.harness.inputs import make
from adaln_lab.harness.latency import (autograd_floor, graph_latency, host_latency, identity_floor_step,
                                       inference_latency, latency, summary)
from adaln_lab.reference import replay

SHAPE = {"H": 64, "D": 32, "T": 3}


@pytest.fixture(scope="module")
def cpu_inputs():
    return make(1, 17, "cpu", **SHAPE)


def test_inference_and_host_timings_are_positive_on_cpu(cpu_inputs):
    assert inference_latency(replay, cpu_inputs, 1, 3) > 0
    host = host_latency(replay, cpu_inputs, 1, 3)
    assert set(host) == {"host_fwd_us", "host_fwd_bwd_us"}
    assert host["host_fwd_us"] > 0 and host["host_fwd_bwd_us"] > 0


def test_summary_of_samples():
    assert summary([3.0, 100.0, 1.0, 4.0, 2.0]) == {"min": 1.0, "p25": 2.0, "median": 3.0, "p75": 4.0, "max": 100.0,
                                                     "n": 5}
    assert summary([7.0]) == {"min": 7.0, "p25": 7.0, "median": 7.0, "p75": 7.0, "max": 7.0, "n": 1}


def test_timings_give_the_spread_of_their_samples_when_asked(cpu_inputs):
    spread = {}
    figures = latency(replay, cpu_inputs, 1, 4, spread)
    figures["fwd_us_inference"] = inference_latency(replay, cpu_inputs, 1, 4, spread)
    figures.update(host_latency(replay, cpu_inputs, 1, 4, spread))
    assert set(spread) == set(figures) == {"fwd_us", "fwd_bwd_us", "fwd_bwd_us_pure", "fwd_us_inference",
                                           "host_fwd_us", "host_fwd_bwd_us"}
    for key, s in spread.items():
        assert s["n"] == 4 and s["median"] == figures[key] and s["min"] <= s["median"] <= s["max"]
    assert graph_latency(replay, cpu_inputs, 1, 4, spread=spread)["fwd_us_graph"] is None
    assert len(spread) == 6  # no samples without CUDA: nothing added


def test_inference_latency_runs_under_inference_mode(cpu_inputs):
    seen = []

    def spy(*args):
        seen.append(torch.is_inference_mode_enabled())
        return replay(*args)

    inference_latency(spy, cpu_inputs, 1, 2)
    assert seen and all(seen)


def test_host_fwd_bwd_calls_backward_on_fresh_grads(cpu_inputs):
    grads_before_call = []

    def spy(x, *rest):
        grads_before_call.append(x.grad is None)
        return replay(x, *rest)

    host_latency(spy, cpu_inputs, 1, 3)
    assert all(grads_before_call)


def test_graph_fields_are_null_with_a_reason_without_cuda(cpu_inputs):
    assert graph_latency(replay, cpu_inputs, 1, 3) == {
        "fwd_us_graph": None, "fwd_bwd_us_graph": None,
        "fwd_us_graph_error": "no CUDA", "fwd_bwd_us_graph_error": "no CUDA"}


def test_autograd_floor_is_positive_on_cpu(cpu_inputs):
    floor = autograd_floor(cpu_inputs, 1, 3)
    assert set(floor) == {"autograd_floor_us", "autograd_floor_host_us"}
    assert floor["autograd_floor_us"] > 0 and floor["autograd_floor_host_us"] > 0


def test_autograd_floor_accumulates_five_preallocated_grads_without_copies(cpu_inputs):
    prepare, step = identity_floor_step(cpu_inputs)
    storages = [leaf.grad.data_ptr() for leaf in step.leaves]
    for _ in range(3):
        prepare()
        assert all(leaf.grad is None for leaf in step.leaves)
        step()
        # AccumulateGrad stole the returned tensors: the same five storages every time, still zero
        assert [leaf.grad.data_ptr() for leaf in step.leaves] == storages
        assert all(not leaf.grad.any() for leaf in step.leaves)


@pytest.mark.gpu
def test_graph_replay_of_a_trivial_candidate_gives_a_positive_time():
    inputs = make(1, 257, "cuda", **SHAPE)

    def trivial(x, norm_weight, temb, weight, bias, timestep_indices):
        return x * norm_weight

    figures = graph_latency(trivial, inputs, 3, 10)
    assert figures["fwd_us_graph_error"] is None and figures["fwd_bwd_us_graph_error"] is None, figures
    assert figures["fwd_us_graph"] > 0 and figures["fwd_bwd_us_graph"] > 0


@pytest.mark.gpu
def test_graph_time_of_the_replay_is_not_above_its_eager_time():
    inputs = make(1, 257, "cuda", **SHAPE)
    eager = latency(replay, inputs, 5, 20)
    figures = graph_latency(replay, inputs, 5, 20)
    assert figures["fwd_us_graph"] is not None, figures
    assert figures["fwd_us_graph"] <= eager["fwd_us"] * 1.5, (figures, eager)
    assert figures["fwd_bwd_us_graph"] is not None, figures


@pytest.mark.gpu
def test_a_failed_capture_gives_null_and_the_reason():
    """In a subprocess: a failed capture can leave the process's CUDA state unwell for later tests."""
    code = (
        "from adaln_lab.harness.inputs import make\n"
        "from adaln_lab.harness.latency import graph_latency\n"
        "from adaln_lab.reference import replay\n"
        "inputs = make(1, 33, 'cuda', H=64, D=32, T=3)\n"
        "def syncs(*args):\n"
        "    out = replay(*args)\n"
        "    float(out.float().sum())  # a host sync: illegal while capturing\n"
        "    return out\n"
        "figures = graph_latency(syncs, inputs, 1, 2)\n"
        "assert figures['fwd_us_graph'] is None and figures['fwd_us_graph_error'], figures\n"
        "assert figures['fwd_us_graph_error'] != 'no CUDA', figures\n"
        "print('OK', figures['fwd_us_graph_error'])\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "OK" in run.stdout, run.stdout + run.stderr[-3000:]
