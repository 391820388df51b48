"""core.transfers: host copies started early and read later, host tensors sent without a wait; the same bits as
.cpu() / .to(). Their pinned forms run where core.transfers.NO_WAIT is 1 (the `no_wait` fixture)."""

import pytest
import torch

from adaln_lab.core import transfers
from adaln_lab.core.transfers import HostCopies, to_device

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
    copies = HostCopies(ts)
    for t, h in zip(ts, copies.get()):
        assert h.data_ptr() == t.data_ptr() and not h.requires_grad
    t = torch.randn(4, dtype=torch.float64)
    assert torch.equal(to_device(t, "cpu", torch.float32), t.float())


@pytest.mark.gpu
@pytest.mark.parametrize("on", [0, 1])
def test_gpu_copies_hold_the_values_when_they_were_started(monkeypatch, on):
    """Each copy is the tensor's bits as they were when HostCopies was made (NO_WAIT 1: queued then, so a later
    in-place change does not reach it; NO_WAIT 0 copies at `get`, so this check is for the pinned form)."""
    monkeypatch.setattr(transfers, "NO_WAIT", on)
    ts = mixed("cuda")
    want = [t.cpu() for t in ts]
    copies = HostCopies(ts + [torch.ones(2)])  # a CPU tensor among them
    if on:
        for t in ts:
            if t.numel() and t.dtype != torch.bool:
                t.add_(1)
    hosts = copies.get()
    assert all(a is b for a, b in zip(hosts, copies.get()))  # the same copies each time, not copied again
    for w, h in zip(want, hosts):
        assert h.device.type == "cpu" and h.dtype == w.dtype and h.shape == w.shape
        assert torch.equal(h.reshape(-1).view(torch.uint8) if h.numel() else h,
                           w.reshape(-1).view(torch.uint8) if w.numel() else w)
    t = torch.randn(1000, dtype=torch.float64)
    sent = to_device(t, "cuda", torch.float32)
    assert sent.is_cuda and torch.equal(sent.cpu(), t.float())


@pytest.mark.gpu
def test_the_sync_count_catches_a_planted_wait(no_wait):
    """The check the write test relies on: torch's sync debug mode warns for a copy to the host and for a copy from
    pageable memory, and not for HostCopies' start nor to_device's pinned copy; `get` behind a busy device waits
    for it (an event), and gives the values."""
    x = torch.randn(4, device="cuda")
    assert waits(lambda: x.cpu()) == 1  # the planted wait
    assert waits(lambda: torch.randn(4).to("cuda")) == 1
    assert waits(lambda: to_device(torch.randn(4), "cuda")) == 0
    HostCopies([x]).get()  # the pinned allocator warmed: its first blocks take milliseconds of host time
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # the device busy for about half a second (50 M cycles, 25 ms, was too short)
    mark = torch.cuda.Event()
    mark.record()  # done when the sleep is
    copies = HostCopies([x, x * 2, x.int()])
    assert waits(lambda: HostCopies([x])) == 0 and not mark.query()  # started without waiting for the sleep
    hosts = copies.get()
    assert mark.query() and torch.equal(hosts[1], 2 * x.cpu())
