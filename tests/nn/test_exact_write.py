"""ExactGradients.write on a GPU queues the device's work without waiting for it (core.transfers, TUNING's
NO_WAIT 1)."""

import pytest
import torch

from adaln_lab.core import transfers
from adaln_lab.nn import ExactGradients

from ..exact_parts import waits


@pytest.mark.gpu
def test_write_of_a_patched_h3_model_waits_for_the_device_once_at_the_with_and_never_in_write(monkeypatch):
    """A patched tiny MiniMax-H3 model in the checkpoint's layout on CUDA (its AdaLNs on the kernels, the time
    embedding trainable: write forms d_temb and runs its backward): the `with`'s end reads every part's rows, scales,
    factors and flags in one transfer, and write waits for nothing; a second step, and one with NO_WAIT 0 (a
    wait at each copy, d_temb on the host), give the same bits."""
    pytest.importorskip("diffusers")
    import adaln_lab
    from adaln_lab.testing import checkpoint_layout, tiny_h3_model

    model, inputs = tiny_h3_model(batch=2)
    checkpoint_layout(model).cuda()
    inputs = {k: v.cuda() for k, v in inputs.items()}
    adaln_lab.patch(model)
    cot = torch.randn(2, *model(**inputs).sample.shape[1:], generator=torch.Generator().manual_seed(5)).cuda()

    def step(check):
        model.zero_grad(set_to_none=True)
        acc = ExactGradients()
        with acc:
            (model(**inputs).sample * cot).sum().backward()
            torch.cuda.synchronize()
            exit_waits = waits(lambda: acc.__exit__(None, None, None))
            acc.__enter__()  # the `with` exits again: nothing left to fold, no transfer
        write_waits = waits(acc.write) if check else acc.write()
        return exit_waits, write_waits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    step(False)  # compiled, warmed
    _, _, waiting = step(False)
    monkeypatch.setattr(transfers, "NO_WAIT", 1)
    exit_waits, write_waits, grads = step(True)
    assert exit_waits == 1 and write_waits == 0
    assert any(n.startswith("time_embed") for n in grads) and all(bool(torch.isfinite(g).all())
                                                                   for g in grads.values())
    _, _, again = step(False)
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
