"""The block report: one MiniMax-H3 block's AdaLN parts, timed against their memory floor (issue 11).

The AdaLN parts of diffusers' `MiniMaxH3TransformerBlock` are its modulation table (`adaln_proj`), the
two modulated RMSNorms and the two gated residuals. Attention and feed-forward are replaced by
pass-through maps (`PassThrough`, opaque to torch.compile), so what is timed is exactly the AdaLN
work of one block; every candidate runs the real block forward with those maps:

- `diffusers`: diffusers' block through `torch.func.functional_call`;
- `torch_compile`: the same under `torch.compile` (the pass-through maps are `torch.compiler.disable`d,
  so Inductor sees and may fuse each AdaLN stretch between them, as it would around real attention);
- `adaln_lab`: `adaln_lab.nn.block.AdaLNTransformerBlock` built from the same diffusers block.

Without diffusers the report runs all the same on `ReplayBlock`, adaln_lab's op-for-op replay of
diffusers' block (`reference.block.replay_block_adaln`) with its submodule layout: the diffusers row
is then named `diffusers_replay` (`replay_of`: "diffusers"), the other rows' sources and the golden
(`golden` in the JSON) say they are built on the replay, and a line on stderr says so first.

Per size: CUDA-graph replay time of forward and forward+backward, eager host time, the run's memory
floor (`block_floor_bytes`) and ratios; per candidate the gradients' error against the float64 golden
(diffusers' block run in float64 on the upcast inputs: no rounding anywhere) and whether two
forward+backward passes give bitwise equal gradients.

    python -m adaln_lab block-report --out FILE.json [--quick]

Inputs: x (S, H) bf16, norm1_weight, norm2_weight (H,) bf16, temb (T, D) fp32, weight (18H, D) bf16,
bias (18H,) bf16, adaln_indices (S,) int64 = timestep * 3 + modality tag, in [0, 3T).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from ..reference.block import MODALITIES, replay_block_adaln
from .accuracy import rel_err
from .candidates import REPLAY_ROW, diffusers_missing
from .inputs import H_REAL, D_REAL, T_REAL, PARAMETER_SEED, SALT_X, CallArgs, generator
from .latency import copy_bandwidth, graph_latency, host_latency
from .progress import progress, write as progress_write

EPS = 1e-6
LEAVES = ("x", "norm1_weight", "norm2_weight", "temb", "weight", "bias")
SALTS = {"norm1_weight": 31, "norm2_weight": 32, "temb": 33, "weight": 34, "bias": 35, "dy": 36}
SIZES, QUICK_SIZES = (4097, 32768), (257, 1024)
QUICK_SHAPE = {"H": 256, "D": 128, "T": 3}
WARMUP, ITERS = 10, 30  # calls before timing, samples per CUDA-graph timing
HOST_SAMPLES = 200  # host-time samples per candidate and size: the host's own jitter (tens of us) needs the median
                    # of many; a sample costs a millisecond or two


@dataclass
class BlockInputs(CallArgs):
    """One call's arguments; `leaves` are the six differentiable ones (`LEAVES` order).

    `timestep_indices` is the adaln_indices (the harness's timing functions read that name)."""

    LEAF_NAMES: ClassVar[tuple[str, ...]] = LEAVES
    x: torch.Tensor
    norm1_weight: torch.Tensor
    norm2_weight: torch.Tensor
    temb: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    timestep_indices: torch.Tensor


def make_block(seed: int, n: int, device="cpu", *, H: int = H_REAL, D: int = D_REAL, T: int = T_REAL) -> BlockInputs:
    """x (n, H) bf16 from `seed`; parameters from the fixed parameter seed; adaln_indices t * 3 + tag."""
    device = torch.device(device)

    def randn(*shape, salt, s=PARAMETER_SEED):
        return torch.randn(*shape, generator=generator(device, s, salt), device=device)

    x = (randn(n, H, s=seed, salt=SALT_X) * 2).to(torch.bfloat16)
    norms = [(0.5 + torch.rand(H, generator=generator(device, PARAMETER_SEED, SALTS[name]), device=device))
             .to(torch.bfloat16) for name in ("norm1_weight", "norm2_weight")]
    temb = randn(T, D, salt=SALTS["temb"])
    weight = (randn(6 * MODALITIES * H, D, salt=SALTS["weight"]) * D ** -0.5).to(torch.bfloat16)
    bias = (randn(6 * MODALITIES * H, salt=SALTS["bias"]) * 0.02).to(torch.bfloat16)
    layout = torch.Generator().manual_seed(seed)
    tags = torch.randint(0, MODALITIES, (n,), generator=layout)
    steps = torch.randint(0, T, (n,), generator=layout)
    return BlockInputs(x, *norms, temb, weight, bias, (steps * MODALITIES + tags).to(device))


def block_floor_bytes(S: int, H: int, D: int, T: int) -> dict:
    """Bytes the AdaLN parts must move at least, with attention and FFN opaque between them.

    u = S * H * 2 (one bf16 pass over the rows), W = 18 H D * 2 (the projection weight).
    Forward 9u + W: norm1 reads x, writes h1 (2u); the first gated residual fused with norm2 reads x
    and y1 and writes x1 and h2 (4u); the second gated residual reads x1, y2, writes out (3u).
    Backward 13u + 2W: the second residual's backward reads dout, y2, writes d_y2 (3u); norm2's
    backward fused with the first residual's reads d_h2, x1, dout, y1 and writes dx1, d_y1 (6u); norm1's
    reads d_h1, x, dx1 and writes dx (4u); the table's backward reads W and writes d_weight (2W).
    The small tensors (temb, bias, norm weights, indices, table) are left out: under 1 % here.
    """
    u, W = S * H * 2, 6 * MODALITIES * H * D * 2
    fwd, bwd = 9 * u + W, 13 * u + 2 * W
    return {"fwd_bytes": fwd, "fwd_bwd_bytes": fwd + bwd}


class PassThrough(nn.Module):
    """Attention / feed-forward stand-in: returns its first argument (row-wise, opaque to torch.compile)."""

    @torch.compiler.disable
    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class ReplayBlock(nn.Module):
    """diffusers' `MiniMaxH3TransformerBlock` with pass-through attention and FFN, replayed by adaln_lab
    (`reference.block.replay_block_adaln`, diffusers' ops in diffusers' order) in diffusers' submodule
    layout (norm1, attn, norm2, ff, adaln_proj.linear (18H, D)): the block report's stand-in without diffusers.

    forward(hidden_states (S, H), temb (T, D), adaln_indices (S,) in [0, 3T), rotary_emb, attention_mask=None)
    -> (S, H), diffusers' block output for these attn and ff."""

    def __init__(self, H: int, D: int, eps: float = EPS):
        super().__init__()
        self.norm1, self.attn = nn.RMSNorm(H, eps=eps), PassThrough()
        self.norm2, self.ff = nn.RMSNorm(H, eps=eps), PassThrough()
        self.adaln_proj = nn.Module()
        self.adaln_proj.linear = nn.Linear(D, 6 * MODALITIES * H)

    def forward(self, hidden_states, temb, adaln_indices, rotary_emb, attention_mask=None):
        linear = self.adaln_proj.linear
        return replay_block_adaln(hidden_states, temb, linear.weight, linear.bias, self.norm1.weight,
                                  self.norm2.weight, adaln_indices, lambda h: self.attn(h, rotary_emb, attention_mask),
                                  self.ff, self.norm1.eps, self.norm2.eps)


@functools.lru_cache(maxsize=None)
def _diffusers_block(H: int, D: int):
    """diffusers' block with pass-through attention and FFN, on the meta device; `ReplayBlock` without diffusers."""
    if diffusers_missing() is not None:
        with torch.device("meta"):
            return ReplayBlock(H, D)
    from ..nn.upstream import diffusers_class

    with torch.device("meta"):
        block = diffusers_class("MiniMaxH3TransformerBlock")(H, 1, H, 8, D, norm_eps=EPS, qk_norm_eps=EPS)
    block.attn, block.ff = PassThrough(), PassThrough()
    return block


def _params(norm1_weight, norm2_weight, weight, bias) -> dict:
    return {"norm1.weight": norm1_weight, "norm2.weight": norm2_weight,
            "adaln_proj.linear.weight": weight, "adaln_proj.linear.bias": bias}


def block_call(block: nn.Module):
    """fn(x, norm1_weight, norm2_weight, temb, weight, bias, adaln_indices) -> out: `block`'s forward on
    these tensors as its AdaLN parameters (torch.func.functional_call)."""

    def call(x, norm1_weight, norm2_weight, temb, weight, bias, adaln_indices):
        return torch.func.functional_call(block, _params(norm1_weight, norm2_weight, weight, bias),
                                          (x, temb, adaln_indices, (None, None)))

    return call


def diffusers_block_call(x, norm1_weight, norm2_weight, temb, weight, bias, adaln_indices):
    """diffusers' block forward with pass-through attention and FFN, on these tensors (without diffusers,
    `ReplayBlock`'s)."""
    return block_call(_diffusers_block(x.shape[-1], temb.shape[-1]))(
        x, norm1_weight, norm2_weight, temb, weight, bias, adaln_indices)


def _adaln_lab(H: int, D: int):
    from ..nn.block import AdaLNTransformerBlock

    return block_call(AdaLNTransformerBlock.from_diffusers(_diffusers_block(H, D)))


CANDIDATES = {  # name: (what it runs, build(H, D) -> fn); the builds take ReplayBlock without diffusers
    "diffusers": ("diffusers MiniMaxH3TransformerBlock, attention/FFN pass-through",
                  lambda H, D: block_call(_diffusers_block(H, D))),
    "torch_compile": ("torch.compile (default mode) of the same block",
                      lambda H, D: torch.compile(block_call(_diffusers_block(H, D)))),
    "adaln_lab": ("adaln_lab AdaLNTransformerBlock.from_diffusers of the same block", _adaln_lab),
}
REPLAYED = {  # name: what it runs without diffusers
    "diffusers": "diffusers MiniMaxH3TransformerBlock REPLAYED by adaln_lab (ReplayBlock: "
                 "reference.block.replay_block_adaln), attention/FFN pass-through",
    "torch_compile": "torch.compile (default mode) of adaln_lab's replay of diffusers' block (ReplayBlock)",
    "adaln_lab": "adaln_lab AdaLNTransformerBlock.from_diffusers of adaln_lab's replay of diffusers' block "
                 "(ReplayBlock: diffusers' layout and parameters)",
}


def forward_backward(fn, inputs: BlockInputs, dy: torch.Tensor):
    """(out, {leaf name: grad}) of one call on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    out = fn(*leaves, inputs.timestep_indices)
    out.backward(dy)
    return out.detach(), {name: leaf.grad for name, leaf in zip(LEAVES, leaves)}


def golden(inputs: BlockInputs, dy: torch.Tensor):
    """The float64 golden: diffusers' block in float64 on the upcast inputs (no rounding anywhere)."""
    wide = BlockInputs(*(t.detach().double() for t in inputs.leaves), inputs.timestep_indices)
    return forward_backward(diffusers_block_call, wide, dy.double())


def accuracy(fn, inputs: BlockInputs, dy: torch.Tensor, reference) -> dict:
    """Forward and each gradient's max|err| / max|ref| against the float64 golden; bitwise repeat."""
    out, grads = forward_backward(fn, inputs, dy)
    out2, grads2 = forward_backward(fn, inputs, dy)
    ref_out, ref_grads = reference
    return {"fwd_rel_err": rel_err(out, ref_out),
            "grad_rel_err": {name: rel_err(grads[name], ref_grads[name]) for name in LEAVES},
            "grads_repeat_bitwise": torch.equal(out, out2) and all(torch.equal(grads[n], grads2[n]) for n in LEAVES)}


def measured(result: dict, floor: dict) -> str:
    """The on-screen line of one candidate and size: CUDA-graph times against the floor when there are
    any, and always the host times it measured (on a CPU the graphs are n/a, elsewhere a failed capture
    gives its reason)."""
    def us(key):
        value = result.get(key)
        return "n/a" if value is None else f"{value:.0f}"

    host = f"host fwd {us('host_fwd_us')} us, fwd+bwd {us('host_fwd_bwd_us')} us"
    if result.get("fwd_bwd_us_graph") is not None or result.get("fwd_us_graph") is not None:
        return (f"graph fwd {us('fwd_us_graph')} us, fwd+bwd {us('fwd_bwd_us_graph')} us (floor "
                f"{floor['fwd_us']:.0f} / {floor['fwd_bwd_us']:.0f}); {host}")
    reason = result.get("fwd_bwd_us_graph_error")
    return f"{host} (CUDA graphs: {'n/a on CPU' if reason == 'no CUDA' else reason})"


CPU_FLOOR = "null on a CPU: its torch code does not stream memory at copy bandwidth (the byte counts stand)"


def rows_of(names: list[str], missing: str | None) -> dict:
    """{row name: (candidate name, what it runs)}: without diffusers (`missing`, why) the diffusers row is
    `REPLAY_ROW` and every source says it runs on adaln_lab's replay of diffusers' block."""
    if missing is None:
        return {name: (name, CANDIDATES[name][0]) for name in names}
    return {REPLAY_ROW if name == "diffusers" else name:
            (name, f"{REPLAYED[name]}; diffusers not importable: {missing}") for name in names}


def run_block_report(names: list[str], device: str | torch.device, quick: bool, warmup: int | None = None,
                     iters: int | None = None) -> dict:
    """The block report of candidates `names` (keys of `CANDIDATES`) on `device`, `warmup` calls (default
    `WARMUP`) before `iters` samples (default `ITERS`; `HOST_SAMPLES` at least for host times); runs without
    diffusers (module docstring). Raises ValueError naming an unknown candidate."""
    device = torch.device(device)
    warmup = WARMUP if warmup is None else warmup
    iters = ITERS if iters is None else iters
    shape = QUICK_SHAPE if quick else {"H": H_REAL, "D": D_REAL, "T": T_REAL}
    sizes = QUICK_SIZES if quick else SIZES
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        raise ValueError(f"unknown block candidate(s) {unknown}; known: {', '.join(CANDIDATES)}")
    missing = diffusers_missing()
    golden_text = ("diffusers' block in float64 on the upcast inputs" if missing is None else
                   f"adaln_lab's replay of diffusers' block (ReplayBlock) in float64 on the upcast inputs; diffusers "
                   f"not importable: {missing}")
    if missing is not None:
        progress_write(f"[block report] diffusers not importable ({missing}): every row runs on adaln_lab's replay "
                       f"of diffusers' block, the diffusers row is named {REPLAY_ROW}; "
                       "pip install 'diffusers>=0.42,<0.43' for the real block")
    copy = copy_bandwidth(device, (64 << 20) if quick else (1 << 30))
    report = {"kind": "adaln_lab_block_report", "op": "MiniMaxH3TransformerBlock AdaLN parts", "quick": quick,
              "device": str(device), "shape": shape, "eps": EPS, "copy_TBps": copy, "golden": golden_text,
              "sizes": {}, "notes": {
                  "floor": block_floor_bytes.__doc__.strip(),
                  "fwd_us_graph": "CUDA-graph replay of the forward (harness.latency.graph_latency)",
                  "fwd_bwd_us_graph": "CUDA-graph replay of forward + backward with an all-ones gradient",
                  "grad_rel_err": f"max|err| / max|ref| against the golden ({golden_text}; random dy)",
                  "spread_us": "per timing key, its samples: min, p25, median, p75, max (us) and n",
                  "copy_TBps": "measured copy bandwidth (host memory on a CPU); on a CPU the floor's times are "
                               "null, reason in floor.null_reason"}}
    rows = rows_of(names, missing)
    built = {row: CANDIDATES[name][1](shape["H"], shape["D"]) for row, (name, _) in rows.items()}
    for S in progress(None, "block report sizes", unit="size", leave=True, iterable=sizes):
        inputs = make_block(1, S, device, **shape)
        dy = torch.randn(inputs.x.shape, generator=generator(device, 1, SALTS["dy"]), device=device,
                         dtype=torch.float32).to(torch.bfloat16)
        nbytes = block_floor_bytes(S, **shape)
        if device.type == "cuda":
            floor = {**nbytes, "fwd_us": nbytes["fwd_bytes"] / copy / 1e6,
                     "fwd_bwd_us": nbytes["fwd_bwd_bytes"] / copy / 1e6}
        else:
            floor = {**nbytes, "fwd_us": None, "fwd_bwd_us": None, "null_reason": CPU_FLOOR}
        reference = golden(inputs, dy)
        entry = {"floor": floor, "candidates": {}}
        for row, (name, source) in rows.items():
            fn, spread = built[row], {}
            if name == "adaln_lab" and device.type != "cuda":
                source += f" (on {device.type}: the ops' torch code, not the CUDA kernels)"
            result = {"source": source, **({"replay_of": "diffusers"} if row == REPLAY_ROW else {}),
                      **accuracy(fn, inputs, dy, reference)}
            result.update(host_latency(fn, inputs, warmup, max(iters, HOST_SAMPLES), spread))
            result.update(graph_latency(fn, inputs, warmup, iters, spread=spread))
            result["spread_us"] = spread
            for key in ("fwd", "fwd_bwd"):
                value = result[f"{key}_us_graph"]
                result[f"{key}_graph_x_floor"] = None if value is None else value / floor[f"{key}_us"]
            entry["candidates"][row] = result
            progress_write(f"[block report] S={S} {row}: {measured(result, floor)}")
        base = entry["candidates"].get("adaln_lab", {}).get("fwd_bwd_us_graph")
        for name, result in entry["candidates"].items():
            other = result.get("fwd_bwd_us_graph")
            result["fwd_bwd_graph_x_adaln_lab"] = None if base is None or other is None else other / base
        report["sizes"][str(S)] = entry
        del inputs, reference
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report
