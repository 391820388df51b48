"""`final_adaln_out` (backend "cupy") run concurrently gives, bit for bit, what it gives run alone (GPU only).

- Two CUDA streams at once: each stream gets its own inputs (made on that stream) and runs REPEATS
  forward+backward calls queued behind a GPU sleep on both streams, so the two streams' kernels run
  together when the sleeps end; every output and gradient equals the serial run's.
- Two Python threads at once (each on its own stream, or both on the default stream), each with its own
  inputs, after the kernel caches were cleared so the first use (loader's lock) is raced too; every
  output and gradient equals the serial run's.

Shapes: H 1024, D 256, T 3, 4097 rows (several row ranges in every kernel), inputs of seeds 1 and 2.
"""

from __future__ import annotations

import threading

import pytest
import torch

from adaln_lab import final_adaln_out
from adaln_lab.core import launchers
from adaln_lab.harness.inputs import LEAVES, make, upstream

pytestmark = pytest.mark.gpu
SHAPE = dict(H=1024, D=256, T=3)
ROWS = 4097
REPEATS = 6
SLEEP_CYCLES = 100_000_000  # ~50 ms at the H200's clock: time for the host to queue every call


def _inputs(seed: int):
    inputs = make(seed, ROWS, "cuda", **SHAPE)
    return inputs, upstream(seed, inputs.x)


def _call(inputs, dy) -> tuple[torch.Tensor, ...]:
    """(out, dx, d_norm_weight, d_temb, d_weight, d_bias) of one eager forward+backward on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    out = final_adaln_out(*leaves, inputs.timestep_indices, backend="cupy")
    out.backward(dy)
    return (out.detach(), *(leaf.grad for leaf in leaves))


def _assert_same(got, want, what: str) -> None:
    for name, a, b in zip(("out", *(f"d_{n}" for n in LEAVES)), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, name)
        assert torch.equal(a, b), f"{what}: {name} differs in {int((a != b).sum())} of {a.numel()} elements"


def _serial(made) -> list:
    torch.cuda.synchronize()
    serial = [_call(*m) for m in made]
    torch.cuda.synchronize()
    return serial


def _sleep(stream: torch.cuda.Stream) -> None:
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        with torch.cuda.stream(stream):
            sleep(SLEEP_CYCLES)


def test_two_streams_at_once_match_serial_runs():
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    made = []
    for seed, stream in zip((1, 2), streams):
        with torch.cuda.stream(stream):
            made.append(_inputs(seed))
    serial = _serial(made)
    assert not all(torch.equal(a, b) for a, b in zip(*serial))  # the two streams' results differ
    for stream in streams:
        _sleep(stream)
    results = [[], []]
    for _ in range(REPEATS):
        for k, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                results[k].append(_call(*made[k]))
    torch.cuda.synchronize()
    for k in range(2):
        for n, got in enumerate(results[k]):
            _assert_same(got, serial[k], f"stream {k}, call {n}")


@pytest.mark.parametrize("own_stream", [True, False], ids=["own_streams", "default_stream"])
def test_two_threads_at_once_match_serial_runs(own_stream):
    made = [_inputs(1), _inputs(2)]
    serial = _serial(made)
    launchers.forget_compiled()  # plans, modules, launchers and the caches on them: a cold start for both threads
    barrier = threading.Barrier(2)
    results, errors = [[], []], []

    def work(k: int) -> None:
        try:
            stream = torch.cuda.Stream() if own_stream else torch.cuda.default_stream()
            with torch.cuda.stream(stream):
                barrier.wait(timeout=60)
                for _ in range(REPEATS):
                    results[k].append(_call(*made[k]))
            stream.synchronize()
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    torch.cuda.synchronize()
    for k in range(2):
        assert len(results[k]) == REPEATS
        for n, got in enumerate(results[k]):
            _assert_same(got, serial[k], f"thread {k}, call {n}")
