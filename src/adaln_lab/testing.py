"""Invariance assertions for your own kernel, ready for pytest; and inputs to try things on.

`make_inputs(S, H=..., D=..., T=...)` builds one call's arguments and an upstream gradient;
`tiny_h3_model()` a small random MiniMax-H3 transformer (diffusers' class) with its forward's inputs, for
`adaln_lab.patch`; `h3_model(config)` and `h3_inputs(model, rows, seed)` the same at any width.

Start with `quick=True` (392 calls at H=256: seconds); the default is the seed's full protocol
(11483 calls at H=5376, batches up to 131072 rows: minutes on a GPU, far longer on a CPU).

    from adaln_lab.testing import assert_batch_invariant

    def test_my_kernel_is_batch_invariant():
        assert_batch_invariant(my_kernel, device="cuda", quick=True)  # small sizes, seconds
        assert_batch_invariant(my_kernel, device="cuda")            # the seed's full protocol

`my_kernel(x, norm_weight, temb, weight, bias, timestep_indices) -> out` must be differentiable by
torch autograd (shapes as in `adaln_lab.final_adaln_out`). The assertion runs the three row checks
and the parameter-gradient repeatability check of `adaln_lab.harness.invariance` and fails in a few
lines: per failed check how many rows differ, the largest |diff| and the first differing row. It
prints an estimate of the work up front (the full protocol times a few calls first) and progress
while it runs, on stderr (`pytest -s` shows them; bars on a terminal, plain lines in a log).
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from .harness import estimate as harness_estimate
from .harness import inputs as protocol_inputs
from .harness.candidates import callable_name
from .harness.invariance import failure_summary
from .harness.protocol import FULL, QUICK, invariance_calls
from .harness.report import batch_invariance

# A MiniMax-H3 transformer at the smallest width that runs: 2 heads of 16 channels (12 of them rotated),
# H and D divisible by 8 as the kernels want; video rows are 4 channels x (1, 2, 2) patches.
TINY_H3 = dict(num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
               ffn_dim=64, in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=16, freq_dim=16,
               time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2)


def make_inputs(S: int, *, H: int = 64, D: int = 32, T: int = 3, seed: int = 0, device="cpu") -> dict:
    """One call's arguments of `adaln_lab.final_adaln_out`, as keywords, plus `dy`, the upstream gradient.

    x (S, H) bf16 (pass `x[None]` for a batch dimension), norm_weight (H,) bf16, temb (T, D) fp32,
    weight (2H, D) bf16, bias (2H,) bf16, timestep_indices (S,) int64 in [0, T), dy (S, H) bf16. The
    leaves do not require grad: set `requires_grad_()` on those you want gradients of. The values are the
    seed protocol's (`adaln_lab.harness.inputs.make`): the same seed gives the same bits.
    """
    for name, value in (("S", S), ("H", H), ("D", D), ("T", T)):
        if not isinstance(value, int) or value < (0 if name == "S" else 1):
            raise ValueError(f"make_inputs: {name} must be an int >= {0 if name == 'S' else 1}, got {value!r}")
    made = protocol_inputs.make(seed, S, device, H=H, D=D, T=T)
    args = dict(x=made.x, norm_weight=made.norm_weight, temb=made.temb, weight=made.weight, bias=made.bias,
                timestep_indices=made.timestep_indices)
    return dict(args, dy=protocol_inputs.upstream(seed, made.x))


def h3_model(config: dict | None = None, seed: int = 0):
    """diffusers' MiniMaxH3Transformer3DModel(**config) (default `TINY_H3`; `{}` is the full width), fp32, seeded
    random weights, its 1-D norm weights drawn in [0.5, 1.5) so that they matter. Needs diffusers 0.42."""
    from .nn.upstream import diffusers_class

    torch.manual_seed(seed)
    model = diffusers_class("MiniMaxH3Transformer3DModel")(**(TINY_H3 if config is None else config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight") and p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def h3_inputs(model, rows: tuple[int, int, int], seed: int, *, batch: int = 1, positions: int = 64,
              upstream: bool = False):
    """Keyword inputs of `model`'s forward (read off its config): `rows` = (text, video, audio) packed rows in a
    shuffled order, three timesteps (0.9, 0.4, 0.0) with a random one per row, `batch` samples, position ids in
    [0, positions) on CPU. With `upstream`: (inputs, (d_sample, d_audio_sample)), randn gradients of the two
    outputs, (batch, video rows, proj_out features) and (batch, audio rows, audio_proj_out features)."""
    g = torch.Generator().manual_seed(seed)
    nt, nv, na = rows
    S = nt + nv + na
    perm = torch.randperm(S, generator=g)
    text, video, audio = perm[:nt].sort().values, perm[nt:nt + nv].sort().values, perm[nt + nv:].sort().values
    tags = torch.empty(S, dtype=torch.long)
    tags[video], tags[text], tags[audio] = 0, 1, 2
    cfg = model.config
    patch = cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2] * cfg.in_channels
    inputs = dict(hidden_states=torch.randn(batch, nv, patch, generator=g),
                  audio_hidden_states=torch.randn(batch, na, cfg.audio_in_channels, generator=g),
                  encoder_hidden_states=torch.randn(batch, nt, cfg.text_dim, generator=g),
                  timestep=torch.tensor([0.9, 0.4, 0.0]), timestep_indices=torch.randint(0, 3, (S,), generator=g),
                  token_tags=tags, position_ids=torch.randint(0, positions, (S, 3), generator=g),
                  video_indices=video, audio_indices=audio, text_indices=text)
    if not upstream:
        return inputs
    return inputs, (torch.randn(batch, nv, model.proj_out.out_features, generator=g),
                    torch.randn(batch, na, model.audio_proj_out.out_features, generator=g))


def checkpoint_layout(model):
    """`model` in a MiniMax-H3 checkpoint's layout, in place: bf16, but its `_keep_in_fp32_modules` float32 (what
    `from_pretrained(torch_dtype=torch.bfloat16)` loads). Returns the model."""
    model.to(torch.bfloat16)
    for name, module in model.named_modules():
        if name and any(key in name for key in getattr(model, "_keep_in_fp32_modules", None) or ()):
            module.float()
    return model


def tiny_h3_model(seed: int = 0, *, rows: tuple[int, int, int] = (5, 8, 4), batch: int = 1):
    """(model, inputs): `h3_model()` at `TINY_H3` and `h3_inputs` of its forward (seed + 1, positions in
    [0, 8)). `model(**inputs).sample` is (batch, video rows, 16). Needs diffusers 0.42 (the test extra)."""
    model = h3_model(TINY_H3, seed)
    return model, h3_inputs(model, rows, seed + 1, batch=batch, positions=8)


def estimate(protocol, quick: bool, device, fn=None) -> str:
    """The up-front line: how much work this call is, and how to make it small. For the full protocol with
    `fn` given, a few calls of `fn` are timed first (`harness.estimate.call_cost`) and the whole run is
    extrapolated from them: "about N min on this device"."""
    calls = invariance_calls(protocol)
    shape = f"H={protocol.H}, D={protocol.D}, T={protocol.T}, batches up to {protocol.full_batch} rows"
    if quick:
        return f"assert_batch_invariant: quick protocol on {device}: ~{calls} calls ({shape}), seconds"
    timed = "; minutes on a GPU, far longer on a CPU"
    if fn is not None:
        total = harness_estimate.seconds(harness_estimate.call_cost(fn, protocol, device),
                                         harness_estimate.invariance_batches(protocol))
        timed = (f"; {harness_estimate.minutes(total)} on this device (extrapolated from calls of 1 and "
                 f"{min(harness_estimate.PROBE_ROWS, protocol.full_batch)} rows)")
    return (f"assert_batch_invariant: full protocol on {device}: ~{calls} calls ({shape}){timed}; "
            f"quick=True runs {invariance_calls(QUICK)} small calls in seconds")


def assert_batch_invariant(fn, *, device="cpu", quick: bool = False, H: int | None = None,
                           D: int | None = None, T: int | None = None) -> dict:
    """Raise AssertionError unless `fn` is bitwise batch-invariant; return the check's report.

    quick=True: small sizes (H=256, D=128, batches up to 512 rows, 392 calls), seconds; try this
    first. quick=False (default): the seed's full protocol, 11483 calls at H=5376 with batches up
    to 131072 rows, minutes on a GPU and far longer on a CPU: a few calls are timed first and the
    estimate ("about N min on this device") printed before it starts. The estimate line and progress
    go to stderr. H, D, T override the protocol's shapes.

    `fn(x (S, H), norm_weight (H,), temb (T, D), weight (2H, D), bias (2H,), timestep_indices (S,)) -> (S, H)`,
    differentiable by torch autograd; an output that is not a tensor of x's shape requiring grad (a tuple,
    a detached tensor) raises TypeError naming `fn` and what it returned.

    The AssertionError is a few lines (at most 6): per failed check how many rows differ in the output
    and in dx (the gradient of x), the largest |diff| and the first differing row; then the checks
    that passed.
    """
    protocol = QUICK if quick else FULL
    protocol = dataclasses.replace(protocol, **{k: v for k, v in (("H", H), ("D", D), ("T", T)) if v is not None})
    print(estimate(protocol, quick, device, None if quick else fn), file=sys.stderr, flush=True)
    report = batch_invariance(fn, protocol, torch.device(device))
    if not report["batch_invariant"]:
        where = f"{'quick' if quick else 'full'} protocol on {device}, H={protocol.H}, D={protocol.D}, T={protocol.T}"
        lines = failure_summary(report)
        failed = len([line for line in lines if not line.startswith("passed:")])
        raise AssertionError("\n".join([f"{callable_name(fn)} is not batch-invariant: {failed} of 4 checks "
                                         f"failed ({where})"] + [f"  {line}" for line in lines]))
    return report
