"""The evidence tooling: the runner and the modules its steps run (bench/README.md).

    python -m adaln_lab.bench STEP[+STEP...] [STEP ...] --out DIR [--base REV|DIR]     (the runner, `runner`)

Modules: `runner` (the command line), `steps` (what each step runs), `context` (a step's commands under its
deadline), `manifest` (MANIFEST.csv), `timing` (CUDA-event and CUDA-graph timers); what the steps run:
`compare_trees`, `sanitize_calls`, `block_profile`, `host_breakdown` (and `host_model`, its CPU stand-in, with
`host_model_ab` comparing two trees), `host_trace`, `train_step`, `multi_gpu`, `diffusers_patch_plugin`, `sweep`,
`memory_figures`. Importing this package imports none of them.
"""
