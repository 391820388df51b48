"""Exact AdaLN gradients over micro-batches: the same bits however the rows are ordered or split.

    acc = ExactGradients()
    for micro in micro_batches:
        with acc:                                    # norm_out records instead of returning its gradients
            loss_fn(model(micro)).backward()         # dx flows at once; nothing reaches the AdaLN parameters
    acc.write()                                      # each one's .grad, once; temb's gradient into its producer

Inside `with acc` norm_out (`final_adaln_out`, the torch route: backend="torch", or any CPU call) keeps the exact
states of its cross-row sums (ops/final_adaln_out/exact.py: per-row float32 terms added as integers) and its
temb, graph and all. `write` rounds each sum once: d_norm_weight and the table's gradient per distinct temb row
(identical rows are one timestep, merged), then d_weight, d_bias and d_temb as fixed functions of those
(ops/modulation_table/exact.py), and sends d_temb back through the first kept temb holding each row (the same
rows give the same Jacobian). The parameters' .grad must be None before the first part (zero_grad(set_to_none=
True)): write sets them, once. `merge` adds another accumulator's states (another group of micro-batches), in
any order. The kernels' route is not recorded yet: a call there inside `with acc` raises NotImplementedError.
temb's graph must live until write: a temb that other ops also backpropagate through (an H3 model's blocks) is
freed by then, and write says so (the model-level step, recomputing the time embedding of the distinct rows at
write, is not built yet). The active accumulator is process-wide (a stack in core.exact, which torch.compile can
read): one training thread.
"""

from __future__ import annotations

import torch

from ..core.exact import ExactSum, recording, reset_recording
from ..ops.modulation_table.exact import TableSums, row_key


class _Group:
    """One norm_out's parameters (norm_weight, weight, bias), their exact states and the kept tembs."""

    def __init__(self, params):
        self.params = params
        self.norm_weight = ExactSum(params[0].shape, params[0].device)
        self.table = TableSums()
        self.tembs: list[torch.Tensor] = []


class ExactGradients:
    """The exact-gradient accumulator (module docstring)."""

    def __init__(self):
        self.groups: dict[tuple, _Group] = {}

    def __enter__(self) -> "ExactGradients":
        recording(self)
        return self

    def __exit__(self, *exc) -> None:
        reset_recording()

    def _group(self, params) -> _Group:
        key = tuple(id(p) for p in params)
        if key not in self.groups:
            self.groups[key] = _Group(params)
        return self.groups[key]

    def keep_temb(self, params, temb: torch.Tensor) -> None:
        """Keep a part's temb (with its graph) for write's temb gradient."""
        group = self._group(params)
        if temb.requires_grad and not any(t is temb for t in group.tembs):
            group.tembs.append(temb)

    def add_norm_out(self, params, temb: torch.Tensor, sums) -> None:
        """Merge a part's NormOutSums (its temb rows as the table states' keys)."""
        group = self._group(params)
        group.norm_weight.merge(sums.norm_weight)
        group.table.add(temb, sums.table)

    def merge(self, other: "ExactGradients") -> "ExactGradients":
        """Add another accumulator's states and kept tembs (the same parameters), in any order."""
        for key, theirs in other.groups.items():
            mine = self._group(theirs.params)
            mine.norm_weight.merge(theirs.norm_weight)
            mine.table.merge(theirs.table)
            mine.tembs += [t for t in theirs.tembs if not any(t is u for u in mine.tembs)]
        return self

    def write(self) -> None:
        """Set each recorded parameter's .grad from the exact sums, send d_temb to the kept tembs, forget all."""
        for group in self.groups.values():
            norm_weight, weight, bias = group.params
            for name, p in zip(("norm_weight", "weight", "bias"), group.params):
                if p.requires_grad and p.grad is not None:
                    raise ValueError(f"ExactGradients.write: {name}.grad is set already; zero the gradients with "
                                     "set_to_none=True before the first micro-batch (write sets them once)")
            rows, d_temb, d_weight, d_bias = group.table.gradients(weight, bias.dtype)
            grads = (group.norm_weight.value(norm_weight.dtype), d_weight, d_bias)
            for p, g in zip(group.params, grads):
                if p.requires_grad:
                    p.grad = g.to(p.device)
            _temb_backward(group.tembs, rows, d_temb)
        self.groups.clear()


def _temb_backward(tembs, rows, d_temb) -> None:
    """d_temb of each distinct row through the first kept temb that holds it (zeros elsewhere)."""
    pending = {row_key(r): k for k, r in enumerate(rows)}
    outputs, grads = [], []
    for temb in tembs:
        g = torch.zeros_like(temb)
        for t in range(temb.shape[0]):
            k = pending.pop(row_key(temb[t]), None)
            if k is not None:
                g[t] = d_temb[k].to(temb.dtype)
        outputs.append(temb)
        grads.append(g)
    if not outputs:
        return
    try:
        torch.autograd.backward(outputs, grads)
    except RuntimeError as e:
        if "second time" not in str(e):
            raise
        raise RuntimeError("ExactGradients.write: temb's graph was freed before write (temb also fed ops whose "
                           "backward ran: an H3 model's blocks); exact gradients take a temb that only norm_out "
                           "uses, or a time embedding recomputed at write (not yet)") from e
