"""The CUDA side: `plan` (every kernel's geometry from the shapes alone), `loader` (kernels_cu -> one
`#line`-marked unit -> a RawModule per device), `launchers` (kernels on raw pointers and a stream) and
`tensors` (torch allocates, torch's current stream). The DLPack array API on top is `adaln_lab.dlpack`.

CuPy is imported at the first compile or launch, never at `import adaln_lab`.
"""
