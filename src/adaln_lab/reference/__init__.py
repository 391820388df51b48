"""Ground truth: diffusers' forwards replayed op for op, float64 goldens, and the analytic backward.

- `final_adaln_out`: norm_out's `replay` (bitwise diffusers' `MiniMaxH3AdaLayerNormOut.forward`) and `golden`.
- `block`: one H3 block's AdaLN (`replay_*`, `golden_*`, `table_chunks`).
- `backward`: the exact derivative of each op, written once; the ops' torch (CPU) kernels are these functions.
"""

from .final_adaln_out import golden, replay, table_reference

__all__ = ["golden", "replay", "table_reference"]
