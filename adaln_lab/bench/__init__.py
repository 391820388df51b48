"""The evidence tooling: the modules bench/device.sh's steps run (bench/README.md), importable by the tests.

`compare_trees`, `sanitize_calls`, `block_profile`, `host_breakdown` (and `host_model`, its CPU stand-in),
`host_trace`, `train_step`, `multi_gpu`, `diffusers_patch_plugin`, `sweep`, `memory_figures`, and `timing` (the
CUDA-event and CUDA-graph timers). Importing this package imports none of them.
"""
