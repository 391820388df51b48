"""Exact sums of float32 terms, rounded once: the order-free cross-row sums of the exact-gradient contract.

    state = ExactSum(shape, device)            # zero
    state.add(terms)                           # terms (n, *shape) float32: adds the n terms of every element
    state.add(terms, index)                    # terms (n, *shape[1:]), index (n,) int64: term i into row index[i]
    state.add_words(words, exponent)           # integers (n, *shape) int64 worth words 2^exponent (a kernel's states)
    state.merge(other)                         # another part's state, in any order
    state.total()                              # the sum over the first dimension, exact
    products(state, factors)                   # state x float32 factors (broadcast), exactly: a wide state
    state.value(torch.float32 | torch.bfloat16) -> (*shape,) the exact sum, rounded once to nearest even
    ExactSum(shape, device, kernels) / ExactSum.from_limbs(limbs, kernels=kernels)   # carries, products and
                                               # roundings by kernels_cu/exact_state.cu (core.exact_kernels)

Why: integer addition is associative, so a sum kept as integers has one value for every order of its terms, every
split into parts and every order of merging the parts (micro-batches, ranks); float addition has not.

Representation: a finite float32 is m 2^e with |m| < 2^24 and e >= -149 (its subnormal quantum). Scaled by 2^149 it
is an integer below 2^277; the state keeps that integer per element as LIMBS signed int64 limbs of LIMB_BITS bits
(limb k weighs 2^(32 k - 149)). A term lands in two neighbouring limbs (its 24-bit mantissa shifted by up to 31);
after each `add` or `merge` the carries move up so that limbs 0 .. LIMBS - 2 lie in [0, 2^32) and the top limb holds
the sign. Bounds: one `add` takes at most MAX_TERMS terms per element (no limb can overflow before its carry); the
top limb keeps sums up to 2^(32 LIMBS - 149 - 1) = 2^170 in magnitude, far past float32's 2^128 times 2^31 terms.
Non-finite terms raise ValueError (never a wrong sum). `products` multiplies a state by float32 factors exactly: the
result counts in units of 2^(2 E_MIN) in 2 LIMBS limbs (a float32 factor is m 2^(k + E_MIN), m < 2^24, k < 277), a
state of its own (`e_min`) that merges, totals and rounds like the others but takes no terms.

Rounding (`value`): the integer is rounded once to the dtype's precision (24 bits for float32, 8 for bfloat16; their
common least normal exponent -126 sets the subnormal quantum), ties to even; past the largest finite value, inf.
`value` rounds in torch integer ops (`rounded`), checked against the Python-integer reference `round_scaled`. A sum
that is exactly zero is +0. A state with `kernels` (an object with carry / products / rounded and `takes(limbs)`:
core.exact_kernels.ExactKernels) hands those three steps to them where they take its limbs: the same integers and
values in one launch each (products and totals keep the kernels).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .transfers import to_device

LIMB_BITS = 32
LIMBS = 10
E_MIN = -149            # float32's subnormal quantum 2^-149: the state counts in units of it
MAX_TERMS = 2 ** 30     # terms per element in one `add`: each limb gains < 2^32 a term, kept below 2^62
_PRECISION = {torch.float32: 24, torch.bfloat16: 8}  # significand bits; both have float32's exponent range
_EMIN_NORMAL = -126


_RECORDERS: list = []  # the active exact-gradient recorders, innermost last (a module global: torch.compile reads it)


def recorder():
    """The exact-gradient recorder the ops write to (`adaln_lab.nn.ExactGradients` inside its `with`), or None."""
    return _RECORDERS[-1] if _RECORDERS else None


def recording(target) -> None:
    """Make `target` the recorder until `reset_recording()`."""
    _RECORDERS.append(target)


def reset_recording() -> None:
    _RECORDERS.pop()


def refuse_unrecorded(where: str, why: str) -> None:
    """Raise NotImplementedError where an AdaLN would run ops that do not record while an exact-gradient recorder is
    active (its gradients would bypass the exact sums)."""
    if _RECORDERS and torch.is_grad_enabled():
        raise NotImplementedError(f"{where}: {why}: its gradients would not be recorded by adaln_lab.nn."
                                  "ExactGradients (not recorded: diffusers' own forward, adapters, temb dtypes "
                                  "other than float32 / float64 except the projection's on the kernels)")


def all_finite(values: torch.Tensor) -> bool:
    """Whether every element of a float32 / float64 tensor is finite: numpy's one pass on the CPU (torch's isfinite
    makes several there, about 10x the time of this for a block's 96768 factors), torch's elsewhere."""
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        return bool(np.isfinite(values.detach().resolve_neg().numpy()).all())  # a negative view's values
    return bool(torch.isfinite(values).all())


def decompose(terms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, shift) int64 with terms = m 2^(shift + E_MIN) exactly, |m| < 2^24, 0 <= shift < 277 (terms float32)."""
    mantissa, exponent = torch.frexp(terms)             # terms = mantissa 2^exponent, 0.5 <= |mantissa| < 1
    m = (mantissa * 2.0 ** 24).to(torch.int64)          # exact: 24 significant bits
    e = exponent.to(torch.int64) - 24
    under = (E_MIN - e).clamp(min=0)                     # a subnormal: its low bits are zero, shift them out
    return m >> under, e + under - E_MIN


class ExactSum:
    """The exact sum of float32 terms per element of `shape` (module docstring): add, merge, value."""

    def __init__(self, shape, device=None, kernels=None):
        self.limbs = torch.zeros((LIMBS, *shape), dtype=torch.int64, device=device)
        self.e_min = E_MIN  # the unit: limb k weighs 2^(LIMB_BITS k + e_min)
        self.kernels = kernels

    @classmethod
    def from_limbs(cls, limbs: torch.Tensor, e_min: int = E_MIN, kernels=None) -> "ExactSum":
        """A state holding `limbs` (L, *shape) int64 as they are (carried, or carried by the caller), limb k worth
        2^(LIMB_BITS k + e_min): L = LIMBS and e_min = E_MIN for sums of terms, `products`' wide states otherwise;
        `kernels` as the constructor's."""
        out = cls.__new__(cls)
        out.limbs, out.e_min, out.kernels = limbs, e_min, kernels
        return out

    def _kernels(self):
        """The state's kernels where they take its limbs, else None (the torch code)."""
        return self.kernels if self.kernels is not None and self.kernels.takes(self.limbs) else None

    def _terms_state(self, what: str) -> None:
        if self.e_min != E_MIN or self.limbs.shape[0] != LIMBS:
            raise ValueError(f"ExactSum.{what} takes a sum of terms (units 2^{E_MIN}, {LIMBS} limbs), not a product "
                             f"state (units 2^{self.e_min})")

    @property
    def shape(self) -> torch.Size:
        return self.limbs.shape[1:]

    def add(self, terms: torch.Tensor, index: torch.Tensor | None = None) -> "ExactSum":
        """Add terms (n, *shape) float32: the n terms of every element (0 <= n <= MAX_TERMS); with index (n,) int64
        in [0, shape[0]), terms (n, *shape[1:]): term i goes to row index[i] (a table row's sum over its rows)."""
        self._terms_state("add")
        rows = self.shape if index is None else self.shape[1:]
        if terms.dtype != torch.float32 or terms.shape[1:] != rows:
            raise ValueError(f"terms must be float32 of shape (n, {', '.join(map(str, rows))}), got "
                             f"{terms.dtype} {tuple(terms.shape)}")
        if index is not None and (index.shape != terms.shape[:1] or index.dtype != torch.int64
                                  or bool(((index < 0) | (index >= self.shape[0])).any())):
            raise ValueError(f"index must be int64 of shape ({terms.shape[0]},) in [0, {self.shape[0]})")
        if terms.shape[0] > MAX_TERMS:
            raise ValueError(f"at most {MAX_TERMS} terms per element in one add, got {terms.shape[0]}")
        if not all_finite(terms):
            raise ValueError("the terms must be finite: an exact sum of inf or NaN does not exist")
        m, shift = decompose(terms)
        value = m << (shift % LIMB_BITS)                 # |value| < 2^55
        limb = shift // LIMB_BITS
        flat = self.limbs.view(LIMBS * (1 if index is None else self.shape[0]), *rows)
        if index is not None:  # limb k of row r at k * R + r
            limb = limb * self.shape[0] + index.view(-1, *([1] * len(rows)))
            step = self.shape[0]
        else:
            step = 1
        flat.scatter_add_(0, limb, value & (2 ** LIMB_BITS - 1))
        flat.scatter_add_(0, limb + step, value >> LIMB_BITS)  # floor: value = high 2^32 + low part
        return self._carry()

    def add_words(self, words: torch.Tensor, exponent: int) -> "ExactSum":
        """Add integers words (n, *shape) int64 (signed), each worth words 2^exponent: a kernel's fixed-point states
        (a block's sum in units of its quantum 2^exponent; a 128-bit state as its words at exponent, exponent + 64),
        exactly. n <= MAX_TERMS; exponent >= E_MIN and the words' bits within the state's range (ValueError)."""
        self._terms_state("add_words")
        shift = exponent - E_MIN
        if words.dtype != torch.int64 or words.shape[1:] != self.shape:
            raise ValueError(f"words must be int64 of shape (n, {', '.join(map(str, self.shape))}), got "
                             f"{words.dtype} {tuple(words.shape)}")
        if shift < 0 or shift // LIMB_BITS + 3 > LIMBS or words.shape[0] > MAX_TERMS:
            raise ValueError(f"words at 2^{exponent}: the state counts from 2^{E_MIN} in {LIMBS} limbs of "
                             f"{LIMB_BITS} bits, at most {MAX_TERMS} words an element (got {words.shape[0]})")
        limb, offset = divmod(shift, LIMB_BITS)
        low_mask = 2 ** LIMB_BITS - 1
        for k, part in enumerate((words & low_mask, words >> LIMB_BITS)):  # words = high 2^32 + low, low >= 0
            value = part << offset                                           # |value| < 2^63
            self.limbs[limb + k] += (value & low_mask).sum(0)
            self.limbs[limb + k + 1] += (value >> LIMB_BITS).sum(0)
        return self._carry()

    def merge(self, other: "ExactSum", carry: bool = True) -> "ExactSum":
        """Add another state of the same shape (one part's sum): the same result in any order of merging. carry
        False leaves the carries to the caller (`carried`): each merge of carried states adds below 2^32 to a limb,
        so 2^30 of them fit before one carry."""
        if other.shape != self.shape or other.limbs.shape[0] != self.limbs.shape[0] or other.e_min != self.e_min:
            raise ValueError(f"cannot merge a state of shape {tuple(other.shape)} (units 2^{other.e_min}) into "
                             f"{tuple(self.shape)} (units 2^{self.e_min})")
        self.limbs += other.limbs.to(self.limbs.device)
        return self._carry() if carry else self

    def total(self) -> "ExactSum":
        """The exact sum over the first dimension (shape[1:]): every row's terms in one sum (a bias over the
        timesteps' table rows), as exact as the rows."""
        # limbs < 2^32: 2^30 rows fit in int64
        return ExactSum.from_limbs(self.limbs.sum(1), self.e_min, self.kernels)._carry()

    def carried(self) -> "ExactSum":
        """The state with its carries moved up (after merges with carry=False), in place."""
        return self._carry()

    def _carry(self) -> "ExactSum":
        # from the lowest limb up, limb k's carry (its floor / 2^32, carry-in included) joins limb k + 1; then every
        # limb but the top keeps its remainder, one mask for all (the carries read the whole values). In-place ops on
        # views: two a step, no copy back
        limbs = self.limbs
        if self._kernels() is not None:
            self.kernels.carry(limbs)
            return self
        for k in range(limbs.shape[0] - 1):
            limbs[k + 1].add_(limbs[k] >> LIMB_BITS)
        limbs[:-1].bitwise_and_(2 ** LIMB_BITS - 1)
        return self

    def value(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The exact sums rounded once to `dtype` (float32 or bfloat16), to nearest, ties to even."""
        if dtype not in _PRECISION:
            raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        limbs = self.limbs.reshape(self.limbs.shape[0], -1)
        kernels = self._kernels()
        if kernels is not None:
            return kernels.rounded(limbs, _PRECISION[dtype], self.e_min).to(dtype).reshape(self.shape)
        return rounded(limbs, _PRECISION[dtype], self.e_min).to(dtype).reshape(self.shape)


def rounded(limbs: torch.Tensor, precision: int, e_min: int = E_MIN) -> torch.Tensor:
    """`round_scaled(n, e_min, precision)` of every column's integer n of carried limbs (L, n) (limb k worth
    2^(LIMB_BITS k + e_min)), in torch integer ops (float64 results, exact in the target dtype). |n| in
    sign-magnitude limbs; `drop` low bits of it go (those below the target's last kept bit); the kept bits sit in the
    two limbs from bit `drop` up, the round bit is bit drop - 1 and `sticky` any bit below it; ties to even; inf
    past the largest finite value."""
    negative = limbs[-1] < 0
    mag = magnitude(limbs, 2)                                        # every limb below 2^32
    L = mag.shape[0]
    nonzero = mag != 0
    order = torch.arange(L, device=limbs.device).unsqueeze(1)
    k = torch.where(nonzero, order, -1).amax(0)                      # the leading limb (-1: n = 0)
    hi = mag.gather(0, k.clamp(min=0).unsqueeze(0))[0]
    shifts = torch.arange(LIMB_BITS + 1, device=limbs.device).unsqueeze(1)
    length = LIMB_BITS * k.clamp(min=0) + ((hi.unsqueeze(0) >> shifts) > 0).sum(0)  # |n|'s bit length
    top = length - 1 + e_min                                         # the leading bit's exponent
    drop = (torch.clamp(top, min=_EMIN_NORMAL) - (precision - 1) - e_min).clamp(min=0)  # low bits of n to drop

    def limb(j):  # mag's limb j per column, 0 outside [0, L)
        inside = (j >= 0) & (j < L)
        return torch.where(inside, mag.gather(0, j.clamp(0, L - 1).unsqueeze(0))[0], 0)

    j, o = drop // LIMB_BITS, drop % LIMB_BITS
    kept = (limb(j) >> o) | (limb(j + 1) << (LIMB_BITS - o))        # |n| >> drop: below 2^precision
    r = (drop - 1).clamp(min=0)                                      # the round bit's index in |n|
    rj, ro = r // LIMB_BITS, r % LIMB_BITS
    round_limb = limb(rj)
    below = torch.cumsum(nonzero.long(), 0)                          # nonzero limbs at or below each index
    lower = torch.where(rj >= 1, below.gather(0, (rj - 1).clamp(0, L - 1).unsqueeze(0))[0], 0)  # limbs under rj
    sticky = ((round_limb & ((1 << ro) - 1)) != 0) | (lower > 0)
    up = (drop > 0) & (((round_limb >> ro) & 1) == 1) & (sticky | (kept & 1).bool())
    kept = kept + up.long()
    # kept (below 2^25) times 2^(drop + e_min), a normal float64 made from its bits: exact on every device (torch.ldexp
    # multiplies by pow(2, exponent), which CUDA's pow does not always give exactly)
    value = kept.double() * ((drop + e_min + 1023) << 52).view(torch.float64)
    largest = (2 ** precision - 1) * 2.0 ** (128 - precision)
    value = torch.where(value > largest, torch.inf, value)
    value = torch.where(k < 0, 0.0, value)
    return torch.where(negative, -value, value)


def magnitude(limbs: torch.Tensor, spare: int = 0) -> torch.Tensor:
    """|n| of carried limbs (L, ...) as carried limbs (L + spare, ...), every one >= 0: with spare limbs the top one's
    bits past LIMB_BITS move up too."""
    signed = torch.where(limbs[-1] < 0, -limbs, limbs)
    if spare:
        signed = torch.cat([signed, signed.new_zeros((spare, *signed.shape[1:]))])
    return ExactSum.from_limbs(signed.clone())._carry().limbs


def products(state: ExactSum, factors: torch.Tensor) -> ExactSum:
    """The exact products of a sum-of-terms state (shape) and finite float32 `factors` (broadcast to the state's
    shape): a state of 2 LIMBS limbs in units 2^(2 E_MIN) (module docstring), on the state's device. A factor
    m 2^(k + E_MIN) multiplies |n| limb by limb by |m| (each below 2^56), carried, then shifted up k bits (a limb
    below 2^32 moves into two, < 2^63); the sign last."""
    state._terms_state("products")
    factors = factors.to(torch.float32)
    if not all_finite(factors):  # checked where the factors are (CPU ones: no wait for the device)
        raise ValueError("products: the factors must be finite")
    factors = to_device(factors, state.limbs.device).expand(state.shape).contiguous()  # no wait for the device
    if state._kernels() is not None:
        return ExactSum.from_limbs(state.kernels.products(state.limbs, factors), 2 * E_MIN, state.kernels)
    m, shift = decompose(factors)
    negative = (state.limbs[-1] < 0) ^ (m < 0)
    mag = magnitude(state.limbs)
    wide = torch.zeros((2 * LIMBS, *state.shape), dtype=torch.int64, device=state.limbs.device)
    wide[:LIMBS] = mag * m.abs()                                     # |n| |m|, uncarried: each below 2^56
    wide = ExactSum.from_limbs(wide, 2 * E_MIN)._carry().limbs       # limbs in [0, 2^32)
    step, offset = shift // LIMB_BITS, shift % LIMB_BITS             # |n m| 2^shift: limbs up `step`, bits `offset`
    moved = wide << offset                                           # each below 2^63
    out = torch.zeros_like(wide)
    at = torch.arange(2 * LIMBS, device=wide.device).view(-1, *([1] * len(state.shape))) + step
    for part, lift in ((moved & (2 ** LIMB_BITS - 1), 0), (moved >> LIMB_BITS, 1)):
        target = at + lift
        keep = target < 2 * LIMBS  # what lands past the top is zero: |n m| 2^shift < 2^(320 + 24 + 276)
        out.scatter_add_(0, target.clamp(max=2 * LIMBS - 1), torch.where(keep, part, 0))
    out = torch.where(negative, -out, out)
    return ExactSum.from_limbs(out, 2 * E_MIN)._carry()


def round_scaled(n: int, scale: int, precision: int) -> float:
    """n 2^scale rounded to `precision` significant bits (subnormals below 2^-126 in steps of 2^(-126 - precision +
    1)), to nearest, ties to even; inf past the format's largest finite value (float32's exponent range)."""
    if n == 0:
        return 0.0
    a = abs(n)
    top = a.bit_length() - 1 + scale                     # the exponent of the leading bit
    quantum = max(top, _EMIN_NORMAL) - (precision - 1)   # the exponent of the last kept bit
    drop = quantum - scale
    if drop > 0:
        kept, rest = a >> drop, a & ((1 << drop) - 1)
        half = 1 << (drop - 1)
        if rest > half or (rest == half and kept & 1):
            kept += 1
    else:
        kept, quantum = a, scale
    largest = (2 ** precision - 1) * 2.0 ** (128 - precision)
    result = math.ldexp(kept, quantum)                   # exact: kept has at most precision + 1 bits
    result = math.inf if result > largest else result
    return -result if n < 0 else result
