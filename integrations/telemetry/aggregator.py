"""The engine-side certificate aggregator: counts every certificate on the device, samples some of them.

``observe`` is called by the attention backend at every decode step, once per layer, with the
certificates ``[B, H_q]`` the kernel just computed (or ``observe_layers`` once per step with all
layers' ``[L, B, H_q]``: one launch instead of L, the cheaper choice). It never synchronises with the
host, never allocates (on the Triton path: one kernel launch, nothing else) and branches on no device
value, so it can run inside a captured CUDA graph. All state lives in one preallocated int64 device buffer, so a
flush is a single device-to-host copy (``witcert.integrations.telemetry.exporter`` does that asynchronously).

Semantics (docs/TELEMETRY.md is the full statement):

- The step counter lives on the device and advances when layer ``step_layer`` (default 0) is
  observed; the step index of that call and of the following layers is ``counter - 1``, so step 0
  is the first step observed.
- Counters per (layer, head) count every certificate of every step (every active batch row):
  ``samples``; ``covered`` (``v <= tau``); ``vacuous`` (``1 <= v < inf``); ``inf`` (``v == +inf``);
  ``nan``; ``fallbacks`` (head-rows repaired from exact K/V); ``repaired_bytes``. Since ``tau < 1``,
  the four value categories are disjoint; values in ``(tau, 1)`` are in none of them.
- Sampled steps are those with ``step % stride == 0``. At a sampled step every finite certificate
  enters the per-(layer, head) histogram (log-scale bounds, plus sum, min and max over finite values),
  and one raw sample per (layer, head) enters the ring: the maximum over the active batch rows that
  are not NaN, ``+inf`` kept; NaN only when every active row is NaN (NaN is counted exactly anyway).
- All comparisons are made in float32, whatever the certificate's dtype.
- Counters, histogram counts and sums are cumulative and never reset on the device: the exporter takes
  differences between host copies, so there is no reset to race with the step loop. Only the
  histogram's min and max restart, in stream order right after each flush's copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import triton
import triton.language as tl

from witcert.integrations.telemetry.schema import CERTIFICATE_BUCKETS

# Order of the counters in the device buffer and in ``AggregatorSnapshot.counters()``.
COUNTER_NAMES: tuple[str, ...] = ("samples", "covered", "vacuous", "inf", "nan", "fallbacks", "repaired_bytes")
_NUM_COUNTERS = len(COUNTER_NAMES)

Backend = Literal["auto", "triton", "torch"]

DEFAULT_RING_SAMPLED_STEPS = 128


@dataclass(frozen=True)
class StateLayout:
    """Where each array lives in the aggregator's single int64 state buffer (offsets in 8-byte words).

    Float arrays are float64 reinterpretations of their words; the same layout decodes a host copy.
    """

    num_layers: int
    num_heads: int
    num_buckets: int  # histogram buckets: len(bounds) + 1, the last one open above
    ring_capacity: int

    @property
    def cells(self) -> int:
        return self.num_layers * self.num_heads

    def offsets(self) -> dict[str, tuple[int, int]]:
        sizes = {
            "step": 1,
            "ring_written": 1,
            "arrivals": 1,  # programs of a multi-layer call that have finished (0 between calls)
            "counts": _NUM_COUNTERS * self.cells,
            "hist_counts": self.cells * self.num_buckets,
            "hist_sum": self.cells,
            "hist_min": self.cells,
            "hist_max": self.cells,
            "ring_value": self.ring_capacity,
            "ring_layer": self.ring_capacity,
            "ring_head": self.ring_capacity,
            "ring_step": self.ring_capacity,
        }
        offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in sizes.items():
            offsets[name] = (start, start + size)
            start += size
        return offsets

    @property
    def words(self) -> int:
        return max(end for _, end in self.offsets().values())


_FLOAT_ARRAYS = frozenset({"hist_sum", "hist_min", "hist_max", "ring_value"})


@dataclass(frozen=True)
class AggregatorSnapshot:
    """Host copy of the aggregator's state, cumulative since construction.

    Per-(layer, head) arrays are int64 ``[L, H]`` unless stated. Raw samples are the ring entries still
    held, oldest first: entry ``raw_first_index + i`` of the sequence of all raw samples ever written.
    """

    step: int  # decode steps observed (the device step counter)
    samples: np.ndarray
    covered: np.ndarray
    vacuous: np.ndarray
    inf: np.ndarray
    nan: np.ndarray
    fallbacks: np.ndarray
    repaired_bytes: np.ndarray
    histogram_bounds: tuple[float, ...]
    histogram_counts: np.ndarray  # [L, H, len(bounds) + 1]; bucket i holds bounds[i-1] < v <= bounds[i]
    histogram_sum: np.ndarray  # float64 [L, H], finite sampled values
    # Extrema since the last ``restart_extrema`` (each flush of a TelemetryStream), not since construction.
    histogram_min: np.ndarray  # float64 [L, H]; +inf where no finite value was sampled
    histogram_max: np.ndarray  # float64 [L, H]; -inf where no finite value was sampled
    raw_layer: np.ndarray
    raw_head: np.ndarray
    raw_step: np.ndarray
    raw_value: np.ndarray  # float64, +inf and NaN kept
    raw_first_index: int
    raw_written: int  # raw samples written since construction (held or overwritten)

    def counters(self) -> dict[str, np.ndarray]:
        """The exact per-(layer, head) counters, keyed by ``COUNTER_NAMES``."""
        return {name: getattr(self, name) for name in COUNTER_NAMES}

    @property
    def histogram_count(self) -> np.ndarray:
        """Finite values sampled per (layer, head)."""
        return self.histogram_counts.sum(-1)

    @property
    def finite_mean(self) -> np.ndarray:
        """Mean of the finite sampled values per (layer, head); NaN where there is none."""
        count = self.histogram_count
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(count > 0, self.histogram_sum / np.maximum(count, 1), np.nan)


def decode_state(
    layout: StateLayout, state: np.ndarray, bounds: tuple[float, ...], raw_since: int = 0
) -> AggregatorSnapshot:
    """Turn a host copy of the state buffer into a snapshot; raw samples from index ``raw_since`` on."""
    if state.dtype != np.int64 or state.shape != (layout.words,):
        raise ValueError(f"state must be int64 [{layout.words}], got {state.dtype} {state.shape}")
    arrays: dict[str, np.ndarray] = {}
    for name, (start, end) in layout.offsets().items():
        words = state[start:end]
        arrays[name] = words.view(np.float64) if name in _FLOAT_ARRAYS else words
    shape = (layout.num_layers, layout.num_heads)
    counts = arrays["counts"].reshape(_NUM_COUNTERS, *shape)
    written = int(arrays["ring_written"][0])
    first = max(raw_since, written - layout.ring_capacity, 0)
    held = np.arange(first, max(first, written), dtype=np.int64) % layout.ring_capacity
    return AggregatorSnapshot(
        step=int(arrays["step"][0]),
        **{name: counts[index].copy() for index, name in enumerate(COUNTER_NAMES)},
        histogram_bounds=bounds,
        histogram_counts=arrays["hist_counts"].reshape(*shape, layout.num_buckets).copy(),
        histogram_sum=arrays["hist_sum"].reshape(shape).copy(),
        histogram_min=arrays["hist_min"].reshape(shape).copy(),
        histogram_max=arrays["hist_max"].reshape(shape).copy(),
        raw_layer=arrays["ring_layer"][held],
        raw_head=arrays["ring_head"][held],
        raw_step=arrays["ring_step"][held],
        raw_value=arrays["ring_value"][held],
        raw_first_index=first,
        raw_written=written,
    )


@triton.jit
def _add_to_cells(pointers, values, mask):
    tl.store(pointers, tl.load(pointers, mask=mask) + values, mask=mask)


@triton.jit(do_not_specialize=["first_layer", "num_layers_in_call", "num_rows", "tau", "stride", "ring_capacity"])
def _observe_kernel(
    cert_ptr,
    cert_stride_l,
    cert_stride_b,
    cert_stride_h,
    fallback_ptr,
    fallback_stride_l,
    fallback_stride_b,
    fallback_stride_h,
    repaired_ptr,
    repaired_stride_l,
    repaired_stride_b,
    repaired_stride_h,
    active_rows_ptr,
    bounds_ptr,
    step_ptr,
    written_ptr,
    arrivals_ptr,
    counts_ptr,
    hist_ptr,
    hist_sum_ptr,
    hist_min_ptr,
    hist_max_ptr,
    ring_value_ptr,
    ring_layer_ptr,
    ring_head_ptr,
    ring_step_ptr,
    first_layer,
    num_layers_in_call,
    num_rows,
    tau,
    stride,
    ring_capacity,
    NUM_LAYERS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_BOUNDS: tl.constexpr,
    HAS_FALLBACK: tl.constexpr,
    HAS_REPAIRED: tl.constexpr,
    HAS_ACTIVE_ROWS: tl.constexpr,
    ADVANCE_STEP: tl.constexpr,
    SINGLE_PROGRAM: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One program per layer: each owns its layer's cells, so counters need no atomics. The step counter
    # and the ring cursor are shared: every program reads them first, and the last program to arrive
    # (or the only one) advances them, so no program can read a value another has already moved.
    i = tl.program_id(0)
    layer = first_layer + i
    step = tl.load(step_ptr)
    written = tl.load(written_ptr)
    current_step = step if ADVANCE_STEP else step - 1
    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < NUM_HEADS
    # Per-head vectors rather than scalars: Triton's interpreter rejects masks combined with loaded scalars.
    step_of_head = tl.zeros([BLOCK_H], dtype=tl.int64) + current_step
    sampled = (step_of_head % stride) == 0
    rows_limit = num_rows
    if HAS_ACTIVE_ROWS:
        rows_limit = tl.minimum(tl.load(active_rows_ptr).to(tl.int32), num_rows)

    n_samples = tl.zeros([BLOCK_H], dtype=tl.int64)
    n_covered = tl.zeros([BLOCK_H], dtype=tl.int64)
    n_vacuous = tl.zeros([BLOCK_H], dtype=tl.int64)
    n_inf = tl.zeros([BLOCK_H], dtype=tl.int64)
    n_nan = tl.zeros([BLOCK_H], dtype=tl.int64)
    n_fallback = tl.zeros([BLOCK_H], dtype=tl.int64)
    n_repaired = tl.zeros([BLOCK_H], dtype=tl.int64)
    finite_sum = tl.zeros([BLOCK_H], dtype=tl.float64)
    finite_min = tl.full([BLOCK_H], float("inf"), dtype=tl.float32)
    finite_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    row_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    any_number = tl.zeros([BLOCK_H], dtype=tl.int32)
    for row_start in range(0, num_rows, BLOCK_B):
        rows = row_start + tl.arange(0, BLOCK_B)
        ok = (rows < rows_limit)[:, None] & head_ok[None, :]
        value = tl.load(
            cert_ptr + i * cert_stride_l + rows[:, None] * cert_stride_b + heads[None, :] * cert_stride_h,
            mask=ok,
            other=0.0,
        ).to(tl.float32)
        is_nan = ok & (value != value)
        is_inf = ok & (value == float("inf"))
        finite = ok & (tl.abs(value) < float("inf"))
        n_samples += tl.sum(ok.to(tl.int64), axis=0)
        n_covered += tl.sum((ok & (value <= tau)).to(tl.int64), axis=0)
        n_vacuous += tl.sum((finite & (value >= 1.0)).to(tl.int64), axis=0)
        n_inf += tl.sum(is_inf.to(tl.int64), axis=0)
        n_nan += tl.sum(is_nan.to(tl.int64), axis=0)
        if HAS_FALLBACK:
            repaired_head = tl.load(
                fallback_ptr
                + i * fallback_stride_l
                + rows[:, None] * fallback_stride_b
                + heads[None, :] * fallback_stride_h,
                mask=ok,
                other=0,
            )
            n_fallback += tl.sum((ok & (repaired_head != 0)).to(tl.int64), axis=0)
        if HAS_REPAIRED:
            repaired = tl.load(
                repaired_ptr
                + i * repaired_stride_l
                + rows[:, None] * repaired_stride_b
                + heads[None, :] * repaired_stride_h,
                mask=ok,
                other=0,
            )
            n_repaired += tl.sum(repaired.to(tl.int64), axis=0)
        # Sampling is a mask, not a branch: the same instructions run at every step.
        keep = finite & sampled[None, :]
        bucket = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.int32)
        for j in tl.static_range(NUM_BOUNDS):
            bucket += (value > tl.load(bounds_ptr + j)).to(tl.int32)
        hist_index = (layer * NUM_HEADS + heads[None, :]) * (NUM_BOUNDS + 1) + bucket
        tl.atomic_add(hist_ptr + hist_index, tl.full([BLOCK_B, BLOCK_H], 1, dtype=tl.int64), mask=keep)
        finite_sum += tl.sum(tl.where(keep, value, 0.0).to(tl.float64), axis=0)
        finite_min = tl.minimum(finite_min, tl.min(tl.where(keep, value, float("inf")), axis=0))
        finite_max = tl.maximum(finite_max, tl.max(tl.where(keep, value, float("-inf")), axis=0))
        row_max = tl.maximum(row_max, tl.max(tl.where(ok & ~is_nan, value, float("-inf")), axis=0))
        any_number = tl.maximum(any_number, tl.max((ok & ~is_nan).to(tl.int32), axis=0))

    cell = layer * NUM_HEADS + heads
    cells = NUM_LAYERS * NUM_HEADS
    _add_to_cells(counts_ptr + cell, n_samples, head_ok)
    _add_to_cells(counts_ptr + cells + cell, n_covered, head_ok)
    _add_to_cells(counts_ptr + 2 * cells + cell, n_vacuous, head_ok)
    _add_to_cells(counts_ptr + 3 * cells + cell, n_inf, head_ok)
    _add_to_cells(counts_ptr + 4 * cells + cell, n_nan, head_ok)
    _add_to_cells(counts_ptr + 5 * cells + cell, n_fallback, head_ok)
    _add_to_cells(counts_ptr + 6 * cells + cell, n_repaired, head_ok)
    _add_to_cells(hist_sum_ptr + cell, finite_sum, head_ok)
    tl.store(
        hist_min_ptr + cell,
        tl.minimum(tl.load(hist_min_ptr + cell, mask=head_ok), finite_min.to(tl.float64)),
        mask=head_ok,
    )
    tl.store(
        hist_max_ptr + cell,
        tl.maximum(tl.load(hist_max_ptr + cell, mask=head_ok), finite_max.to(tl.float64)),
        mask=head_ok,
    )

    # Whether the ring is written is the same for every layer of the call (same step, same active rows).
    write_ring = head_ok & sampled & ((tl.zeros([BLOCK_H], dtype=tl.int32) + rows_limit) > 0)
    slot = (written + i * NUM_HEADS + heads) % ring_capacity
    raw = tl.where(any_number > 0, row_max, float("nan")).to(tl.float64)
    tl.store(ring_value_ptr + slot, raw, mask=write_ring)
    tl.store(ring_layer_ptr + slot, tl.zeros([BLOCK_H], dtype=tl.int64) + layer, mask=write_ring)
    tl.store(ring_head_ptr + slot, heads.to(tl.int64), mask=write_ring)
    tl.store(ring_step_ptr + slot, step_of_head, mask=write_ring)

    if SINGLE_PROGRAM:
        last = True
    else:
        last = tl.atomic_add(arrivals_ptr, 1) == num_layers_in_call - 1  # acq_rel: after everyone's reads
    if last:
        if ADVANCE_STEP:
            tl.store(step_ptr, step + 1)
        tl.store(written_ptr, written + num_layers_in_call * tl.sum(write_ring.to(tl.int64), axis=0))
        if not SINGLE_PROGRAM:
            tl.store(arrivals_ptr, 0)


def _check_per_row(name: str, tensor: torch.Tensor | None, shape: torch.Size, device: torch.device) -> None:
    if tensor is None:
        return
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.shape != shape:
        raise ValueError(f"{name} must have the certificate's shape {tuple(shape)}, got {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, the certificate on {device}")
    if tensor.is_floating_point() or tensor.is_complex():
        raise TypeError(f"{name} must be a bool or integer tensor, got {tensor.dtype}")


class CertificateAggregator:
    """Per-(layer, head) certificate counters, a log-scale histogram and a ring of raw samples, on the device.

    - ``tau``: the gating threshold (``covered`` means ``certificate <= tau``), in (0, 1) so that covered
      and vacuous never overlap.
    - ``stride``: every ``stride``-th step is sampled into the histogram and the ring; counters see every step.
    - ``ring_capacity``: raw samples held on the device between flushes (one per layer and head at each
      sampled step); by default 128 sampled steps, i.e. ``128 * stride`` steps between flushes before the
      oldest samples are overwritten (and counted as dropped by the exporter).
    - ``step_layer``: the layer whose observation advances the step counter (the first layer this process runs).
    - ``backend``: ``"triton"`` (one fused launch per call: the CUDA default), ``"torch"`` (plain tensor
      operations, no branch on device values either: the CPU default) or ``"auto"``.

    Per decode step, prefer one ``observe_layers`` call over a per-step [L, B, H] certificate buffer to
    ``L`` calls of ``observe``: on the H200 the former cost 0.00-0.13% of a 28-layer decode step, the
    latter 2.9-3.8% (docs/TELEMETRY.md).
    """

    def __init__(
        self,
        num_layers: int,
        num_q_heads: int,
        *,
        tau: float,
        stride: int = 32,
        device: torch.device | str,
        ring_capacity: int | None = None,
        step_layer: int = 0,
        histogram_bounds: tuple[float, ...] = CERTIFICATE_BUCKETS,
        backend: Backend = "auto",
    ) -> None:
        if num_layers <= 0 or num_q_heads <= 0:
            raise ValueError(f"num_layers and num_q_heads must be positive, got {num_layers} and {num_q_heads}")
        if not (math.isfinite(tau) and 0.0 < tau < 1.0):
            raise ValueError(f"tau must be in (0, 1): covered and vacuous must stay disjoint, got {tau}")
        if stride < 1:
            raise ValueError(f"stride must be at least 1, got {stride}")
        if ring_capacity is None:
            ring_capacity = DEFAULT_RING_SAMPLED_STEPS * num_layers * num_q_heads
        if ring_capacity < num_layers * num_q_heads:
            raise ValueError(
                f"ring_capacity {ring_capacity} cannot hold one sampled step ({num_layers} x {num_q_heads} samples)"
            )
        if not 0 <= step_layer < num_layers:
            raise ValueError(f"step_layer must be in [0, {num_layers}), got {step_layer}")
        bounds = tuple(float(b) for b in histogram_bounds)
        if (
            not bounds
            or any(not math.isfinite(b) for b in bounds)
            or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False))
        ):
            raise ValueError("histogram_bounds must be a non-empty, strictly increasing sequence of finite values")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        if backend not in ("triton", "torch"):
            raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
        self.backend: Backend = backend
        self.num_layers = num_layers
        self.num_heads = num_q_heads
        self.tau = float(tau)
        self.stride = int(stride)
        self.step_layer = step_layer
        self.histogram_bounds = bounds
        self.layout = StateLayout(num_layers, num_q_heads, len(bounds) + 1, ring_capacity)

        self._state = torch.zeros(self.layout.words, dtype=torch.int64, device=self.device)
        views = {}
        for name, (start, end) in self.layout.offsets().items():
            words = self._state[start:end]
            views[name] = words.view(torch.float64) if name in _FLOAT_ARRAYS else words
        cell_shape = (num_layers, num_q_heads)
        self._step = views["step"].view(())
        self._written = views["ring_written"].view(())
        self._arrivals = views["arrivals"].view(())
        self._counts = views["counts"].view(_NUM_COUNTERS, *cell_shape)
        self._hist = views["hist_counts"].view(*cell_shape, self.layout.num_buckets)
        self._hist_sum = views["hist_sum"].view(cell_shape)
        self._hist_min = views["hist_min"].view(cell_shape)
        self._hist_max = views["hist_max"].view(cell_shape)
        self.restart_extrema()
        self._ring_value = views["ring_value"]
        self._ring_layer = views["ring_layer"]
        self._ring_head = views["ring_head"]
        self._ring_step = views["ring_step"]
        self._bounds = torch.tensor(bounds, dtype=torch.float32, device=self.device)
        self._tau32 = torch.tensor(self.tau, dtype=torch.float32, device=self.device)
        self._block_h = triton.next_power_of_2(num_q_heads)
        # Rows beyond one block are looped over; the block follows the batch up to this cap, so a few
        # power-of-two variants are compiled, and a batch of 1 does not pay for a tile of 64 rows.
        self._block_b_max = max(1, 2048 // self._block_h)

    @property
    def state(self) -> torch.Tensor:
        """The whole state as one int64 device tensor (``layout`` says what is where): copy it, never write it."""
        return self._state

    def restart_extrema(self) -> None:
        """Start a new interval for the histogram's min and max (the exporter calls it right after each copy).

        Min and max cannot be differenced like counts and sums, so the exporter restarts them, in stream
        order after its device-to-host copy: each exported interval then carries its own exact extrema.
        """
        self._hist_min.fill_(math.inf)
        self._hist_max.fill_(-math.inf)

    def observe(
        self,
        layer: int,
        certificate: torch.Tensor,
        fallback: torch.Tensor | None = None,
        repaired_bytes: torch.Tensor | None = None,
        *,
        active_rows: torch.Tensor | None = None,
    ) -> None:
        """Count one layer's certificates ``[B, H_q]`` of the current decode step.

        ``fallback``: bool/int ``[B, H_q]``, non-zero where the head was repaired from exact K/V.
        ``repaired_bytes``: integer ``[B, H_q]``, bytes paged in from the exact backup.
        ``active_rows``: a 0-dim integer device tensor; rows at or beyond it are padding (a CUDA graph
        captured for a larger batch) and are ignored. Observing ``step_layer`` starts a new step.
        """
        if not isinstance(certificate, torch.Tensor) or certificate.dim() != 2:
            raise ValueError(f"certificate must be a [B, H_q] tensor, got {getattr(certificate, 'shape', certificate)}")
        _check_per_row("fallback", fallback, certificate.shape, certificate.device)
        _check_per_row("repaired_bytes", repaired_bytes, certificate.shape, certificate.device)
        self._accumulate(
            layer,
            certificate.unsqueeze(0),
            None if fallback is None else fallback.unsqueeze(0),
            None if repaired_bytes is None else repaired_bytes.unsqueeze(0),
            active_rows,
        )

    def observe_layers(
        self,
        first_layer: int,
        certificates: torch.Tensor,
        fallback: torch.Tensor | None = None,
        repaired_bytes: torch.Tensor | None = None,
        *,
        active_rows: torch.Tensor | None = None,
    ) -> None:
        """Count the certificates ``[n, B, H_q]`` of layers ``first_layer .. first_layer + n - 1`` in one launch.

        The same as ``n`` calls of ``observe``, for a backend that writes every layer's certificate into one
        per-step buffer: it costs one kernel launch per step instead of one per layer.
        """
        if not isinstance(certificates, torch.Tensor) or certificates.dim() != 3:
            raise ValueError(
                f"certificates must be an [n, B, H_q] tensor, got {getattr(certificates, 'shape', certificates)}"
            )
        self._accumulate(first_layer, certificates, fallback, repaired_bytes, active_rows)

    def snapshot(self) -> AggregatorSnapshot:
        """Everything counted so far, on the host. It waits for the device: never call it in the step loop."""
        return decode_state(self.layout, self._state.cpu().numpy(), self.histogram_bounds)

    def _accumulate(
        self,
        first_layer: int,
        certificates: torch.Tensor,
        fallback: torch.Tensor | None,
        repaired_bytes: torch.Tensor | None,
        active_rows: torch.Tensor | None,
    ) -> None:
        num_in_call, num_rows, num_heads = certificates.shape
        if num_heads != self.num_heads:
            raise ValueError(f"certificate has {num_heads} heads, the aggregator {self.num_heads}")
        if num_rows == 0 or num_in_call == 0:
            raise ValueError("certificate has no rows: observe only steps that ran attention")
        if not 0 <= first_layer or first_layer + num_in_call > self.num_layers:
            raise ValueError(
                f"layers {first_layer}..{first_layer + num_in_call - 1} are outside [0, {self.num_layers})"
            )
        if certificates.device != self.device:
            raise ValueError(f"certificate is on {certificates.device}, the aggregator on {self.device}")
        if not certificates.is_floating_point():
            raise TypeError(f"certificate must be a floating-point tensor, got {certificates.dtype}")
        if first_layer < self.step_layer < first_layer + num_in_call:
            raise ValueError(f"a call covering step_layer {self.step_layer} must start at it")
        _check_per_row("fallback", fallback, certificates.shape, self.device)
        _check_per_row("repaired_bytes", repaired_bytes, certificates.shape, self.device)
        if active_rows is not None:
            if active_rows.numel() != 1 or active_rows.is_floating_point() or active_rows.device != self.device:
                raise ValueError("active_rows must be a one-element integer tensor on the aggregator's device")
        advance = first_layer == self.step_layer
        if self.backend == "triton":
            self._accumulate_triton(first_layer, certificates, fallback, repaired_bytes, active_rows, advance)
        else:
            self._accumulate_torch(first_layer, certificates, fallback, repaired_bytes, active_rows, advance)

    def _accumulate_triton(
        self,
        first_layer: int,
        certificates: torch.Tensor,
        fallback: torch.Tensor | None,
        repaired_bytes: torch.Tensor | None,
        active_rows: torch.Tensor | None,
        advance: bool,
    ) -> None:
        num_in_call, num_rows, _ = certificates.shape
        # Absent inputs point at the certificate: the kernel never reads them (constexpr flags).
        fallback_arg = certificates if fallback is None else fallback
        repaired_arg = certificates if repaired_bytes is None else repaired_bytes
        _observe_kernel[(num_in_call,)](
            certificates,
            *certificates.stride(),
            fallback_arg,
            *fallback_arg.stride(),
            repaired_arg,
            *repaired_arg.stride(),
            self._step if active_rows is None else active_rows,
            self._bounds,
            self._step,
            self._written,
            self._arrivals,
            self._counts,
            self._hist,
            self._hist_sum,
            self._hist_min,
            self._hist_max,
            self._ring_value,
            self._ring_layer,
            self._ring_head,
            self._ring_step,
            first_layer,
            num_in_call,
            num_rows,
            self.tau,
            self.stride,
            self.layout.ring_capacity,
            NUM_LAYERS=self.num_layers,
            NUM_HEADS=self.num_heads,
            NUM_BOUNDS=len(self.histogram_bounds),
            HAS_FALLBACK=fallback is not None,
            HAS_REPAIRED=repaired_bytes is not None,
            HAS_ACTIVE_ROWS=active_rows is not None,
            ADVANCE_STEP=advance,
            SINGLE_PROGRAM=num_in_call == 1,
            BLOCK_B=min(triton.next_power_of_2(num_rows), self._block_b_max),
            BLOCK_H=self._block_h,
        )

    def _accumulate_torch(
        self,
        first_layer: int,
        certificates: torch.Tensor,
        fallback: torch.Tensor | None,
        repaired_bytes: torch.Tensor | None,
        active_rows: torch.Tensor | None,
        advance: bool,
    ) -> None:
        num_in_call, num_rows, num_heads = certificates.shape
        layers = slice(first_layer, first_layer + num_in_call)
        value = certificates.to(torch.float32)
        row_index = torch.arange(num_rows, device=self.device).view(1, num_rows, 1)
        if active_rows is None:
            rows_limit = torch.full((), num_rows, device=self.device)  # a fill, not a host-to-device copy
        else:
            rows_limit = active_rows.reshape(()).clamp(max=num_rows)
        ok = (row_index < rows_limit).expand_as(value)
        if advance:
            self._step.add_(1)
        current_step = self._step - 1
        sampled = current_step % self.stride == 0

        is_nan = ok & value.isnan()
        is_inf = ok & (value == math.inf)
        finite = ok & (value.abs() < math.inf)
        zero = torch.zeros((), dtype=torch.int64, device=self.device)
        per_row = [
            ok,
            ok & (value <= self._tau32),
            finite & (value >= 1.0),
            is_inf,
            is_nan,
            ok & (fallback != 0) if fallback is not None else torch.zeros_like(ok),
            torch.where(ok, repaired_bytes.to(torch.int64), zero) if repaired_bytes is not None else zero.expand_as(ok),
        ]
        self._counts[:, layers] += torch.stack([x.to(torch.int64).sum(1) for x in per_row])

        keep = finite & sampled
        # The number of bounds below v, as the kernel counts it (torch.searchsorted is far slower on CPU here).
        bucket = (value.unsqueeze(-1) > self._bounds).sum(-1)
        self._hist[layers].scatter_add_(2, bucket.transpose(1, 2), keep.transpose(1, 2).to(torch.int64))
        kept = value.to(torch.float64)
        self._hist_sum[layers] += torch.where(keep, kept, 0.0).sum(1)
        self._hist_min[layers] = torch.minimum(self._hist_min[layers], torch.where(keep, kept, math.inf).amin(1))
        self._hist_max[layers] = torch.maximum(self._hist_max[layers], torch.where(keep, kept, -math.inf).amax(1))

        number = ok & ~is_nan
        raw = torch.where(number.any(1), torch.where(number, kept, -math.inf).amax(1), math.nan).flatten()
        write = sampled & (rows_limit > 0)
        entries = num_in_call * num_heads
        slots = (self._written + torch.arange(entries, device=self.device)) % self.layout.ring_capacity
        layer_of_entry = torch.arange(first_layer, first_layer + num_in_call, device=self.device).repeat_interleave(
            num_heads
        )
        head_of_entry = torch.arange(num_heads, device=self.device).repeat(num_in_call)
        for ring, new in (
            (self._ring_value, raw),
            (self._ring_layer, layer_of_entry),
            (self._ring_head, head_of_entry),
            (self._ring_step, current_step.expand(entries)),
        ):
            ring[slots] = torch.where(write, new, ring[slots])
        self._written += write.to(torch.int64) * entries
