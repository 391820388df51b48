"""Every warning class adaln_lab raises, in one place (each raised where its condition is met, said once).

- `KernelFallbackWarning`: an op on CUDA tensors ran its torch code because the kernels cannot take the inputs.
- `AdaLNFallbackWarning`: a patched module ran diffusers' own forward (hooks, adapters, offloading, ...);
  `AdaLNOutFallbackWarning`: `AdaLNOut` ran the replay instead of the requested kernels.
- `NothingToPatchWarning`: `patch` found nothing to swap.
- `KernelCacheWarning`: CuPy's kernel cache was unusable; the kernels were compiled in memory.
"""


class KernelFallbackWarning(UserWarning):
    """An op on CUDA tensors ran its torch code because the kernels cannot take the inputs (the message says
    why): diffusers' numerics, parameter gradients summed by atomics (not repeatable run to run)."""


class AdaLNFallbackWarning(UserWarning):
    """A patched module ran diffusers' own forward for a call (the message says why)."""


class AdaLNOutFallbackWarning(AdaLNFallbackWarning):
    """`AdaLNOut` ran the diffusers replay instead of the requested CUDA kernels (the message says why)."""


class NothingToPatchWarning(UserWarning):
    """`patch` found none of the diffusers modules it swaps (and none already swapped) in the model."""


class KernelCacheWarning(UserWarning):
    """CuPy's kernel cache could not be used: the kernels were compiled in memory (the same kernels)."""
