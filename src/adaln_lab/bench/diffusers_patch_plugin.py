"""pytest plugin: every MiniMaxH3Transformer3DModel is patched by adaln_lab at the end of its __init__, so that
diffusers' own model tests run on the patched model (`pytest -p adaln_lab.bench.diffusers_patch_plugin`, as the
evidence runner's `upstream` step runs them)."""
import functools

import adaln_lab
from diffusers import MiniMaxH3Transformer3DModel

_init = MiniMaxH3Transformer3DModel.__init__


@functools.wraps(_init)
def _patched_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    adaln_lab.patch(self)


MiniMaxH3Transformer3DModel.__init__ = _patched_init
