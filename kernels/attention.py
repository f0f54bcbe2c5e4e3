"""Paged decode and extend attention over a ``KVPool``, with the certificate (docs/THEORY.md section 3).

Entry points: ``decode_attention`` (one query token per sequence, SGLang-style ``kv_indptr`` /
``kv_indices`` paging) and ``extend_attention`` (several new query tokens per sequence over a quantized
prefix, causal).

Validation: shape, dtype and device checks are always made (they read no tensor values). Checks
of values (slot range, ``kv_indptr`` monotone and within ``kv_indices``) synchronise with the device,
so ``validate=None`` makes them on CPU only; on the GPU the kernel itself refuses a malformed row
(out-of-range slot, negative length, indices past the end): it reads nothing there and writes NaN
into that row's ``out``, ``lse`` and ``certificate``, which the telemetry counts as a kernel fault.
Nothing is ever read out of bounds. Pass ``validate=True`` to get a ``ValueError`` instead. Extend on
PyTorch's SDPA (GPU, no certificate; ``extend_sdpa``) slices sequences on the host, so its offsets are
always checked there, read back once per call unless the caller passes them as ``bounds``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from witcert.kernels import extend_sdpa, reference
from witcert.kernels.backend import Path, kernels_module, select_path
from witcert.kernels.extend_bounds import ExtendBounds, check_kv_end, check_kv_indptr
from witcert.kernels.launch import LAUNCH
from witcert.kernels.pool import KVPool

_MAX_SPLITS = 64

_sm_count: dict[int, int] = {}


@dataclass
class AttentionOutput:
    """``out`` ``[R, H_q, D]`` (float32, or the ``out`` passed in; from extend on SDPA without one, q's dtype),
    ``lse`` ``[R, H_q]`` (None from extend on SDPA); with the certificate, its value ``[R, H_q]`` and its
    accumulators merged over the splits, ``accumulator_block`` ``[6, R, H_q]`` (``reference.CertificateAccumulators``'
    fields in order; ``None`` without the certificate).

    ``R`` is the batch for decode and the number of query tokens for extend.
    """

    out: torch.Tensor
    lse: torch.Tensor | None  # None from extend on SDPA ("sdpa-gpu"), which returns none
    certificate: torch.Tensor | None
    accumulator_block: torch.Tensor | None
    path: Path

    @property
    def accumulators(self) -> reference.CertificateAccumulators | None:
        """The accumulators as ``reference.CertificateAccumulators`` (views of ``accumulator_block``), built when
        asked: decode runs per layer and step, and only gating's merge reads them."""
        if self.accumulator_block is None:
            return None
        return reference.CertificateAccumulators(*self.accumulator_block.unbind(0))


class _SplitPartials(NamedTuple):
    """A split's certificate partials, each ``[rows, H_q, splits]`` float32, in the order the stage-1 kernels and
    stage 2 take their pointers: the logit of the token the split holds apart (``-inf`` where it holds none), the
    rest sums, and u at the held token."""

    held_logit: torch.Tensor
    a1_rest: torch.Tensor
    b_rest: torch.Tensor
    u_rest: torch.Tensor
    p_rest: torch.Tensor
    u_max: torch.Tensor


_ACCUMULATORS = len(dataclasses.fields(reference.CertificateAccumulators))


class _Certificate(NamedTuple):
    """Stage 2's certificate ``[rows, H_q]`` and its accumulators ``[6, rows, H_q]`` (float32,
    ``reference.CertificateAccumulators``' fields in order), as stage 2 takes their pointers."""

    certificate: torch.Tensor
    accumulators: torch.Tensor

    @classmethod
    def allocate(
        cls,
        rows: int,
        num_q_heads: int,
        device: torch.device,
        fill: float | None = None,
        certificate: torch.Tensor | None = None,
    ) -> _Certificate:
        """New buffers (``fill``: filled with that value), or the accumulators' only where the caller gives the
        ``certificate``'s (``decode_attention``'s ``certificate_out``)."""
        fields = _ACCUMULATORS + (certificate is None)
        block = torch.empty(fields, rows, num_q_heads, dtype=torch.float32, device=device)
        if fill is not None:
            block.fill_(fill)
            if certificate is not None:
                certificate.fill_(fill)
        if certificate is None:
            return cls(block[0], block[1:])
        return cls(certificate, block)


def _result(out: torch.Tensor, lse: torch.Tensor, stats: _Certificate | None, path: Path) -> AttentionOutput:
    """The output, with the certificate and its accumulators from ``stats`` where there is one."""
    if stats is None:
        return AttentionOutput(out, lse, None, None, path)
    return AttentionOutput(out, lse, stats.certificate, stats.accumulators, path)


class _SplitBuffers(NamedTuple):
    """Stage 1's per-split partials and stage 2's results, ``[rows, H_q, splits, ...]`` and ``[rows, H_q]``;
    the certificate's only with it."""

    part_out: torch.Tensor
    part_lse: torch.Tensor
    part_stats: _SplitPartials | None
    lse: torch.Tensor
    stats: _Certificate | None


def _split_buffers(
    rows: int,
    num_q_heads: int,
    splits: int,
    head_dim: int,
    certificate: bool,
    device: torch.device,
    nan_lse: bool,
    certificate_out: torch.Tensor | None = None,
) -> _SplitBuffers:
    """The buffers of one split-KV call, left unwritten; with ``nan_lse`` the per-split LSE and certificate
    partials start as NaN (a split no program writes then poisons its row in stage 2). ``certificate_out``: the
    certificate's, where the caller gives it."""
    part_out = torch.empty(rows, num_q_heads, splits, head_dim, dtype=torch.float32, device=device)
    partials = len(_SplitPartials._fields) if certificate else 0
    part = torch.empty(1 + partials, rows, num_q_heads, splits, dtype=torch.float32, device=device)
    if nan_lse:
        part.fill_(math.nan)
    part_lse, *part_stats = part.unbind(0)  # one call for every view: decode runs this per layer and step
    lse = torch.empty(rows, num_q_heads, dtype=torch.float32, device=device)
    stats = _Certificate.allocate(rows, num_q_heads, device, certificate=certificate_out) if certificate else None
    return _SplitBuffers(part_out, part_lse, _SplitPartials(*part_stats) if certificate else None, lse, stats)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def wave_splits(units: int, slots: int) -> int:
    """The fewest splits per unit of work (a row's block of query heads) whose ``units * splits`` programs
    keep at least 90% of every wave's ``slots`` busy, at most ``_MAX_SPLITS``.

    The split programs of one call take about the same time, so a last wave that is mostly empty costs as
    much as a full one; fewer splits mean longer programs, less per-program set-up and less merging.
    """
    units = max(1, units)
    for splits in range(max(1, slots // units), _MAX_SPLITS + 1):
        programs = units * splits
        if programs >= 0.9 * slots * math.ceil(programs / slots):
            return splits
    return _MAX_SPLITS


def default_num_kv_splits(units: int, device: torch.device, programs_per_sm: int = 2) -> int:
    """``wave_splits`` for a wave of ``programs_per_sm`` programs on every SM of ``device``; shapes alone
    decide it (graph-safe). Not on a GPU: 4."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_count:
        _sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return wave_splits(units, programs_per_sm * _sm_count[index])


def _checked_splits(num_kv_splits: int | None, units: int, programs_per_sm: int, device: torch.device) -> int:
    """The caller's number of splits, checked, or the default for ``units`` of work (``default_num_kv_splits``)."""
    splits = default_num_kv_splits(units, device, programs_per_sm) if num_kv_splits is None else num_kv_splits
    if not 1 <= splits <= _MAX_SPLITS:
        raise ValueError(f"num_kv_splits must be in [1, {_MAX_SPLITS}], got {splits}")
    return splits


def _check_index_tensor(name: str, x: torch.Tensor, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64) or x.dim() != 1:
        raise TypeError(f"{name} must be a 1-D int32/int64 tensor")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device}")


def _check_common(q: torch.Tensor, pool: KVPool, layer: int, delta_step: float, certificate: bool) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [rows, H_q, D] tensor, got {getattr(q, 'shape', type(q))}")
    if q.dtype != pool.dtype:
        raise TypeError(f"q must have the pool's dtype {pool.dtype}, got {q.dtype}")
    if q.device != pool.device:
        raise ValueError(f"q is on {q.device}, the pool on {pool.device}")
    if q.shape[2] != pool.head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} does not match the pool's {pool.head_dim}")
    if q.shape[1] % pool.kv_heads:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({pool.kv_heads})")
    pool.check_layer(layer)
    if certificate and not 0.0 < float(delta_step) < 1.0:
        raise ValueError(f"delta_step must be in (0, 1), got {delta_step}")


def _read_back(
    pool: KVPool, kv_indices: torch.Tensor, *indptrs: torch.Tensor, slot_range: bool = True
) -> list[list[int]]:
    """``indptrs`` as host lists, after checking (with ``slot_range``) that ``kv_indices`` holds slots of the
    pool: one device synchronisation on the GPU."""
    parts = [x.to(torch.int64).flatten() for x in indptrs]
    extremes = slot_range and kv_indices.numel() > 0
    if extremes:
        parts.append(torch.stack([kv_indices.amin(), kv_indices.amax()]).to(torch.int64))
    values = torch.cat(parts).tolist() if parts else []
    if extremes and (values[-2] < 0 or values[-1] >= pool.num_slots):
        raise ValueError(f"kv_indices must be slots in [0, {pool.num_slots})")
    lists, start = [], 0
    for x in indptrs:
        lists.append(values[start : start + x.numel()])
        start += x.numel()
    return lists


def _check_values(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, pool: KVPool) -> None:
    """The checks that read tensor values: one device synchronisation on the GPU."""
    (kv,) = _read_back(pool, kv_indices, kv_indptr)
    check_kv_indptr(kv)
    check_kv_end(kv, kv_indices.numel())


def _prepare_out(out: torch.Tensor | None, rows: int, heads: int, head_dim: int, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(rows, heads, head_dim, dtype=torch.float32, device=device)
    if out.shape != (rows, heads, head_dim) or out.device != device or not out.is_floating_point():
        raise ValueError(f"out must be a floating [{rows}, {heads}, {head_dim}] tensor on {device}")
    if out.stride(2) != 1:
        raise ValueError("out must be contiguous in its last dimension")
    return out


def gluon_supports(q: torch.Tensor, pool: KVPool) -> bool:
    """Whether the Gluon stage 1 covers decode on this pool (``gluon_covers``) on a GPU with the m16n8k16
    ``mma.sync`` it is built on: compute capability 8.0 or newer."""
    return torch.cuda.get_device_capability(q.device)[0] >= 8 and gluon_covers(q.dtype, pool)


def gluon_covers(q_dtype: torch.dtype, pool: KVPool) -> bool:
    """Whether the Gluon stage 1 computes decode for queries of ``q_dtype`` on this pool, whatever the device
    (``gluon_tiles.supports``: its dtypes, shapes and pool options)."""
    from witcert.kernels import gluon_tiles

    return gluon_tiles.supports(
        q_dtype=q_dtype,
        head_dim=pool.head_dim,
        group_size=pool.group_size,
        dither_bits=pool.dither_bits,
        v_dither=pool.v_dither,
        outliers=pool.num_outliers,
        rows=pool.num_slots * pool.kv_heads,
    )


def _runs_gluon_ws(q: torch.Tensor) -> bool:
    """Whether the Gluon stage 1 that runs is the warp-specialised one: asked for, and on Hopper or newer (its
    ``setmaxnreg`` and mbarriers)."""
    return LAUNCH.gluon_ws and q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] >= 9


def _runs_gluon(q: torch.Tensor, pool: KVPool, kv_indices: torch.Tensor) -> bool:
    """Whether decode's stage 1 runs the Gluon kernel (on the GPU, where it covers the call and is faster)."""
    return (
        q.device.type == "cuda"
        and LAUNCH.gluon
        and kv_indices.numel() >= LAUNCH.gluon_min_tokens
        and gluon_supports(q, pool)
    )


def _stage1_units(q: torch.Tensor, pool: KVPool, use_gluon: bool, certificate: bool) -> tuple[int, int]:
    """``(programs per split, programs per SM)`` of the stage 1 that runs: what the default splits fill."""
    from witcert.kernels import gluon_tiles

    rows, num_q_heads, _ = q.shape
    kv_group = num_q_heads // pool.kv_heads
    if use_gluon:
        blocks = -(-kv_group // int(gluon_tiles.HEADS))
        return rows * pool.kv_heads * blocks, LAUNCH.gluon_programs_per_sm(certificate)
    return rows * pool.kv_heads * -(-kv_group // _pow2(kv_group)), LAUNCH.programs_per_sm()


def _run_triton(
    q: torch.Tensor,
    pool: KVPool,
    layer: int,
    kv_start: torch.Tensor,
    kv_end: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    sm_scale: float,
    delta_step: float,
    num_kv_splits: int,
    out: torch.Tensor,
    certificate: bool,
    certificate_out: torch.Tensor | None,
    skip: torch.Tensor | None,
    use_gluon: bool,
) -> AttentionOutput:
    kernels = kernels_module()
    rows, num_q_heads, head_dim = q.shape
    kv_group = num_q_heads // pool.kv_heads
    # One program holds the query heads of one KV head (Triton pads the dots' rows for the tensor cores).
    block_h = _pow2(kv_group)
    head_blocks = pool.kv_heads * -(-kv_group // block_h)
    device = q.device
    part_out, part_lse, part_stats, lse, stats = _split_buffers(
        rows, num_q_heads, num_kv_splits, head_dim, certificate, device, nan_lse=False, certificate_out=certificate_out
    )
    q = q if q.stride(2) == 1 else q.contiguous()
    outliers = pool.num_outliers > 0
    # 64-bit addresses only where a side's codes reach 2**31 bytes (32-bit ones take fewer instructions).
    offsets_64 = pool.codes[layer, 0].numel() >= 2**31
    stage1_args = (
        kv_start,
        kv_end,
        kv_indices,
        kv_indices if skip is None else skip.view(torch.uint8),
        part_out,
        part_lse,
        *_stat_pointers(part_stats, part_lse),
        pool.num_slots,
        kv_indices.numel(),
        q.stride(0),
        q.stride(1),
        sm_scale,
        math.log(2.0 / delta_step) if certificate else 0.0,
        reference.bias_multiplier(pool.dither_bits, head_dim - pool.num_outliers),
    )
    use_ws = use_gluon and _runs_gluon_ws(q)
    if use_gluon:
        from witcert.kernels import gluon_decode, gluon_decode_ws, gluon_tiles

        grid = (rows, pool.kv_heads * -(-kv_group // gluon_tiles.HEADS), num_kv_splits)
        if use_ws:
            kernel, cap = gluon_decode_ws.decode_stage1_ws, LAUNCH.gluon_ws_maxnreg
        else:
            kernel = gluon_decode.decode_stage1_gluon
            cap = LAUNCH.gluon_maxnreg if certificate else LAUNCH.gluon_maxnreg_nocert
        kernel[grid](
            q,
            pool.codes[layer, 0],
            pool.scales[layer, 0],
            pool.codes[layer, 1],
            pool.scales[layer, 1],
            pool.channel_dither[layer, 0],
            pool.channel_dither[layer, 1],
            *stage1_args,
            pool.seed,
            layer,
            NUM_KV_HEADS=pool.kv_heads,
            KV_GROUP=kv_group,
            CERTIFICATE=certificate,
            V_DITHER=pool.v_dither,
            HAS_SKIP=skip is not None,
            OFFSETS_64=offsets_64,
            NUM_SPLITS=num_kv_splits,
            num_warps=gluon_tiles.NUM_WARPS,
            **({"maxnreg": cap} if cap else {}),
        )
    else:
        kernels.decode_stage1[(rows, head_blocks, num_kv_splits)](
            q,
            pool.codes[layer, 0],
            pool.scales[layer, 0],
            pool.outlier_values[layer, 0],
            pool.codes[layer, 1],
            pool.scales[layer, 1],
            pool.outlier_values[layer, 1],
            pool.channel_dither[layer, 0],
            pool.channel_dither[layer, 1],
            pool.outlier_index[layer],
            pool.outlier_channels_i32[layer],
            *stage1_args,
            pool.seed,
            layer,
            NUM_KV_HEADS=pool.kv_heads,
            KV_GROUP=kv_group,
            BLOCK_H=block_h,
            BLOCK_N=LAUNCH.triton_block_n(head_dim),
            HEAD_DIM=head_dim,
            GROUP_SIZE=pool.group_size,
            DITHER_BITS=pool.dither_bits,
            V_DITHER=pool.v_dither,
            HAS_OUTLIERS=outliers,
            OUTLIERS_PAD=max(2, _pow2(pool.num_outliers)),
            NUM_OUTLIERS=max(1, pool.num_outliers),
            CERTIFICATE=certificate,
            HAS_SKIP=skip is not None,
            OFFSETS_64=offsets_64,
            NUM_SPLITS=num_kv_splits,
            INTERPRETED=device.type != "cuda",
            num_warps=LAUNCH.num_warps,
            num_stages=LAUNCH.num_stages,
            **({"maxnreg": LAUNCH.maxnreg} if LAUNCH.maxnreg and device.type == "cuda" else {}),
        )
    _merge_splits(part_out, part_lse, part_stats, out, lse, stats)
    path: Path = (
        ("gluon-ws-gpu" if use_ws else "gluon-gpu")
        if use_gluon
        else "triton-gpu"
        if device.type == "cuda"
        else "triton-interpreter"
    )
    return _result(out, lse, stats, path)


def _stat_pointers(part_stats: _SplitPartials | None, part_lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The per-split certificate partials a kernel takes, or, without the certificate, ``part_lse`` in each
    place (the kernels compile those stores out, but a pointer must be passed)."""
    return part_stats if part_stats is not None else (part_lse,) * len(_SplitPartials._fields)


def _merge_splits(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    part_stats: _SplitPartials | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    stats: _Certificate | None,
) -> None:
    """Stage 2: merge the ``[rows, H_q, splits]`` partials into ``out`` and ``lse`` with LSE weights, and
    with ``part_stats`` (per split) evaluate the certificate into ``stats``; without, no certificate."""
    rows, num_q_heads, splits, head_dim = part_out.shape
    certificate = part_stats is not None
    kernels_module().decode_stage2[(rows, num_q_heads)](
        part_out,
        part_lse,
        *_stat_pointers(part_stats, part_lse),
        out,
        lse,
        *(stats if stats is not None else (lse,) * len(_Certificate._fields)),
        out.stride(0),
        out.stride(1),
        reference.CERTIFICATE_EVAL_SLACK,
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        NUM_SPLITS=splits,
        SPLITS_PAD=max(2, _pow2(splits)),
        CERTIFICATE=certificate,
        num_warps=LAUNCH.stage2_num_warps,
    )


def _run_reference(
    q: torch.Tensor,
    pool: KVPool,
    layer: int,
    kv_start: torch.Tensor,
    kv_end: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    sm_scale: float,
    delta_step: float,
    out: torch.Tensor,
    certificate: bool,
    certificate_out: torch.Tensor | None,
    skip: torch.Tensor | None,
) -> AttentionOutput:
    rows, num_q_heads, _ = q.shape
    device = q.device
    lse = torch.full((rows, num_q_heads), -math.inf, dtype=torch.float32, device=device)
    stats = _Certificate.allocate(rows, num_q_heads, device, fill=0.0, certificate=certificate_out)
    out.zero_()
    # Every row's tokens dequantized in one pass (K's dither from the pool's channel table), then attention per row.
    k_all = pool.dequantize(layer, kv_indices, "k")
    v_all = pool.dequantize(layer, kv_indices, "v")
    for row in range(rows):
        start = int(kv_start[row])
        length = int(kv_end[row]) - start
        if length == 0:
            continue
        slots = kv_indices[start : start + length]
        result = reference.decode_attention(
            q[row].float(),
            pool.quantized(layer, slots, "k"),
            pool.quantized(layer, slots, "v"),
            sm_scale=sm_scale,
            # Without a certificate the radius is unused; any valid delta serves.
            delta_step=delta_step if certificate else 0.5,
            skip=None if skip is None else skip[slots],
            k_hat=k_all[start : start + length],
            v_hat=v_all[start : start + length],
        )
        out[row] = result.out.to(out.dtype)
        lse[row] = result.lse
        stats.certificate[row] = result.certificate
        for index, field in enumerate(dataclasses.fields(result.accumulators)):
            stats.accumulators[index, row] = getattr(result.accumulators, field.name)
    return _result(out, lse, stats if certificate else None, "reference")


def _dispatch(
    q: torch.Tensor,
    pool: KVPool,
    layer: int,
    kv_start: torch.Tensor,
    kv_end: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    sm_scale: float | None,
    delta_step: float,
    num_kv_splits: int | None,
    out: torch.Tensor | None,
    certificate: bool,
    certificate_out: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
) -> AttentionOutput:
    rows, num_q_heads, head_dim = q.shape
    sm_scale = reference.softmax_scale(sm_scale, head_dim)
    out = _prepare_out(out, rows, num_q_heads, head_dim, q.device)
    path = select_path(q.device)
    if path == "reference" or pool.dither_bits != 8:
        return _run_reference(
            q,
            pool,
            layer,
            kv_start,
            kv_end,
            kv_indices,
            sm_scale=sm_scale,
            delta_step=delta_step,
            out=out,
            certificate=certificate,
            certificate_out=certificate_out,
            skip=skip,
        )
    use_gluon = _runs_gluon(q, pool, kv_indices)
    splits = _checked_splits(num_kv_splits, *_stage1_units(q, pool, use_gluon, certificate), q.device)
    return _run_triton(
        q,
        pool,
        layer,
        kv_start,
        kv_end,
        kv_indices,
        sm_scale=sm_scale,
        delta_step=delta_step,
        num_kv_splits=splits,
        out=out,
        certificate=certificate,
        certificate_out=certificate_out,
        skip=skip,
        use_gluon=use_gluon,
    )


def decode_attention(
    q: torch.Tensor,
    pool: KVPool,
    layer: int,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    sm_scale: float | None = None,
    delta_step: float,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    certificate: bool = True,
    validate: bool | None = None,
    skip: torch.Tensor | None = None,
    certificate_out: torch.Tensor | None = None,
) -> AttentionOutput:
    """One decode step: ``q`` ``[B, H_q, D]`` attends to the slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.

    GQA when ``H_q > H_kv`` (query head ``i`` reads KV head ``i // (H_q / H_kv)``). ``out`` defaults to
    a new float32 tensor; pass a preallocated one (any float dtype) for CUDA graphs; ``certificate_out``, a
    contiguous float32 ``[B, H_q]`` tensor, likewise takes the certificate (a report buffer's rows, written in
    place instead of copied there; ``StepReport.destination``). The number of
    splits is fixed by shapes, never by sequence lengths, so a captured graph replays for any lengths.
    An empty sequence yields ``out = 0``, ``lse = -inf`` and certificate 0. Only 8-bit dithers have a
    Triton path; other widths run the reference.

    ``skip`` (bool ``[num_slots, H_kv]``, optional) leaves the marked (slot, KV head) pairs out, as if
    absent: gating uses it for slots it attends to exactly instead (``integrations/gating.py``). The
    radius still counts every token of the row in its union bound, which only makes it larger.
    """
    _check_common(q, pool, layer, delta_step, certificate)
    if skip is not None and (
        not isinstance(skip, torch.Tensor)
        or skip.dtype != torch.bool
        or skip.shape != (pool.num_slots, pool.kv_heads)
        or skip.device != q.device
        or not skip.is_contiguous()
    ):
        raise ValueError(f"skip must be a contiguous bool [{pool.num_slots}, {pool.kv_heads}] tensor on {q.device}")
    _check_index_tensor("kv_indptr", kv_indptr, q.device)
    _check_index_tensor("kv_indices", kv_indices, q.device)
    if kv_indptr.numel() != q.shape[0] + 1:
        raise ValueError(f"kv_indptr must have B + 1 = {q.shape[0] + 1} entries, got {kv_indptr.numel()}")
    if certificate_out is not None and (
        not certificate
        or not isinstance(certificate_out, torch.Tensor)
        or certificate_out.dtype != torch.float32
        or certificate_out.shape != q.shape[:2]
        or certificate_out.device != q.device
        or not certificate_out.is_contiguous()
    ):
        raise ValueError(f"certificate_out must be a contiguous float32 {list(q.shape[:2])} tensor on {q.device}, "
                         "with certificate=True")  # fmt: skip
    if validate if validate is not None else q.device.type != "cuda":
        _check_values(kv_indptr, kv_indices, pool)
    # Row b's indices are [kv_indptr[b], kv_indptr[b + 1]): two views, no kernel before stage 1.
    kv_start, kv_end = kv_indptr[:-1], kv_indptr[1:]
    return _dispatch(
        q,
        pool,
        layer,
        kv_start,
        kv_end,
        kv_indices,
        sm_scale=sm_scale,
        delta_step=delta_step,
        num_kv_splits=num_kv_splits,
        out=out,
        certificate=certificate,
        certificate_out=certificate_out,
        skip=skip,
    )


def extend_attention(
    q: torch.Tensor,
    pool: KVPool,
    layer: int,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    sm_scale: float | None = None,
    delta_step: float,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    certificate: bool = True,
    validate: bool | None = None,
    bounds: ExtendBounds | tuple[list[int], list[int]] | None = None,
) -> AttentionOutput:
    """Causal attention of new tokens over a quantized prefix plus themselves, with a certificate per token.

    ``q`` ``[T, H_q, D]`` holds the new tokens of every sequence, sequence ``b`` owning rows
    ``qo_indptr[b]:qo_indptr[b+1]``. Their K/V must already be written to the pool:
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` lists sequence ``b``'s slots, prefix first, new tokens
    last. New token ``i`` of a sequence with ``n`` new and ``S`` total tokens sees the first
    ``S - n + i + 1`` slots, and gets its own certificate (its own length, its own tail multiplier). Calls
    that the tiled kernel covers (8-bit dithers, V rounded to nearest, no outlier channels; ``triton_extend``)
    read each K/V tile once per block of 16 new tokens. The others, and every call with
    ``LAUNCH.extend_tiled = False``, run each query token as one row of the decode kernels, which reads its
    prefix in full: the same values and certificates, many more reads for long prompts.

    On a GPU, calls without the certificate run PyTorch's SDPA over the keys and values gathered from the
    pool instead (``extend_sdpa``; ``LAUNCH.extend_sdpa``): the same attention rounded as half-precision
    attention is (the H200 test allows 4e-3 relative for fp16, 2e-2 for bf16), with ``lse`` None and, unless
    ``out`` is given, ``out`` in q's dtype; on the H200 0.97-1.16x the time of SDPA on an fp16 cache for one
    sequence (docs/KERNELS.md, Extend). It needs the offsets on the host: ``bounds`` (an ``ExtendBounds`` of
    ``qo_indptr`` and ``kv_indptr``, which an engine makes once per batch; or the two as lists, checked on
    every call) saves reading them back, a synchronisation per call. ``validate`` (default: on CPU only)
    checks every index against the pool; unvalidated, an out-of-range slot makes the rows that see it NaN.
    """
    _check_common(q, pool, layer, delta_step, certificate)
    for name, x in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        _check_index_tensor(name, x, q.device)
    if qo_indptr.numel() != kv_indptr.numel() or qo_indptr.numel() < 1:
        raise ValueError("qo_indptr and kv_indptr must both have B + 1 entries")
    validating = validate if validate is not None else q.device.type != "cuda"
    on_sdpa = not certificate and extend_sdpa.covers(q, pool)
    if bounds is not None:
        bounds = bounds if isinstance(bounds, ExtendBounds) else ExtendBounds(*bounds)
        if validating:
            _read_back(pool, kv_indices)
    elif on_sdpa or validating:
        # The SDPA path slices each sequence on the host, so it reads the offsets back even unvalidated.
        bounds = ExtendBounds(*_read_back(pool, kv_indices, qo_indptr, kv_indptr, slot_range=validating))
    if bounds is not None:
        bounds.check_against(qo_indptr.numel() - 1, q.shape[0], kv_indices.numel())
    if on_sdpa and extend_sdpa.fits(q, pool, bounds):
        if out is not None:
            out = _prepare_out(out, q.shape[0], q.shape[1], q.shape[2], q.device)
        scale = reference.softmax_scale(sm_scale, q.shape[2])
        attended = extend_sdpa.attend(q, pool, layer, bounds, (qo_indptr, kv_indptr), kv_indices, sm_scale=scale)
        # Without an ``out`` to fill, SDPA's own half-precision result is returned as it is: copying it into
        # float32 would only round back to the same values at the engine, twice the bytes on the way.
        return AttentionOutput(attended if out is None else out.copy_(attended), None, None, None, "sdpa-gpu")
    tiled = (
        LAUNCH.extend_tiled
        and select_path(q.device) != "reference"
        and pool.dither_bits == 8
        and not pool.v_dither
        and pool.num_outliers == 0
    )
    if tiled:
        return _run_extend_tiled(
            q,
            pool,
            layer,
            qo_indptr,
            kv_indptr,
            kv_indices,
            sm_scale=sm_scale,
            delta_step=delta_step,
            num_kv_splits=num_kv_splits,
            out=out,
            certificate=certificate,
        )
    token = torch.arange(q.shape[0], device=q.device, dtype=torch.int64)
    sequence = torch.searchsorted(qo_indptr.to(torch.int64)[1:], token, right=True)
    qo = qo_indptr.to(torch.int64)
    kv = kv_indptr.to(torch.int64)
    new_tokens = qo[sequence + 1] - qo[sequence]
    position = token - qo[sequence]
    kv_start = kv[sequence]
    # A malformed row gets an end before its start, which the kernel refuses (NaN) rather than reads.
    kv_end = kv[sequence + 1] - new_tokens + position + 1
    return _dispatch(
        q,
        pool,
        layer,
        kv_start,
        kv_end,
        kv_indices,
        sm_scale=sm_scale,
        delta_step=delta_step,
        num_kv_splits=num_kv_splits,
        out=out,
        certificate=certificate,
    )


def _run_extend_tiled(
    q: torch.Tensor,
    pool: KVPool,
    layer: int,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    sm_scale: float | None,
    delta_step: float,
    num_kv_splits: int | None,
    out: torch.Tensor | None,
    certificate: bool,
) -> AttentionOutput:
    """``triton_extend.extend_stage1`` over blocks of new tokens, then decode's stage 2 with the query tokens
    as its rows. The block table is built on the device from shapes (no host sync): a grid of
    ``ceil(T / BLOCK_M) + B`` blocks, enough for any split of ``T`` tokens into ``B`` sequences."""
    from witcert.kernels import triton_extend

    tokens, num_q_heads, head_dim = q.shape
    sm_scale = reference.softmax_scale(sm_scale, head_dim)
    out = _prepare_out(out, tokens, num_q_heads, head_dim, q.device)
    device = q.device
    kv_group = num_q_heads // pool.kv_heads
    block_h = _pow2(kv_group)
    block_m = max(1, LAUNCH.extend_rows // block_h)
    sequences = qo_indptr.numel() - 1
    qo = qo_indptr.to(torch.int64)
    blocks = (torch.clamp(qo[1:] - qo[:-1], min=0) + block_m - 1) // block_m
    ends = torch.cumsum(blocks, 0)
    grid_blocks = -(-tokens // block_m) + sequences
    index = torch.arange(grid_blocks, device=device)
    block_sequence = torch.searchsorted(ends, index, right=True)  # == sequences past the last block
    first_block = (ends - blocks)[torch.clamp(block_sequence, max=max(sequences - 1, 0))]
    block_first = (index - first_block) * block_m
    splits = _checked_splits(num_kv_splits, grid_blocks * pool.kv_heads, LAUNCH.programs_per_sm(), device)
    # NaN until written: a row no block covers (a qo_indptr that does not end at T) comes out NaN.
    part_out, part_lse, part_stats, lse, stats = _split_buffers(
        tokens, num_q_heads, splits, head_dim, certificate, device, nan_lse=True
    )
    q = q if q.stride(2) == 1 else q.contiguous()
    interpreted = device.type != "cuda"
    if tokens and sequences:
        triton_extend.extend_stage1[(grid_blocks, pool.kv_heads, splits)](
            q,
            pool.codes[layer, 0],
            pool.scales[layer, 0],
            pool.codes[layer, 1],
            pool.scales[layer, 1],
            pool.channel_dither[layer, 0],
            qo_indptr,
            kv_indptr,
            kv_indices,
            block_sequence.to(torch.int32),
            block_first.to(torch.int32),
            part_out,
            part_lse,
            *_stat_pointers(part_stats, part_lse),
            sequences,
            pool.num_slots,
            kv_indices.numel(),
            q.stride(0),
            q.stride(1),
            sm_scale,
            math.log(2.0 / delta_step) if certificate else 0.0,
            reference.bias_multiplier(pool.dither_bits, head_dim - pool.num_outliers),
            NUM_KV_HEADS=pool.kv_heads,
            KV_GROUP=kv_group,
            BLOCK_H=block_h,
            BLOCK_M=block_m,
            BLOCK_N=LAUNCH.extend_block_n,
            HEAD_DIM=head_dim,
            GROUP_SIZE=pool.group_size,
            OFFSETS_64=pool.codes[layer, 0].numel() >= 2**31,
            NUM_SPLITS=splits,
            CERTIFICATE=certificate,
            INTERPRETED=interpreted,
            num_warps=LAUNCH.extend_num_warps,
        )
        _merge_splits(part_out, part_lse, part_stats, out, lse, stats)
    else:
        # No sequence to cover the tokens: a malformed qo_indptr (validation off) makes NaN, as in decode.
        out.fill_(math.nan)
        lse.fill_(math.nan)
        for value in stats or ():
            value.fill_(math.nan)
    return _result(out, lse, stats, "triton-gpu" if device.type == "cuda" else "triton-interpreter")
