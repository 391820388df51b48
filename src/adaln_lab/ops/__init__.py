"""The ops, one folder each (`<op>/op.py`: the public function and its one autograd node; `<op>/launch.py`: the
launch ops writing caller-allocated outputs; `<op>/README.md`: the math, the kernels, the limits), and `block`, one
H3 block's AdaLN composed from them. What they share (the plan, the kernel rule, the launch core, the eager / compiled
helper, the warnings) is in `adaln_lab.core`.

The public functions are `adaln_lab.final_adaln_out`, `adaln_lab.modulation_table`, ... (`adaln_lab/__init__.py`);
`adaln_lab.ops.<op>` is the op's folder (a package), so that `adaln_lab.ops.final_adaln_out.launch` and the like
resolve.
"""

from ..core.warnings import KernelFallbackWarning

__all__ = ["KernelFallbackWarning"]
