"""The Gluon decode stage 1 (``kernels/gluon_decode.py``) run in Triton's CPU interpreter, for the contract tests.

Gluon has no interpreter. Its kernels are Python functions over tensors whose layouts say where each element
lives (which thread, which register), never what it is, so Triton's interpreter can run them with the layouts
dropped: this module re-binds each ``@gluon.jit`` function's code to a namespace where ``gl`` is Triton's
language minus the layouts, shared memory is a NumPy array, an asynchronous copy is a masked load done at once
(and its waits and the barriers nothing), and ``mma_v2`` is a float32 matrix product (exact products of fp16 or
tf32 operands, float32 sums, as on the tensor cores up to the order of the sums).

What the layouts do decide is the inline PTX: an ``asm`` block acts on a thread's registers, ``pack`` of them at
a time, in the order its layout gives. Each block of the kernel is emulated by what it computes on the tensor:
``ex2.approx.ftz`` is ``exp2`` with results below ``2**-126`` flushed to 0; the output's rescale is ``acc *
alpha``; ``_neg_codes`` is ``-(byte - 128)`` per element; ``_v_pairs`` is the exact ``hi + lo = s * code`` split
with its documented exchange of tokens and channels within each pair of tokens and quad of channels (the order
``_V_PAIRS`` gives its registers), which ``_relabel_v`` undoes. An asm block not listed here raises. So the
emulation checks the kernel's algorithm (tiling, masks, the copies' addressing, online softmax, the
certificate's folds and merges, the relabelled operands) against the reference; the PTX itself is checked by
the SASS tests when compiled and by the GPU tests when run.
"""

from __future__ import annotations

import os
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


def _neg_codes(codes: np.ndarray) -> np.ndarray:
    return -(codes.astype(np.float32) - 128.0)


def _v_pairs(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[warp, 16 tokens, 64]`` codes and their scales -> ``(hi, lo)``: value at (token 2T + x, index 4C + 2y + z)
    from token 2T + z, index 4C + 2x + y (``gluon_decode._v_pairs`` and ``_relabel_v``)."""
    product = (codes.astype(np.float64) - 128.0) * scales.astype(np.float64)  # exact
    hi = product.astype(np.float16)
    lo = (product - hi.astype(np.float64)).astype(np.float16)

    def exchange(x: np.ndarray) -> np.ndarray:
        warps, tokens, index = x.shape
        pairs = x.reshape(warps, tokens // 2, 2, index // 4, 2, 2)  # [w, T, z, C, x, y]
        return pairs.transpose(0, 1, 4, 3, 5, 2).reshape(warps, tokens, index)  # [w, T, x, C, y, z]

    return exchange(hi), exchange(lo)


def _rescale(acc: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    return acc.astype(np.float32) * alpha.astype(np.float32)


def _inline_asm_elementwise(asm, constraints, args, dtype, is_pure, pack):
    """The kernel's asm blocks, each by what it computes on whole tensors (the module docstring)."""
    asm = _value(asm)
    data = [arg.handle.data for arg in args]
    if "ex2.approx.ftz.f32" in asm:
        return _tensor(_exp2_ftz(data[0]), tl.float32)
    if "@p bra SKIP" in asm:
        return _tensor(_rescale(*data), tl.float32)
    if "sub.rn.f16x2 $0, offset, $0" in asm:
        return _tensor(_neg_codes(data[0]), tl.float16)
    if "prmt.b32 lo, $8, $9, 0x5140" in asm:
        hi, lo = _v_pairs(*data)
        return _tensor(hi, tl.float16), _tensor(lo, tl.float16)
    raise NotImplementedError(f"gluon_emulation: no emulation for this asm block:\n{asm}")


def _no_layout(*_: object, **__: object) -> None:
    """Layout constructors: the emulation has no layouts."""
    return None


def _noop(*_: object, **__: object) -> None:
    return None


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
    async_load=_async_load, async_copy_global_to_shared=_async_load, commit_group=_noop, wait_group=_noop
)


def _block_layout(self: tl.block_type) -> None:
    return None


def emulated(module: types.ModuleType) -> types.SimpleNamespace:
    """``module`` (``gluon_decode`` or another version of it) with its kernels runnable in Triton's interpreter:
    an object with the attributes ``attention.py`` reads (``decode_stage1_gluon[grid](...)``, ``HEADS``,
    ``NUM_WARPS``, ``supports``). Needs ``TRITON_INTERPRET=1`` set before ``triton_kernels`` was imported (its
    helpers, which the Gluon kernel calls, must be interpreted too)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("gluon_emulation runs in Triton's interpreter: set TRITON_INTERPRET=1 before importing")
    # `x.type.layout` (a tensor's layout, read to build others) is None here.
    if not hasattr(tl.block_type, "layout"):
        tl.block_type.layout = property(_block_layout)
    # Module-level constexprs as plain values, as the interpreter passes a kernel's constexpr arguments: a
    # constexpr plus a tensor would be a constexpr holding a tensor.
    namespace = {name: _value(value) for name, value in vars(module).items()}
    namespace.update(gl=_GL, tl=tl, async_copy=_ASYNC_COPY, mma_v2=_mma_v2, _barrier=_noop, _async_load=_async_load)
    if "g_of" in namespace:
        # g's fast exponential is inline PTX (compiled code only); the interpreter takes its exact route.
        g_of = namespace["g_of"]
        namespace["g_of"] = lambda u, FAST_EXP=False: g_of(u, False)
    for name, value in vars(module).items():
        if isinstance(value, GluonJITFunction):
            original = value.fn
            function: Callable = types.FunctionType(
                original.__code__, namespace, original.__name__, original.__defaults__, original.__closure__
            )
            namespace[name] = InterpretedFunction(function)
    return types.SimpleNamespace(
        decode_stage1_gluon=namespace["decode_stage1_gluon"],
        HEADS=module.HEADS,
        NUM_WARPS=module.NUM_WARPS,
        supports=module.supports,
    )
