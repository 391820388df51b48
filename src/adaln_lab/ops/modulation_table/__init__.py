"""An H3 block's AdaLN table (`modulation_table`): `op` (the public function and its one autograd node), `launch`
(the launch ops writing caller-allocated outputs); README.md gives the math, the kernels and the limits."""

from .op import modulation_table

__all__ = ["modulation_table"]
