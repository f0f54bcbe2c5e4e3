"""The Gluon decode stage 1s (``kernels/gluon_decode.py``, ``kernels/gluon_decode_ws.py``, and the tile functions of
``kernels/gluon_tiles.py`` they call) run in Triton's CPU interpreter, for the contract tests.

Gluon has no interpreter. Its kernels are Python functions over tensors whose layouts say where each element
lives (which thread, which register), never what it is, so Triton's interpreter can run them with the layouts
dropped: this module re-binds each ``@gluon.jit`` function's code to a namespace where ``gl`` is Triton's
language minus the layouts, shared memory is a NumPy array, an asynchronous copy is a masked load done at once
(and its waits and the barriers nothing), and ``mma_v2`` is a float32 matrix product (exact products of fp16 or
tf32 operands, float32 sums, as on the tensor cores up to the order of the sums).

What the layouts do decide is the inline PTX: an ``asm`` block acts on a thread's registers, ``pack`` of them at a
time, in the order its layout gives. Each block of the kernel is emulated by what it computes on the tensor:
``ex2.approx.ftz`` is ``exp2`` with results below ``2**-126`` flushed to 0; ``_h_of`` is its series below 1/4 and
``(exp(x) - 1 - x) / max(x^2, 1/16)`` through that ``exp2`` and a reciprocal flushed alike from 1/4 on, NaN read as
+inf, per element (its branch only skips work); the output's rescale is ``acc * alpha``; ``_neg_codes`` is ``-(byte -
128)`` per element; ``_v_split`` is ``s * code`` rounded to fp16 (exact for V's scales) for each byte of a 16-bit pair
of V codes, with the scale from the half of the token's scale word that its group selects (``_V_FRAGMENT`` pairs two
tokens in a register, and the block's ``f16x2`` outputs keep them so: no element moves); ``_transposed_blocks``
(``movmatrix``) transposes each 8x8 block of a warp's ``[16, 8]``, which ``_p_operand`` relabels back. An asm block
not listed here raises. So the emulation checks the kernel's algorithm (tiling, masks, the copies' addressing, online
softmax, the certificate's cells, singletons and merges of held tokens, the relabelled operands) against the
reference; the PTX itself is checked by the SASS tests when compiled and by the GPU tests when run, and the operand
blocks' and ``_h_of``'s text against these emulations by ``tests/ptx_subset.py``.

A warp-specialised kernel (``kernels/gluon_decode_ws.py``) runs its partitions as threads that take turns, one at
a time: a partition runs until it waits on an mbarrier whose phase has not completed, then hands over to the
next. An mbarrier is a count of pending arrivals and of completed phases; ``wait(bar, phase)`` passes once the
phase of that parity has completed, as ``mbarrier.try_wait.parity``. A copy lands at once, so an ``expect`` is just
its arrival, and ``cp.async.mbarrier.arrive.noinc`` arrives for every thread of the partition that calls it.
Partitions that all wait with nothing left to run raise (a deadlock).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import types
from collections.abc import Callable

import numpy as np
import triton.language as tl
from triton.experimental.gluon._runtime import GluonJITFunction
from triton.runtime.interpreter import InterpretedFunction, TensorHandle, _get_np_dtype


def _value(x: object) -> object:
    return x.value if isinstance(x, tl.constexpr) else x


def _index(x: object) -> int:
    x = _value(x)
    return int(x.handle.data.reshape(-1)[0]) if isinstance(x, tl.tensor) else int(x)


def _tensor(data: np.ndarray, dtype: tl.dtype) -> tl.tensor:
    data = np.ascontiguousarray(data.astype(_get_np_dtype(dtype), copy=False))
    return tl.tensor(TensorHandle(data, dtype), tl.block_type(dtype, list(data.shape)))


def linear_coordinate(bases: list[list[int]], bits: int) -> tuple[int, ...]:
    """The coordinate that the set bits of ``bits`` select in a linear layout: the XOR of their ``bases`` (a
    register, lane or warp index of a distributed layout, or a byte offset of a shared one)."""
    coordinate = [0] * len(bases[0])
    for i, basis in enumerate(bases):
        if bits >> i & 1:
            coordinate = [c ^ b for c, b in zip(coordinate, basis, strict=True)]
    return tuple(coordinate)


class _Shared:
    """A shared-memory buffer (or a view of one): ``index`` and ``slice`` view, ``load`` copies out."""

    def __init__(self, data: np.ndarray, dtype: tl.dtype) -> None:
        self.data, self.dtype = data, dtype

    def index(self, i: object) -> _Shared:
        return _Shared(self.data[_index(i)], self.dtype)

    def slice(self, start: object, length: object, dim: int = 0) -> _Shared:
        begin = _index(start)
        view = [slice(None)] * self.data.ndim
        view[_index(dim)] = slice(begin, begin + _index(length))
        return _Shared(self.data[tuple(view)], self.dtype)

    def load(self, layout: object = None) -> tl.tensor:
        return _tensor(self.data.copy(), self.dtype)

    def reinterpret(self, dtype: object, shape: list, layout: object = None) -> _Shared:
        dtype = _value(dtype)
        return _Shared(self.data.view(_get_np_dtype(dtype)).reshape([_index(n) for n in shape]), dtype)

    def store(self, value: tl.tensor) -> None:
        self.data[...] = value.handle.data


def _allocate_shared_memory(element_ty: tl.dtype, shape: list, layout: object, value: tl.tensor | None = None):
    element_ty = _value(element_ty)
    buffer = _Shared(np.zeros([_index(n) for n in shape], dtype=_get_np_dtype(element_ty)), element_ty)
    if value is not None:
        buffer.store(value)
    return buffer


def _async_load(smem: _Shared, pointer: tl.tensor, mask: tl.tensor | None = None, **_: object) -> None:
    if mask is None:
        smem.store(tl.load(pointer))
    else:
        smem.store(tl.load(pointer, mask=mask, other=0))


def _mma_v2(a: tl.tensor, b: tl.tensor, acc: tl.tensor, input_precision: object = None, **_: object) -> tl.tensor:
    product = np.matmul(a.handle.data.astype(np.float32), b.handle.data.astype(np.float32))
    return _tensor(product + acc.handle.data, tl.float32)


def _exp2_ftz(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        result = np.exp2(x.astype(np.float32))
    return np.where(np.abs(result) < np.float32(2.0**-126), np.float32(0.0), result)


def _h_of(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        series = x * np.float32(1 / 720) + np.float32(1 / 120)
        for coefficient in (1 / 24, 1 / 6, 0.5):
            series = series * x + np.float32(coefficient)
        g = (_exp2_ftz(x * np.float32(1.4426950408889634)) - np.float32(1.0)) - x
        reciprocal = np.float32(1.0) / np.maximum(x * x, np.float32(1 / 16))
        reciprocal = np.where(reciprocal < np.float32(2.0**-126), np.float32(0.0), reciprocal)
        big = g * reciprocal
    return np.where(x >= np.float32(0.25), np.where(np.isnan(big), np.float32(np.inf), big), series)


def _neg_codes(codes: np.ndarray) -> np.ndarray:
    return -(codes.astype(np.float32) - 128.0)


def _v_split(pairs: np.ndarray, words: np.ndarray) -> tuple[np.ndarray, ...]:
    """``[warp, token, 32]`` 16-bit pairs of stored V bytes and the tokens' scale words -> ``(even, odd)``: ``s *
    code`` rounded to fp16 (exact for V's scales of 4 significant bits) of the low byte (even index) and the high byte
    (odd), element by element, ``s`` the word's low half where pair j's group ``j // 8`` is even, its high half where
    odd (``gluon_tiles._v_split``)."""
    stored = pairs.astype(np.int16).view(np.uint16)
    odd_group = (np.arange(pairs.shape[-1]) // 8) % 2 == 1
    scale_bits = np.where(odd_group, words.astype(np.int64) >> 16, words.astype(np.int64)) & 0xFFFF
    scales = scale_bits.astype(np.uint16).view(np.float16).astype(np.float64)
    # The product of two fp16 values is exact in float64: one rounding to fp16, as mul.rn.f16x2.
    codes = (stored & 0xFF, stored >> 8)
    return tuple(((code.astype(np.float64) - 128.0) * scales).astype(np.float16) for code in codes)


def _transposed_blocks(x: np.ndarray) -> np.ndarray:
    """``[warp, 16, 8]`` -> each 8x8 block transposed (``gluon_tiles._transposed_blocks``)."""
    warps, rows, cols = x.shape
    return x.reshape(warps, rows // 8, 8, cols).transpose(0, 1, 3, 2).reshape(warps, rows, cols)


def _rescale(acc: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    return acc.astype(np.float32) * alpha.astype(np.float32)


def _inline_asm_elementwise(asm, constraints, args, dtype, is_pure, pack):
    """The kernel's asm blocks, each by what it computes on whole tensors (the module docstring)."""
    asm = _value(asm)
    data = [arg.handle.data for arg in args]
    if "movmatrix.sync.aligned.m8n8.trans.b16" in asm:
        return _tensor(_transposed_blocks(data[0]), tl.float16)
    if "@small bra SERIES" in asm:
        return _tensor(_h_of(data[0]), tl.float32)
    if "ex2.approx.ftz.f32" in asm:
        return _tensor(_exp2_ftz(data[0]), tl.float32)
    if "@p bra SKIP" in asm:
        return _tensor(_rescale(*data), tl.float32)
    if "sub.rn.f16x2 $0, offset, $0" in asm:
        return _tensor(_neg_codes(data[0]), tl.float16)
    if "prmt.b32 even, $4, 0x64646464, 0x4240" in asm:
        return tuple(_tensor(x, tl.float16) for x in _v_split(*data))
    raise NotImplementedError(f"gluon_emulation: no emulation for this asm block:\n{asm}")


def _no_layout(*_: object, **__: object) -> None:
    """Layout constructors: the emulation has no layouts."""
    return None


def _noop(*_: object, **__: object) -> None:
    return None


class _Partitions:
    """A warp-specialised region: partition threads that take turns (one holds the turn at a time), and the
    mbarriers' state, keyed by each barrier's address in the emulated shared memory."""

    def __init__(self) -> None:
        self.turn = threading.Condition()
        self.holder: int | None = None
        self.order: list[int] = []  # running partitions' threads, in partition order
        self.waiting: set[int] = set()  # partitions that found their phase incomplete since the last arrival
        self.local = threading.local()
        self.barriers: dict[int, list[int]] = {}  # address -> [count, pending arrivals, completed phases]

    @staticmethod
    def _key(barrier: _Shared) -> int:
        return barrier.data.__array_interface__["data"][0]

    def init(self, barrier: _Shared, count: object) -> None:
        self.barriers[self._key(barrier)] = [_index(count), _index(count), 0]

    def arrive(self, barrier: _Shared, count: int) -> None:
        state = self.barriers[self._key(barrier)]
        state[1] -= count
        if state[1] <= 0:
            state[1] = state[0]
            state[2] += 1
        self.waiting.clear()

    def threads(self) -> int:
        """Threads of the partition running (a cp.async arrival is one per thread)."""
        return getattr(self.local, "threads", 1)

    def _pass_turn(self, me: int) -> None:
        position = self.order.index(me)
        self.holder = self.order[(position + 1) % len(self.order)]
        self.turn.notify_all()

    def wait(self, barrier: _Shared, phase: object) -> None:
        parity = _index(phase) & 1
        me = threading.get_ident()
        with self.turn:
            while self.barriers[self._key(barrier)][2] % 2 == parity:
                if me not in self.order:
                    raise RuntimeError("gluon_emulation: an mbarrier wait outside a warp-specialised region")
                self.waiting.add(me)
                if self.waiting >= set(self.order):
                    raise RuntimeError("gluon_emulation: every partition waits on an mbarrier (a deadlock)")
                self._pass_turn(me)
                while self.holder != me:
                    self.turn.wait()

    def run(self, functions_and_args: list, warps: list[int]) -> object:
        """Run the partitions, partition 0 first, each until it waits or ends; partition 0's result."""
        results: dict[int, object] = {}
        errors: list[BaseException] = []

        def partition(index: int, function: Callable, args: tuple) -> None:
            me = threading.get_ident()
            self.local.threads = 32 * warps[index]
            with self.turn:
                while self.holder != me:
                    self.turn.wait()
            try:
                results[index] = function(*args)
            except BaseException as error:  # re-raised by the caller
                errors.append(error)
            finally:
                with self.turn:
                    if len(self.order) > 1:
                        self._pass_turn(me)
                    self.order.remove(me)
                    self.waiting.discard(me)
                    self.turn.notify_all()

        threads = [
            threading.Thread(target=partition, args=(i, fn, tuple(args)), daemon=True)
            for i, (fn, args) in enumerate(functions_and_args)
        ]
        with self.turn:
            for thread in threads:
                thread.start()
            self.order = [thread.ident for thread in threads]
            self.waiting.clear()
            self.holder = self.order[0]
            self.turn.notify_all()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results[0]


_PARTITIONS = _Partitions()


def _mbarrier_arrive(barrier: _Shared, *, count: object = 1, pred: object = True, **_: object) -> None:
    """``mbarrier.arrive``: the partition's one arrival (the compiled code makes one thread arrive after its
    warps met)."""
    if _index(pred):
        _PARTITIONS.arrive(barrier, _index(count))


def _mbarrier_expect(barrier: _Shared, *_: object, pred: object = True, **__: object) -> None:
    if _index(pred):
        _PARTITIONS.arrive(barrier)  # mbarrier.arrive.expect_tx: the copies it expects have landed


def _copies_arrive(barrier: _Shared, increment_count: object = True) -> None:
    """``cp.async.mbarrier.arrive``: one arrival per thread of the partition, its copies having landed."""
    _PARTITIONS.arrive(barrier, _PARTITIONS.threads())


_MBARRIER = types.SimpleNamespace(
    init=lambda barrier, count: _PARTITIONS.init(barrier, count),
    invalidate=lambda barrier: None,
    wait=lambda barrier, phase, pred=True, deps=(): _PARTITIONS.wait(barrier, phase) if _index(pred) else None,
    arrive=_mbarrier_arrive,
    expect=_mbarrier_expect,
    MBarrierLayout=lambda *_, **__: None,
)


class _Language(types.ModuleType):
    """``gl`` without layouts: Triton's language (looked up when called, so the interpreter's patches apply)
    with the Gluon-only calls emulated."""

    def __getattr__(self, name: str) -> object:
        return getattr(tl, name)


_GL = _Language("gluon_emulated_language")
_GL.arange = lambda start, end, layout=None: tl.arange(start, end)
_GL.full = lambda shape, value, dtype, layout=None: tl.full(shape, value, dtype)
_GL.zeros = lambda shape, dtype, layout=None: tl.zeros(shape, dtype)
_GL.convert_layout = lambda value, layout=None, assert_trivial=False: value
_GL.allocate_shared_memory = _allocate_shared_memory
_GL.inline_asm_elementwise = _inline_asm_elementwise
_GL.thread_barrier = _GL.barrier = _noop
_GL.static_range = lambda *bounds: range(*(_index(b) for b in bounds))
for _layout in (
    "SliceLayout", "BlockedLayout", "DistributedLinearLayout", "NVMMADistributedLayout", "DotOperandLayout",
    "SwizzledSharedLayout", "SharedLinearLayout", "NVMMASharedLayout",
):  # fmt: skip
    setattr(_GL, _layout, _no_layout)
_ASYNC_COPY = types.SimpleNamespace(
    async_load=_async_load,
    async_copy_global_to_shared=_async_load,
    commit_group=_noop,
    wait_group=_noop,
    mbarrier_arrive=_copies_arrive,
)


def _block_layout(self: tl.block_type) -> None:
    return None


def emulated(module: types.ModuleType) -> types.SimpleNamespace:
    """``module`` (``gluon_decode``, ``gluon_decode_ws`` or another version of one) with its kernel runnable in
    Triton's interpreter: an object with the attribute ``attention.py`` launches (``decode_stage1_gluon[grid](...)``
    or ``decode_stage1_ws``). Needs ``TRITON_INTERPRET=1`` set before ``triton_kernels`` was imported (its helpers,
    which the Gluon kernel calls, must be interpreted too)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("gluon_emulation runs in Triton's interpreter: set TRITON_INTERPRET=1 before importing")
    # `x.type.layout` (a tensor's layout, read to build others) is None here.
    if not hasattr(tl.block_type, "layout"):
        tl.block_type.layout = property(_block_layout)
    from witcert.kernels.gluon_tiles import NUM_WARPS  # the kernels' launch (attention.py)

    _GL.warp_specialize = lambda functions_and_args, worker_num_warps, worker_num_regs=None: _PARTITIONS.run(
        functions_and_args, [NUM_WARPS, *(_index(w) for w in worker_num_warps)]
    )
    # Each Gluon function runs in an emulated copy of its own module's namespace (the module's kernel, and the
    # modules whose Gluon functions it calls, in turn: gluon_tiles): module-level constexprs as plain values, as
    # the interpreter passes a kernel's constexpr arguments (a constexpr plus a tensor would be a constexpr
    # holding a tensor), and the Gluon-only calls emulated.
    modules, pending = {}, [module]
    while pending:
        current = pending.pop()
        if current.__name__ not in modules:
            modules[current.__name__] = current
            pending += [
                sys.modules[value.fn.__module__]
                for value in vars(current).values()
                if isinstance(value, GluonJITFunction) and value.fn.__module__ != current.__name__
            ]
    namespaces = {}
    for name, current in modules.items():
        namespace = {key: _value(value) for key, value in vars(current).items()}
        namespace.update(
            gl=_GL, tl=tl, async_copy=_ASYNC_COPY, mbarrier=_MBARRIER, mma_v2=_mma_v2, _barrier=_noop,
            async_load=_async_load,
        )  # fmt: skip
        if "g_of" in namespace:
            # g's fast exponential is inline PTX (compiled code only); the interpreter takes its exact route.
            namespace["g_of"] = functools.partial(lambda g_of, u, FAST_EXP=False: g_of(u, False), namespace["g_of"])
        namespaces[name] = namespace
    interpreted: dict[int, InterpretedFunction] = {}
    for namespace in namespaces.values():
        for key, value in list(namespace.items()):
            if isinstance(value, GluonJITFunction):
                if id(value) not in interpreted:
                    original = value.fn
                    function: Callable = types.FunctionType(
                        original.__code__, namespaces[original.__module__], original.__name__,
                        original.__defaults__, original.__closure__,
                    )  # fmt: skip
                    interpreted[id(value)] = InterpretedFunction(function)
                namespace[key] = interpreted[id(value)]
    namespace = namespaces[module.__name__]
    kernels = {name: namespace[name] for name in ("decode_stage1_gluon", "decode_stage1_ws") if name in namespace}
    return types.SimpleNamespace(**kernels)
