"""ExactGradients.write on a GPU queues the device's work without waiting for it (core.transfers, TUNING's
NO_WAIT 1)."""

import pytest
import torch

from adaln_lab.core import transfers
from adaln_lab.nn import ExactGradients

from ..exact_parts import waits


@pytest.mark.gpu
def test_the_with_and_write_run_while_the_device_is_busy_and_give_the_same_bits(monkeypatch):
    """A patched tiny MiniMax-H3 model in the checkpoint's layout on CUDA (its AdaLNs on the kernels, the time
    embedding trainable: write forms d_temb and runs its backward). With NO_WAIT 1 and the device held busy after
    the backward (a sleep queued), the `with`'s end folds every part from the host copies its forward started and
    write queues all its work without waiting for the device (torch's sync debug mode sees no wait, and the sleep
    is still running), then reads the kernels' flags: its one wait, at its end. A second step, and steps with
    NO_WAIT 0 (a wait at each copy, d_temb on the host), give the same bits."""
    pytest.importorskip("diffusers")
    import adaln_lab
    from adaln_lab.nn import exact as exact_module
    from adaln_lab.testing import checkpoint_layout, tiny_h3_model

    model, inputs = tiny_h3_model(batch=2)
    checkpoint_layout(model).cuda()
    inputs = {k: v.cuda() for k, v in inputs.items()}
    adaln_lab.patch(model)
    cot = torch.randn(2, *model(**inputs).sample.shape[1:], generator=torch.Generator().manual_seed(5)).cuda()
    checked = []
    monkeypatch.setattr(exact_module, "_check", lambda group, check=exact_module._check: (
        checked.append(mark.query()), check(group)))

    def step(busy):
        model.zero_grad(set_to_none=True)
        acc = ExactGradients()
        with acc:
            (model(**inputs).sample * cot).sum().backward()
            if busy:
                torch.cuda.synchronize()
                torch.cuda._sleep(1_000_000_000)  # about half a second: the host's fold and write run meanwhile
                mark.record()
                exit_waits = waits(lambda: acc.__exit__(None, None, None))
                acc.__enter__()  # the `with` exits again: nothing left to fold
        write_waits = waits(acc.write) if busy else acc.write()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return (exit_waits, write_waits) if busy else None, grads

    mark = torch.cuda.Event()
    step(False)  # compiled, warmed
    _, waiting = step(False)
    monkeypatch.setattr(transfers, "NO_WAIT", 1)
    checked.clear()
    (exit_waits, write_waits), grads = step(True)
    assert exit_waits == 0 and write_waits == 0  # no wait that torch's debug mode sees (a .cpu(), a pageable copy)
    assert checked and checked[0] is False  # the flags' read came while the sleep still ran: nothing waited before
    assert mark.query()  # and that read waited for the device
    assert any(n.startswith("time_embed") for n in grads) and all(bool(torch.isfinite(g).all())
                                                                   for g in grads.values())
    _, again = step(False)
    assert grads.keys() == waiting.keys() and all(torch.equal(grads[n], g[n]) for g in (again, waiting) for n in grads)


def test_a_refused_part_stays_pending_and_no_part_is_folded_twice():
    """Two norm_out parts, the second with another norm weight: the fold refuses it (ValueError), the first stays
    folded once and the second pending; folding again refuses again and leaves the first's states as they were."""
    from adaln_lab.ops.final_adaln_out.exact import NormOutSums

    T, H, D = 2, 4, 3
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(2 * H, D, generator=g, requires_grad=True), torch.randn(2 * H, requires_grad=True)
    nw = torch.ones(H, requires_grad=True)
    temb, table = torch.randn(T, D, generator=g), torch.randn(T, 2 * H, generator=g)

    def part(norm_weight):
        x, dy = torch.randn(1, 5, H, generator=g), torch.randn(1, 5, H, generator=g)
        return NormOutSums(T, H).add(x, dy, norm_weight, table, torch.tensor([0, 1, 0, 1, 0]))

    acc = ExactGradients()
    acc.add_norm_out((nw, w, b), temb, part(nw))
    acc.add_norm_out((nw, w, b), temb, part(nw.detach() * 2))
    group = next(iter(acc.groups.values()))
    with pytest.raises(ValueError, match="column factors"):
        acc.state_bytes()
    assert len(group.pending) == 1
    held = {k: s.limbs.clone() for k, (_, s) in group.table.rows.items()}
    with pytest.raises(ValueError, match="column factors"):
        acc.state_bytes()
    assert len(group.pending) == 1
    assert all(torch.equal(group.table.rows[k][1].limbs, v) for k, v in held.items())


def test_a_kernels_flag_is_named_before_an_error_it_caused_in_write():
    """A part whose (planted) kernel flag says a term was not finite and whose norm weight is NaN (a diverged run):
    forming the gradients fails on the NaN factors, and write names the flag's cause, the gradients unset."""
    from adaln_lab.ops.final_adaln_out.exact import NormOutSums

    T, H, D = 2, 4, 3
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(2 * H, D, generator=g, requires_grad=True), torch.randn(2 * H, requires_grad=True)
    nw = torch.full((H,), float("nan"), requires_grad=True)
    temb, table = torch.randn(T, D, generator=g), torch.randn(T, 2 * H, generator=g)
    x, dy = torch.randn(1, 5, H, generator=g), torch.randn(1, 5, H, generator=g)
    for flags, error in (([torch.tensor([1], dtype=torch.int32)], "non-finite gradient term"),  # a planted flag
                         ([], "factors must be finite")):  # without it, the NaN factors' own error
        sums = NormOutSums(T, H).add(x, dy, nw.detach(), table, torch.tensor([0, 1, 0, 1, 0]))
        sums.flags = flags
        acc = ExactGradients()
        acc.add_norm_out((nw, w, b), temb, sums)
        with pytest.raises(ValueError, match=error):
            acc.write()
        assert w.grad is None and b.grad is None and nw.grad is None
