"""What every op shares: `plan` (every kernel's geometry and every limit, from the shapes alone), `loader`
(kernels_cu -> one `#line`-marked unit -> a RawModule per device and plan), `launchers` (kernels on raw pointers
and a stream; `signatures`, their arguments' kinds), `tensors` (torch's allocations and current stream), `library`
(the custom op, its fake and its eager bypass: the one place where eager and compiled calls part), `support` (the
one rule of what the kernels take, as a route with its reason), `checks` (argument checks), `autocast`, `warnings`.

CuPy is imported at the first compile or launch, never at `import adaln_lab`.
"""
