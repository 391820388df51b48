"""The Numba-CUDA twin of kernels_cu: the same plan, reduction order and rounding points, in Python.

`forward` (table, norm_modulate), `backward` (norm_modulate_bwd, reduce_partials, table_bwd) and `op` (the twin
as `final_adaln_out(..., backend="numba")`). numba is imported on first use, never at `import adaln_lab`.
"""
