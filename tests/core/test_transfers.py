"""core.transfers: host copies in one transfer, host tensors sent without a wait; the same bits as .cpu() / .to().
Their packed and pinned forms run where core.transfers.NO_WAIT is 1 (the `no_wait` fixture)."""

import pytest
import torch

from adaln_lab.core import transfers
from adaln_lab.core.transfers import host_copies, to_device

from ..exact_parts import waits


@pytest.fixture
def no_wait(monkeypatch):
    monkeypatch.setattr(transfers, "NO_WAIT", 1)


def mixed(device):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 5, generator=g).bfloat16().to(device), torch.randn(7, generator=g).to(device),
            torch.tensor([5], dtype=torch.int32, device=device), torch.randint(-2 ** 62, 2 ** 62, (2, 3), generator=g,
                                                                               dtype=torch.int64).to(device),
            torch.empty(0, 4, device=device), torch.randn(4, 6, generator=g).to(device)[:, ::2],  # not contiguous
            torch.tensor(True, device=device), torch.randn(3, generator=g, dtype=torch.float64).to(device)]


@pytest.mark.parametrize("on", [0, 1])
def test_cpu_tensors_come_back_as_they_are_and_to_device_casts_on_the_host(monkeypatch, on):
    monkeypatch.setattr(transfers, "NO_WAIT", on)
    ts = mixed("cpu")
    for t, h in zip(ts, host_copies(ts)):
        assert h.data_ptr() == t.data_ptr() and not h.requires_grad
    t = torch.randn(4, dtype=torch.float64)
    assert torch.equal(to_device(t, "cpu", torch.float32), t.float())


@pytest.mark.gpu
def test_gpu_copies_are_the_tensors_bits_in_one_transfer(no_wait):
    ts = mixed("cuda")
    hosts = host_copies(ts + [torch.ones(2)])  # a CPU tensor among them
    for t, h in zip(ts, hosts):
        assert h.device.type == "cpu" and h.dtype == t.dtype and h.shape == t.shape
        assert torch.equal(h.reshape(-1).view(torch.uint8) if h.numel() else h,
                           t.cpu().reshape(-1).view(torch.uint8) if t.numel() else t.cpu())
    t = torch.randn(1000, dtype=torch.float64)
    sent = to_device(t, "cuda", torch.float32)
    assert sent.is_cuda and torch.equal(sent.cpu(), t.float())


@pytest.mark.gpu
def test_the_sync_count_catches_a_planted_wait(no_wait):
    """The check the write test relies on: torch's sync debug mode warns for a copy to the host and for a copy from
    pageable memory, and not for host_copies' transfer beyond its one nor to_device's pinned copy."""
    x = torch.randn(4, device="cuda")
    assert waits(lambda: x.cpu()) == 1  # the planted wait
    assert waits(lambda: torch.randn(4).to("cuda")) == 1
    assert waits(lambda: to_device(torch.randn(4), "cuda")) == 0
    assert waits(lambda: host_copies([x, x * 2, x.int()])) == 1
