"""Launchers: kernels_cu on raw device pointers, on a given CUDA stream, geometry from the plan.

Two layers:
- `launch_table`, `launch_norm_modulate` and `launch_backward` take device pointers (ints), the plan, its `Rows` and
  a raw stream handle. Whoever allocates (torch in `core.tensors`, CuPy in `adaln_lab.dlpack`) passes pointers in.
- `Kernel`: one kernel's launch through the driver (`cuLaunchKernel`) from a preallocated argument block (its
  arguments' kinds: `signatures.SIGNATURES`), so a launch costs the driver call and a few field writes.

Pointer arguments: x, dy, dx, out (rows, H) bf16 row-major; norm_weight (H,) bf16; temb (T, D)
fp32; weight (2H, D) bf16; bias (2H,) bf16; timestep_indices (S,) int64; rows = x.numel() / H and
row r uses timestep_indices[r % S]. Workspace pieces are laid out by `plan.Rows`.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import threading
from functools import lru_cache

from . import loader
from .plan import ROW_ORDER_THREADS, Plan, Rows
from .signatures import SIGNATURES

_PACK = {"p": "Q", "i": "i4x", "f": "f4x"}  # argument kinds as 8-byte slots: pointer, int32, float32


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
# CUlaunchConfig's head (grid, block, shared memory, then the stream after 4 bytes of padding) in one write
_CONFIG_HEAD = struct.Struct("<7I4xQ")
assert (_LaunchConfig.shared_mem.offset, _LaunchConfig.stream.offset) == (24, 32)


@lru_cache(maxsize=None)
def _launch_kernel_ex():
    """The driver's cuLaunchKernelEx (ctypes): the launch with attributes that CuPy's launch lacks."""
    function = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # config's address
    function.restype = ctypes.c_int
    return function


class Kernel:
    """A compiled kernel launched by `cuLaunchKernel` from an argument block built once.

    `__call__(grid, block, shared_mem, stream, *args)`: grid and block are 3-tuples, stream a raw
    `cudaStream_t` handle (int), args in the order and kinds of `SIGNATURES[name]` (struct.error for a
    wrong count or kind). Thread-safe: a lock covers the one write of the arguments and the launch (the
    driver copies them).
    """

    def __init__(self, name: str, raw_kernel, programmatic: bool = True):
        from cupy.cuda import driver

        self.programmatic = programmatic  # the device takes programmatic dependent launches (sm_90 and later)
        self.name = name
        self.function = raw_kernel.kernel  # keeps the module alive
        self._function_ptr = self.function.ptr  # the CUfunction handle, read once
        self._launch = driver.launchKernel
        kinds = SIGNATURES[name]
        # one 8-byte slot per argument in one buffer, written by a single struct.pack_into per launch
        self._pack = struct.Struct("<" + "".join(_PACK[kind] for kind in kinds)).pack_into
        self._buffer = ctypes.create_string_buffer(8 * len(kinds))
        base = ctypes.addressof(self._buffer)
        self._params = (ctypes.c_void_p * len(kinds))(*[base + 8 * i for i in range(len(kinds))])
        self._params_address = ctypes.addressof(self._params)
        self._lock = threading.Lock()
        self._config = self._head = None  # after_previous's launch configuration and its last (grid, block, ...)

    def _programmatic_config(self) -> _LaunchConfig:
        self._attribute = _LaunchAttribute(PROGRAMMATIC_STREAM_SERIALIZATION, b"", 1)
        config = _LaunchConfig()
        config.attrs, config.num_attrs = ctypes.pointer(self._attribute), 1
        self._config_address, self._launch_ex = ctypes.addressof(config), _launch_kernel_ex()
        self._config, self._config_bytes = config, memoryview(config).cast("B")
        return config

    def __call__(self, grid, block, shared_mem: int, stream: int, *args) -> None:
        self._lock.acquire()  # acquire and release in try / finally: a `with` costs about 0.1 us more (host time)
        try:
            self._pack(self._buffer, 0, *args)  # struct.error for a wrong count or kind
            self._launch(self._function_ptr, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                         shared_mem, stream, self._params_address, 0)
        finally:
            self._lock.release()

    def after_previous(self, grid, block, shared_mem: int, stream: int, *args) -> None:
        """The launch with programmatic stream serialization (PDL, sm_90+): the kernel may start while the
        previous kernel of the stream still runs (from that kernel's `griddepcontrol.launch_dependents` on);
        it must execute `griddepcontrol.wait` before it reads what that kernel writes. On a device before sm_90
        a plain launch (the kernels compile no griddepcontrol there)."""
        if not self.programmatic:
            return self(grid, block, shared_mem, stream, *args)
        head = (grid, block, shared_mem, stream)
        self._lock.acquire()  # one configuration and argument block per kernel, rewritten in place (host time)
        try:
            if head != self._head:  # the configuration's head rewritten only when it changes
                if self._config is None:
                    self._programmatic_config()
                _CONFIG_HEAD.pack_into(self._config_bytes, 0, *grid, *block, shared_mem, stream)
                self._head = head
            self._pack(self._buffer, 0, *args)
            status = self._launch_ex(self._config_address, self._function_ptr, self._params_address, None)
        finally:
            self._lock.release()
        if status:
            from cupy_backends.cuda.api.driver import CUDADriverError

            raise CUDADriverError(status)


_FORGET = []  # caches built on top of these launchers (core.tensors.context), cleared with them


def on_forget(clear) -> None:
    """Have forget_compiled also call `clear` (a cache holding plans or kernels)."""
    _FORGET.append(clear)


def forget_compiled() -> None:
    """Forget every plan, compiled module and launcher (after a change of plan.TUNING or of kernels_cu/)."""
    from . import plan

    plan.clear_caches()
    loader.clear_caches()
    kernels.cache_clear()
    for clear in _FORGET:
        clear()


@contextlib.contextmanager
def tuned(**knobs):
    """plan.TUNING with `knobs` set for the code inside, every plan and compiled kernel forgotten on entry and on
    exit (the shipped values restored)."""
    from . import plan

    saved = {name: plan.TUNING[name] for name in knobs}
    plan.TUNING.update(knobs)
    forget_compiled()
    try:
        yield
    finally:
        plan.TUNING.update(saved)
        forget_compiled()


def bind(device_index: int) -> None:
    """Make the device's primary context current on this thread (the driver launch needs it).

    torch's autograd engine runs the backward on a thread of its own, where torch may never have
    made a CUDA runtime call that binds the context (torch skips setting device 0, the default):
    cuLaunchKernel then fails with CUDA_ERROR_INVALID_CONTEXT. cudaSetDevice binds it; it is cheap
    when the device is already current.
    """
    _set_device()(device_index)


@lru_cache(maxsize=None)
def _set_device():
    from cupy.cuda import runtime

    return runtime.setDevice


@lru_cache(maxsize=None)
def kernels(device_index: int, plan: Plan) -> dict:
    """{name: Kernel} of one plan on one device (compiled on first use; resolved on that device, whatever
    device is current)."""
    import cupy

    with cupy.cuda.Device(device_index) as device:
        programmatic = int(device.compute_capability) >= 90
        return {name: Kernel(name, raw, programmatic) for name, raw in loader.module(device_index, plan).items()}


def launch_table(k: dict, plan: Plan, stream: int, temb: int, weight: int, bias: int, table: int,
                 table_f32: int, act: int) -> None:
    """table (T, N) bf16 (a block's two row tables (2, 3T, 2H) where plan.table_row_tables) and table_f32 (T, N)
    fp32 = linear(bf16(silu(temb)), weight, bias), N = plan.columns; act (T, D) bf16 scratch: bf16(silu(temb)),
    written by table_act, then read by table_bf16 (launched with PDL: its weight loads start before act is done)."""
    k["table_act"]((plan.table_act_grid, 1, 1), (256, 1, 1), 0, stream, temb, act)
    k["table_bf16"].after_previous((*plan.table_grid, 1), (plan.table_threads, 1, 1), 0, stream,
                                   act, weight, bias, table, table_f32)


def launch_norm_modulate(k: dict, plan: Plan, rows: Rows, stream: int, x: int, norm_weight: int, table: int,
                         timestep_indices: int, out: int, rstd: int, S: int, eps: float,
                         after_table: bool = False) -> None:
    """out (rows, H) bf16 and rstd (rows,) fp32 from x and the bf16 table; nothing when rows == 0. after_table:
    launch_table wrote the table just before on this stream (the row-per-warp kernel may then start early:
    plan.fwd_pdl)."""
    if not rows.rows:
        return
    if plan.fwd_warp:
        kernel = k["norm_modulate_warp_bf16"]
        launch = kernel.after_previous if after_table and plan.fwd_pdl else kernel.__call__
        launch((-(-rows.rows // plan.fwd_warp_rows), 1, 1), (32 * plan.fwd_warp_rows, 1, 1), 0, stream, x,
               norm_weight, table, timestep_indices, out, rstd, S, eps, rows.rows, 1)
    elif plan.fwd_staged:
        k["norm_modulate_bf16"]((rows.fwd_ranges, 1, 1), (plan.fwd_threads, 1, 1), plan.fwd_smem, stream,
                                x, norm_weight, table, timestep_indices, out, rstd, S, eps, rows.rows,
                                rows.fwd_rows_per_range)
    else:
        k["norm_modulate_rowwise_bf16"]((rows.rows, 1, 1), (plan.fwd_threads, 1, 1), 0, stream,
                                        x, norm_weight, table, timestep_indices, out, rstd, S, eps, rows.rows, 1)


def launch_row_pass(k: dict, plan: Plan, rows: Rows, stream: int, dy: int, x: int, rstd: int, norm_weight: int,
                    table_f32: int, timestep_indices: int, dx: int, row_partials: int, S: int) -> None:
    """dx and row_partials (bwd_ranges, T, 2, H) fp32 (norm_out's pass per timestep); with no rows, one range
    of zero partials instead. table_f32: (T, 2H) shift | scale. Not where plan.bwd_sorted: its workspace holds
    bwd_ranges + T slots (launch_sorted_row_pass)."""
    assert not plan.bwd_sorted, "plan.bwd_sorted: launch_sorted_row_pass"
    stride = 2 * plan.H
    if rows.rows:
        k["norm_modulate_bwd_bf16"]((rows.bwd_ranges, 1, 1), (plan.bwd_threads, 1, 1), plan.bwd_smem, stream,
                                    dy, x, rstd, norm_weight, table_f32, timestep_indices, dx, row_partials,
                                    S, rows.rows, rows.bwd_rows_per_range, stride)
    else:
        from cupy.cuda import runtime

        runtime.memsetAsync(row_partials, 0, plan.T * 2 * plan.H * 4, stream)


def launch_row_order(k: dict, plan: Plan, stream: int, row_index: int, row_order: int, S: int,
                     scratch: int = 0) -> None:
    """row_order (T + 1 + S,) int32 = row_order.cu's row_offsets (T + 1,) | order (S,) of row_index (S,) int64:
    the positions sorted by table row, stably (T = plan.T table rows). plan.row_order_wide: three kernels over
    chunks of positions, with `scratch` of plan.row_order_scratch(S) bytes."""
    order = row_order + 4 * (plan.T + 1)
    if not plan.row_order_wide:
        k["row_order"]((1, 1, 1), (ROW_ORDER_THREADS, 1, 1), plan.row_order_smem(S), stream, row_index, row_order,
                       order, S)
        return
    assert scratch, "plan.row_order_wide: row_order needs its scratch (plan.row_order_scratch)"
    chunk, chunks = plan.row_order_chunking(S)
    k["row_order_count"]((chunks, 1, 1), (256, 1, 1), 4 * plan.T, stream, row_index, scratch, S, chunk, chunks)
    k["row_order_scan"]((1, 1, 1), (ROW_ORDER_THREADS, 1, 1), 0, stream, scratch, row_order, S, chunks)
    k["row_order_scatter"]((-(-chunks // 4), 1, 1), (128, 1, 1), 16 * plan.T, stream, row_index, scratch, order,
                           S, chunk, chunks)


def sorted_slots(plan: Plan, rows: Rows) -> int:
    """Slots of partial sums of the sorted row passes: range b's sums of table row t in slot b + t."""
    return rows.bwd_ranges + plan.T


def _batches(rows: Rows, S: int) -> int:
    return rows.rows // S if S else 0


def launch_sorted_row_pass(k: dict, plan: Plan, rows: Rows, stream: int, dy: int, x: int, rstd: int,
                           norm_weight: int, table_f32: int, row_index: int, row_order: int, dx: int,
                           row_partials: int, S: int, d_residual: int = 0, table_stride: int = 0) -> None:
    """dx and row_partials (sorted_slots, 2, H) fp32 over the rows in table-row order (row_order from
    launch_row_order); the slots no range writes are never read. With d_residual (rows, H) bf16 (needs
    plan.bwd_res_stages), dx = bf16(bf16(the norm's dx) + d_residual). Nothing when rows == 0."""
    if not rows.rows:
        return
    stride = table_stride or 2 * plan.H
    if d_residual:
        k["norm_modulate_bwd_residual_sorted_bf16"]((rows.bwd_ranges, 1, 1), (plan.bwd_threads, 1, 1),
                                                    plan.bwd_res_smem, stream, dy, x, d_residual, rstd, norm_weight,
                                                    table_f32, row_index, row_order, dx, row_partials, S, rows.rows,
                                                    rows.bwd_rows_per_range, stride)
    else:
        k["norm_modulate_bwd_sorted_bf16"]((rows.bwd_ranges, 1, 1), (plan.bwd_threads, 1, 1), plan.bwd_smem,
                                           stream, dy, x, rstd, norm_weight, table_f32, row_index, row_order, dx,
                                           row_partials, S, rows.rows, rows.bwd_rows_per_range, stride)


def launch_reduce_sorted_partials(k: dict, plan: Plan, rows: Rows, stream: int, row_partials: int, norm_weight: int,
                                  table_f32: int, d_shift: int, d_scale: int, d_norm_weight: int, d_bias: int,
                                  row_order: int, S: int, table_stride: int, d_stride: int = 0) -> None:
    """d_shift, d_scale (T, H) fp32 (row stride d_stride floats, default H), d_norm_weight (H,) and d_bias (2H,)
    bf16 from launch_sorted_row_pass's partials, in a fixed order (zeros when rows == 0)."""
    k["reduce_partials_sorted_bf16"]((-(-plan.H // 32), 1, 1), (32, plan.sum_groups, 1), 0, stream, row_partials,
                                     norm_weight, table_f32, d_shift, d_scale, d_norm_weight, d_bias, row_order,
                                     _batches(rows, S), max(rows.bwd_rows_per_range, 1), table_stride or 2 * plan.H,
                                     d_stride or plan.H)


def launch_reduce_partials(k: dict, plan: Plan, rows: Rows, stream: int, row_partials: int, norm_weight: int,
                           table_f32: int, d_table: int, d_norm_weight: int, d_bias: int) -> None:
    """d_table (T, 2H) fp32 = d_shift | d_scale, d_norm_weight and d_bias from the row partials, in a fixed
    order. table_f32 as launch_row_pass's."""
    assert not plan.bwd_sorted, "plan.bwd_sorted: launch_reduce_sorted_partials"
    k["reduce_partials_bf16"]((-(-plan.H // 32), 1, 1), (32, plan.sum_groups, 1), plan.rp_smem, stream,
                              row_partials, norm_weight, table_f32, d_table, d_table + 4 * plan.H, d_norm_weight,
                              d_bias, max(rows.bwd_ranges, 1), 2 * plan.H, 2 * plan.H)


def launch_table_bwd(k: dict, plan: Plan, stream: int, d_table: int, temb: int, weight: int, d_weight: int,
                     dact_partials: int, d_temb: int, d_bias: int = 0) -> None:
    """d_weight and d_temb (and d_bias (N,) bf16 = the t-sum of d_table, if given) from d_table: table_bwd_bf16
    (or, where plan.tb_split, its two halves table_bwd_d_weight_bf16 and table_bwd_dact_bf16: the same sums; where
    plan.tb_mma, table_bwd_mma.cu's terms and halves on tensor cores), then table_bwd_reduce's ordered sum.
    dact_partials: table_bwd's workspace of plan.tb_bytes (the partials, then on tensor cores the terms)."""
    if plan.tb_mma:  # on tensor cores (table_bwd_mma.cu): the terms once, then the halves; blocks of 128 threads
        terms = dact_partials + plan.tb_terms_at
        g = plan.tbm_grids
        k["table_bwd_mma_terms"](g[0] + (1,), (128, 1, 1), 0, stream, d_table, temb, terms, d_bias)
        k["table_bwd_mma_d_weight"](g[1] + (1,), (128, 1, 1), 0, stream, terms, d_weight)
        k["table_bwd_mma_dact"](g[2] + (1,), (128, 1, 1), 0, stream, terms, weight, dact_partials)
    else:
        grid, block = plan.tb_grid + (1,), (plan.tb_threads, 1, 1)
        for name in loader.TB_HALVES if plan.tb_split else loader.TB_FUSED:
            k[name](grid, block, 0, stream, d_table, temb, weight, d_weight, dact_partials, d_bias)
    k["table_bwd_reduce"]((-(-plan.D // 32), plan.T, 1), (32, plan.sum_groups, 1), 0, stream,
                          dact_partials, temb, d_temb, plan.blocks_j)


def launch_backward(k: dict, plan: Plan, rows: Rows, stream: int, dy: int, x: int, rstd: int, norm_weight: int,
                    table_f32: int, timestep_indices: int, temb: int, weight: int, workspace: int, dx: int,
                    d_norm_weight: int, d_temb: int, d_weight: int, d_bias: int, S: int) -> None:
    """dx and the four parameter gradients; every reduction in a fixed order (see kernels_cu/).

    `workspace` holds rows.bwd_bytes bytes laid out by `rows.bwd_offsets`. With no rows the row
    pass launches nothing and every parameter gradient is exactly zero: the unsorted pass zeroes one
    range of partials, the sorted one (plan.bwd_sorted) sorts no positions, so its reduce reads no slot.
    """
    o = rows.bwd_offsets
    row_partials, d_table = workspace + o["row_partials"], workspace + o["d_table"]
    if plan.bwd_sorted:  # the rows in timestep order (plan.bwd_sorted): bwd_ranges + T partial slots
        order = workspace + o["row_order"]  # T + 1 + rows int32: with no rows an order of no positions (zero sums)
        launch_row_order(k, plan, stream, timestep_indices, order, S if rows.rows else 0,
                         workspace + o["row_order_scratch"] if plan.row_order_wide else 0)
        launch_sorted_row_pass(k, plan, rows, stream, dy, x, rstd, norm_weight, table_f32, timestep_indices, order,
                               dx, row_partials, S)
        launch_reduce_sorted_partials(k, plan, rows, stream, row_partials, norm_weight, table_f32, d_table,
                                      d_table + 4 * plan.H, d_norm_weight, d_bias, order, S, 2 * plan.H, 2 * plan.H)
    else:
        launch_row_pass(k, plan, rows, stream, dy, x, rstd, norm_weight, table_f32, timestep_indices, dx,
                        row_partials, S)
        launch_reduce_partials(k, plan, rows, stream, row_partials, norm_weight, table_f32, d_table, d_norm_weight,
                               d_bias)
    launch_table_bwd(k, plan, stream, d_table, temb, weight, d_weight, workspace + o["dact_partials"], d_temb)


def launch_gated_residual(k: dict, plan: Plan, rows: Rows, stream: int, x: int, gate: int, y: int, row_index: int,
                          out: int, gate_stride: int, S: int) -> None:
    """out (rows, H) bf16 = x + bf16(gate[i]) * y (diffusers' bf16 roundings); gate (T, H) fp32, row
    stride gate_stride floats, T = plan.T table rows; nothing when rows == 0."""
    if not rows.rows:
        return
    vectors = rows.rows * plan.H // 8
    k["gated_residual_fwd_bf16"]((-(-vectors // plan.gr_threads), 1, 1), (plan.gr_threads, 1, 1), 0, stream,
                                 x, gate, y, row_index, out, gate_stride, S, rows.rows)


def launch_gated_residual_bwd(k: dict, plan: Plan, rows: Rows, stream: int, dout: int, gate: int, y: int,
                              row_index: int, row_order: int, d_y: int, gate_partials: int, d_gate: int,
                              gate_stride: int, S: int, d_stride: int = 0) -> None:
    """d_y (rows, H) bf16 and d_gate (T, H) fp32 (row stride d_stride floats, default H) over the rows in
    table-row order (row_order from launch_row_order); gate_partials holds sorted_slots * H floats. With no rows
    d_gate is exactly zero."""
    if rows.rows:
        k["gated_residual_bwd_sorted_bf16"]((rows.bwd_ranges, -(-plan.H // (8 * plan.gr_threads)), 1),
                                            (plan.gr_threads, 1, 1), 0, stream, dout, gate, y, row_index, row_order,
                                            d_y, gate_partials, gate_stride, S, rows.rows, rows.bwd_rows_per_range)
    k["gated_residual_reduce_sorted"]((-(-plan.H // 32), 1, 1), (32, plan.sum_groups, 1), 0, stream,
                                      gate_partials, d_gate, row_order, _batches(rows, S),
                                      max(rows.bwd_rows_per_range, 1), d_stride or plan.H)


def launch_gated_residual_norm(k: dict, plan: Plan, rows: Rows, stream: int, x: int, gate: int, y: int,
                               row_index: int, norm_weight: int, table: int, x_out: int, out: int, rstd: int,
                               gate_stride: int, S: int, eps: float) -> None:
    """x_out = x + bf16(gate[i]) * y and out, rstd = the modulated norm of x_out (gated_residual_norm.cu): the
    bits of launch_gated_residual then launch_norm_modulate; nothing when rows == 0."""
    if rows.rows:
        k["gated_residual_norm_bf16"]((rows.rows, 1, 1), (plan.fwd_threads, 1, 1), 0, stream, x, gate, y, row_index,
                                      norm_weight, table, x_out, out, rstd, gate_stride, S, eps, rows.rows)
