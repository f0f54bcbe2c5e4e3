"""Reference implementation of the certificate mathematics (docs/THEORY.md), in plain torch.

This module is the oracle every kernel is tested against and the stable entry point for code
outside the package. It favours readability over speed, runs on CPU and GPU, and computes in
float64 when given float64 queries.

Names follow docs/THEORY.md: ``scales`` are the per-group fp16 scales ``s``, ``radius`` is ``u_t``,
``certificate`` is ``min(T1, T4, P, PA)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

# --- Philox4x32-10 (Random123) -------------------------------------------------------------------

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
_MASK32 = 0xFFFFFFFF


def _mulhilo32(multiplier: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``multiplier * x`` for uint32 values held in int64.

    The full product needs 64 unsigned bits, which int64 cannot hold, so x is split in 16-bit
    halves: every partial product stays below 2**49.
    """
    x_lo = x & 0xFFFF
    x_hi = x >> 16
    low_part = multiplier * x_lo  # < 2**48
    high_part = multiplier * x_hi  # < 2**48; the product is high_part * 2**16 + low_part
    lo = (((high_part & 0xFFFF) << 16) + low_part) & _MASK32
    hi = (high_part + (low_part >> 16)) >> 16
    return hi, lo


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Random123's philox4x32-10 block function.

    ``counter``: int64 ``[..., 4]`` and ``key``: int64 ``[..., 2]``, both holding uint32 values
    (broadcastable against each other). Returns int64 ``[..., 4]`` of uint32 values.
    """
    if counter.dtype != torch.int64 or key.dtype != torch.int64:
        raise TypeError(f"counter and key must be int64 tensors, got {counter.dtype} and {key.dtype}")
    if counter.shape[-1] != 4 or key.shape[-1] != 2:
        raise ValueError(
            f"counter must be [..., 4] and key [..., 2], got {tuple(counter.shape)} and {tuple(key.shape)}"
        )
    if bool(((counter < 0) | (counter > _MASK32)).any()) or bool(((key < 0) | (key > _MASK32)).any()):
        raise ValueError("counter and key words must be uint32 values (0 <= w < 2**32)")
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key.unbind(-1)
    for round_index in range(PHILOX_ROUNDS):
        if round_index:
            k0 = (k0 + PHILOX_W0) & _MASK32
            k1 = (k1 + PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3)
    return torch.stack((c0, c1, c2, c3), dim=-1)


# --- the dither stream ------------------------------------------------------------------------------

Kind = Literal["k", "v"]
KIND_BIT = {"k": 0, "v": 1}
DITHER_BITS = (8, 16, 24)


def dithers_per_word(dither_bits: int) -> int:
    """How many ``dither_bits``-bit fields one 32-bit Philox word feeds (1, 2 or 4)."""
    if dither_bits not in DITHER_BITS:
        raise ValueError(f"dither_bits must be one of {DITHER_BITS}, got {dither_bits}")
    return 32 // dither_bits


def channels_per_philox_call(dither_bits: int) -> int:
    """Channels served by one Philox call: 4 words times the fields per word (4, 8 or 16)."""
    return 4 * dithers_per_word(dither_bits)


def channel_address(channels: torch.Tensor, dither_bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where channel ``c``'s dither lives: (Philox call index, word index, right shift of its field).

    Call ``c // C`` (``C`` channels per call); within it, local index ``i = c % C`` takes word
    ``i // F`` and field ``i % F`` (``F`` fields per word), fields counted from the most significant bits.
    """
    per_call = channels_per_philox_call(dither_bits)
    per_word = dithers_per_word(dither_bits)
    channels = channels.to(torch.int64)
    local = channels % per_call
    shift = 32 - (local % per_word + 1) * dither_bits
    return channels // per_call, local // per_word, shift


# Counter word 1 names the part of the dither a call feeds: the per-slot offset or a block of per-channel values.
SLOT_PART = 0
CHANNEL_PART = 1


def dither_counter(index: torch.Tensor, part: int, layer: int, kv_head: torch.Tensor, kind: Kind) -> torch.Tensor:
    """Philox counter words ``(index, part, layer, kv_head | kind << 31)``, broadcast together.

    ``index`` is a slot (``part = SLOT_PART``) or a channel block (``part = CHANNEL_PART``). The slot, not
    the sequence position, keys the per-slot part: slots stay put under paging, prefix sharing and
    retraction. The kind bit gives K and V independent streams.
    """
    if kind not in KIND_BIT:
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    if part not in (SLOT_PART, CHANNEL_PART):
        raise ValueError(f"part must be SLOT_PART or CHANNEL_PART, got {part}")
    if not 0 <= layer <= _MASK32:
        raise ValueError(f"layer must be in [0, 2**32), got {layer}")
    if bool((kv_head >= 2**31).any()) or bool((kv_head < 0).any()):
        raise ValueError("kv_head must be in [0, 2**31): the top bit of the counter word holds the K/V kind")
    if bool((index < 0).any()) or bool((index > _MASK32).any()):
        raise ValueError("slots and channel blocks must be in [0, 2**32)")
    word3 = kv_head | (KIND_BIT[kind] << 31)
    c0, c3 = torch.broadcast_tensors(index, word3)
    return torch.stack((c0, torch.full_like(c0, part), torch.full_like(c0, layer), c3), dim=-1)


def seed_key(seed: int) -> torch.Tensor:
    """Philox key words for a 64-bit seed, in ``tl.philox``'s order: ``(seed & 0xffffffff, seed >> 32)``."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an unsigned 64-bit integer, got {seed}")
    return torch.tensor([seed & _MASK32, seed >> 32], dtype=torch.int64)


def channel_dither_fields(
    *, seed: int, layer: int, num_kv_heads: int, head_dim: int, kind: Kind, dither_bits: int, device=None
) -> torch.Tensor:
    """The per-channel fields ``j`` in ``[0, 2**b)`` of every (kv head, channel): int64 ``[H_kv, D]``.

    Channel ``c`` reads call ``c // C`` of the channel part (``C`` = channels per call); within it,
    local index ``i = c % C`` takes word ``i // F`` and field ``i % F`` (``F`` fields per word), fields
    counted from the word's most significant bits.
    """
    per_call = channels_per_philox_call(dither_bits)
    if head_dim % per_call:
        raise ValueError(f"head_dim {head_dim} must be a multiple of {per_call} for {dither_bits}-bit dither")
    block, word, shift = channel_address(torch.arange(head_dim, device=device), dither_bits)
    heads = torch.arange(num_kv_heads, device=device, dtype=torch.int64)
    calls = torch.arange(head_dim // per_call, device=device, dtype=torch.int64)
    counter = dither_counter(calls[None, :], CHANNEL_PART, layer, heads[:, None], kind)
    words = philox4x32_10(counter, seed_key(seed).to(device))  # [H, D / C, 4]
    return (words[:, block, word] >> shift) & ((1 << dither_bits) - 1)


def has_slot_part(kind: Kind) -> bool:
    """Whether ``kind``'s dither has the per-slot part ``beta_t``: V's does, K's is ``alpha_c`` alone
    (docs/THEORY.md, section 1). A logit's error sums over the channels of one token, whose ``alpha_c`` are
    independent uniform draws on their own; V's error sums over the slots of one channel, which need ``beta_t``."""
    if kind not in KIND_BIT:
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    return kind == "v"


def slot_dither_bits(dither_bits: int) -> int:
    """Bits of the per-slot part: ``min(b, 16)``. Any ``beta`` on a grid of ``2**-b`` keeps ``alpha + beta mod 1``
    uniform on ``2**b`` equally spaced points; at 24 bits a finer ``beta`` would let ``fl(x / s + xi)`` reach
    127.5 and round out of ``[-127, 127]`` (docs/THEORY.md, section 1)."""
    dithers_per_word(dither_bits)
    return min(dither_bits, 16)


def slot_dither_fields(
    *, seed: int, layer: int, slots: torch.Tensor, num_kv_heads: int, kind: Kind, dither_bits: int
) -> torch.Tensor:
    """The per-slot fields ``m`` in ``[0, 2**min(b, 16))`` of every (slot, kv head): int64 ``[N, H_kv]``, the
    top bits of word 0 of the slot's call. V only (``has_slot_part``)."""
    if not has_slot_part(kind):
        raise ValueError(f"the {kind!r} side's dither has no per-slot part")
    bits = slot_dither_bits(dither_bits)
    slots = slots.to(torch.int64)
    heads = torch.arange(num_kv_heads, device=slots.device, dtype=torch.int64)
    counter = dither_counter(slots[:, None], SLOT_PART, layer, heads[None, :], kind)
    words = philox4x32_10(counter, seed_key(seed).to(slots.device))  # [N, H, 4]
    return words[..., 0] >> (32 - bits)


def channel_dither_values(fields: torch.Tensor, dither_bits: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``alpha = (j + 1/2) / 2**b - 1/2`` in ``(-1/2, 1/2)``, rounded once into ``dtype`` (exact in float32
    for ``b <= 16``)."""
    return ((fields.to(torch.float64) + 0.5) / float(1 << dither_bits) - 0.5).to(dtype)


def slot_dither_values(fields: torch.Tensor, dither_bits: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``beta = (m + 1/2) / 2**B - 1/2`` in ``(-1/2, 1/2)``, ``B = min(b, 16)`` (exact in float32). Half a step
    off the integers, like ``alpha``: ``|alpha + beta| <= 1 - 2**-(b+1) - 2**-(B+1)`` on both sides."""
    return ((fields.to(torch.float64) + 0.5) / float(1 << slot_dither_bits(dither_bits)) - 0.5).to(dtype)


def dither_values(
    *,
    seed: int,
    layer: int,
    slots: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    kind: Kind,
    dither_bits: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``xi = alpha_c + beta_t`` (V) or ``alpha_c`` (K, ``has_slot_part``) for every (slot, kv head, channel):
    ``[N, H_kv, D]`` in ``(-1, 1)``, the sum rounded once into ``dtype`` (exact in float32 for ``b <= 16``, and
    ``alpha`` alone at every ``b``).

    Over the per-channel part, a slot's ``xi mod 1`` are independent and uniform on the ``2**b`` points
    ``(i + 1/2) / 2**b`` whatever its ``beta``; over V's per-slot part, so are one channel's across slots
    whatever ``alpha`` (docs/THEORY.md, section 1).
    """
    alpha = channel_dither_values(
        channel_dither_fields(
            seed=seed,
            layer=layer,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            kind=kind,
            dither_bits=dither_bits,
            device=slots.device,
        ),
        dither_bits,
    )
    if not has_slot_part(kind):
        return alpha.to(dtype)[None, :, :].expand(slots.shape[0], -1, -1).contiguous()
    beta = slot_dither_values(
        slot_dither_fields(
            seed=seed, layer=layer, slots=slots, num_kv_heads=num_kv_heads, kind=kind, dither_bits=dither_bits
        ),
        dither_bits,
    )
    return (alpha[None, :, :] + beta[:, :, None]).to(dtype)


# --- write path: the quantizer ------------------------------------------------------------------------

QMAX = 127
SCALE_DIVISOR = QMAX - 0.5  # |x / s| <= 126.5 keeps round(x / s + xi) inside [-127, 127]


# V's scales keep 4 significant bits (the fp16 value's 7 low significand bits zero): then ``s * code`` for a code
# of at most 7 bits has at most 11 significant bits and is exact in fp16, so the decode kernel takes V as one fp16
# operand. K's keep all 11: the certificate's radius is proportional to K's scales.
V_SCALE_SIGNIFICANT_BITS = 4
_FP16_SIGNIFICAND_BITS = 11


def fp16_scale_rounded_up(amax: torch.Tensor, significant_bits: int = _FP16_SIGNIFICAND_BITS) -> torch.Tensor:
    """The smallest fp16 ``s`` with at most ``significant_bits`` significant bits and ``s * 126.5 >= amax``
    (exactly), as stored.

    ``amax / 126.5`` is rounded to fp16 and then stepped up while it is too small. ``s * 126.5`` is
    exact in float32 (11 + 8 significant bits), so the comparison is exact. Fewer significant bits round that
    fp16 value up to the next value that has them (subnormal ones too); 0, inf and NaN stay as they are.
    """
    if not 1 <= significant_bits <= _FP16_SIGNIFICAND_BITS:
        raise ValueError(f"significant_bits must be in [1, 11], got {significant_bits}")
    amax = amax.to(torch.float32)
    scale = (amax / SCALE_DIVISOR).to(torch.float16)
    for _ in range(3):  # at most one step is needed; three make it robust to double rounding
        too_small = scale.to(torch.float32) * SCALE_DIVISOR < amax
        if not bool(too_small.any()):
            break
        scale = torch.where(too_small, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    if significant_bits < _FP16_SIGNIFICAND_BITS:
        # In float32, where every fp16 value is normal: the next multiple of the coarser step in the bits (which
        # carries into the exponent). The result has at most ``significant_bits`` bits and is a multiple of
        # 2**-24 at least (it rounds up a value that is one), so it converts back to fp16 exactly.
        step = 1 << (24 - significant_bits)
        bits = scale.to(torch.float32).view(torch.int32)
        coarse = ((bits + step - 1) & ~(step - 1)).view(torch.float32).to(torch.float16)
        scale = torch.where(torch.isfinite(scale), coarse, scale)
    return scale


def largest_amax(kind: Kind) -> float:
    """The largest group amax a stored scale of side ``kind`` covers: ``126.5`` times the largest fp16 value with
    that side's significant bits, ``(2 - 2**(1 - bits)) 2**15`` (65504 for K, 61440 for V; both products exact in
    float32)."""
    return (2.0 - 2.0 ** (1 - scale_significant_bits(kind))) * 2.0**15 * SCALE_DIVISOR


def scale_significant_bits(kind: Kind) -> int:
    """How many significant bits the stored scales of side ``kind`` keep."""
    if kind not in KIND_BIT:
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    return V_SCALE_SIGNIFICANT_BITS if kind == "v" else _FP16_SIGNIFICAND_BITS


@dataclass
class QuantizedKV:
    """One side (K or V) of a quantized cache for ``N`` token slots.

    ``codes`` int8 ``[N, H_kv, D]`` (outlier channels hold 0), ``scales`` fp16 ``[N, H_kv, D / G]``,
    ``outlier_values`` ``[N, H_kv, 2m]`` in the model dtype and ``outlier_channels`` int64
    ``[H_kv, 2m]`` (both empty when ``m = 0``). The dither is not stored: it is regenerated from
    ``(seed, layer, slots, kind)``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    outlier_values: torch.Tensor
    outlier_channels: torch.Tensor
    slots: torch.Tensor
    seed: int
    layer: int
    kind: Kind
    group_size: int
    dither_bits: int
    # False: rounded to nearest (xi = 0). The TV certificate needs dither on K only; V may skip it.
    dithered: bool = True

    @property
    def num_tokens(self) -> int:
        return self.codes.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.codes.shape[1]

    @property
    def head_dim(self) -> int:
        return self.codes.shape[2]

    @property
    def bytes_per_token_head(self) -> int:
        """Stored bytes per token per KV head for this side: ``D + 2 * D / G + 2 * 2m`` (fp16 outliers)."""
        return (
            self.head_dim * self.codes.element_size()
            + self.scales.shape[-1] * self.scales.element_size()
            + self.outlier_channels.shape[-1] * self.outlier_values.element_size()
        )

    def dither(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if not self.dithered:
            return torch.zeros(self.codes.shape, dtype=dtype, device=self.codes.device)
        return dither_values(
            seed=self.seed,
            layer=self.layer,
            slots=self.slots,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            kind=self.kind,
            dither_bits=self.dither_bits,
            dtype=dtype,
        )

    def channel_scales(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Scales expanded to one per channel ``[N, H_kv, D]``; zero on outlier channels (they carry no error)."""
        expanded = self.scales.to(dtype).repeat_interleave(self.group_size, dim=-1)
        if self.outlier_channels.numel():
            expanded = expanded.scatter(-1, self.outlier_channels.expand(self.num_tokens, -1, -1), 0.0)
        return expanded

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``x_hat = s * (code - xi)``, with outlier channels restored exactly: ``[N, H_kv, D]``."""
        scales = self.scales.to(dtype).repeat_interleave(self.group_size, dim=-1)
        x_hat = scales * (self.codes.to(dtype) - self.dither(dtype))
        if self.outlier_channels.numel():
            index = self.outlier_channels.expand(self.num_tokens, -1, -1)
            x_hat = x_hat.scatter(-1, index, self.outlier_values.to(dtype))
        return x_hat


def check_outlier_channels(
    outlier_channels: torch.Tensor | None, num_kv_heads: int, head_dim: int, device
) -> torch.Tensor:
    if outlier_channels is None:
        return torch.empty(num_kv_heads, 0, dtype=torch.int64, device=device)
    channels = torch.as_tensor(outlier_channels, device=device)
    if channels.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"outlier_channels must be an integer tensor, got {channels.dtype}")
    channels = channels.to(torch.int64)
    if channels.dim() == 1:
        channels = channels.expand(num_kv_heads, -1)
    if channels.dim() != 2 or channels.shape[0] != num_kv_heads:
        raise ValueError(f"outlier_channels must be [2m] or [H_kv={num_kv_heads}, 2m], got {tuple(channels.shape)}")
    if channels.shape[1] % 2:
        raise ValueError("outlier_channels must hold whole RoPE pairs (an even count per head)")
    if channels.numel() and (bool((channels < 0).any()) or bool((channels >= head_dim).any())):
        raise ValueError(f"outlier_channels must lie in [0, {head_dim})")
    if channels.shape[1] and bool((channels.sort(-1).values.diff(dim=-1) == 0).any()):
        raise ValueError("outlier_channels repeats a channel within a head")
    return channels.contiguous()


def rope_pair_channels(pairs: list[int] | torch.Tensor, head_dim: int) -> torch.Tensor:
    """Channels of RoPE pairs in the rotate-half layout (Llama, Qwen2): pair ``i`` is ``(i, i + D/2)``."""
    pairs = torch.as_tensor(pairs, dtype=torch.int64)
    if bool((pairs < 0).any()) or bool((pairs >= head_dim // 2).any()):
        raise ValueError(f"RoPE pair indices must lie in [0, {head_dim // 2})")
    return torch.cat((pairs, pairs + head_dim // 2)).sort().values


def quantize(
    x: torch.Tensor,
    *,
    seed: int,
    layer: int,
    slots: torch.Tensor,
    kind: Kind,
    group_size: int = 32,
    outlier_channels: torch.Tensor | None = None,
    dither_bits: int = 24,
    dither: bool = True,
    xi: torch.Tensor | None = None,
) -> QuantizedKV:
    """Subtractive-dither int8 quantization of ``x`` ``[N, H_kv, D]`` (THEORY.md section 1).

    ``xi``: the dither, broadcastable to ``[N, H_kv, D]`` float32, when the caller holds it already (a pool's
    per-channel table for K); it must equal ``dither_values(...)``, which is computed otherwise.

    ``code = round(x / s + xi)`` with the *stored* fp16 scale ``s`` (rounded up so nothing clips);
    outlier channels are kept exactly and left out of their group's amax. ``dither=False`` rounds to
    nearest (``xi = 0``, ties to even): meant for V, whose dither only serves the output-error bound.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [N, H_kv, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    num_tokens, num_kv_heads, head_dim = x.shape
    if group_size <= 0 or head_dim % group_size:
        raise ValueError(f"group_size {group_size} must divide head_dim {head_dim}")
    slots = torch.as_tensor(slots, device=x.device)
    if slots.shape != (num_tokens,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slots must be an integer tensor of shape [{num_tokens}], got {slots.dtype} {tuple(slots.shape)}"
        )
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x contains NaN or inf: a quantized cache cannot represent it")
    channels = check_outlier_channels(outlier_channels, num_kv_heads, head_dim, x.device)
    dithers_per_word(dither_bits)  # validates dither_bits before any work

    x32 = x.to(torch.float32)
    is_outlier = torch.zeros(num_kv_heads, head_dim, dtype=torch.bool, device=x.device)
    if channels.numel():
        is_outlier.scatter_(-1, channels, True)
    magnitude = torch.where(is_outlier, torch.zeros((), device=x.device), x32.abs())
    amax = magnitude.view(num_tokens, num_kv_heads, head_dim // group_size, group_size).amax(-1)
    if bool((amax > largest_amax(kind)).any()):
        raise ValueError(f"|x| exceeds what a group scale of {kind.upper()} can cover (max {largest_amax(kind):.6g})")
    scales = fp16_scale_rounded_up(amax, scale_significant_bits(kind))

    if not dither:
        xi = torch.zeros((), device=x.device)
    elif xi is None:
        xi = dither_values(
            seed=seed,
            layer=layer,
            slots=slots,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            kind=kind,
            dither_bits=dither_bits,
        )
    channel_scale = scales.to(torch.float32).repeat_interleave(group_size, dim=-1)
    safe_scale = torch.where(channel_scale > 0, channel_scale, torch.ones((), device=x.device))
    # The stored fp16 scale is the one divided by: any other value breaks |e| <= s/2.
    scaled = torch.where(channel_scale > 0, x32 / safe_scale, torch.zeros((), device=x.device))
    codes = torch.round(scaled + xi)
    codes = torch.where(is_outlier, torch.zeros((), device=x.device), codes)
    codes = codes.to(torch.int8)

    # Outliers keep the model dtype: zero error, 2 bytes each for fp16/bf16 activations.
    if channels.numel():
        outlier_values = x.gather(-1, channels.expand(num_tokens, -1, -1))
    else:
        outlier_values = torch.empty(num_tokens, num_kv_heads, 0, dtype=x.dtype, device=x.device)
    return QuantizedKV(
        codes=codes,
        scales=scales,
        outlier_values=outlier_values,
        outlier_channels=channels,
        slots=slots.to(torch.int64),
        seed=seed,
        layer=layer,
        kind=kind,
        group_size=group_size,
        dither_bits=dither_bits,
        dithered=dither,
    )


# --- read path: radius, accumulators, certificate -----------------------------------------------------


def fp_slack(dither_bits: int) -> float:
    """``beta``: the bias of the dithered error per unit scale, plus float32 slack (docs/THEORY.md).

    ``2**-(b+1)`` is the largest mean of the discrete dither error; ``2**-16`` covers the float32
    rounding of ``x / s`` (``2**-18``), of ``code - xi`` (``<= 2**-18``) and of ``s * (...)``
    (``<= 2**-17``), all relative to ``s``.
    """
    dithers_per_word(dither_bits)
    return 2.0 ** -(dither_bits + 1) + 2.0**-16


# Relative slack applied to the evaluated bound: it absorbs float32 rounding in the sums of
# non-negative terms (relative error below (n - 1) * 2**-24 for n partial sums) and in exp/expm1.
CERTIFICATE_EVAL_SLACK = 1.0 + 2.0**-10

DEFAULT_DELTA_REQ = 1e-2
DEFAULT_HORIZON = 256


def delta_step(
    num_layers: int, num_q_heads: int, *, delta_req: float = DEFAULT_DELTA_REQ, horizon: int = DEFAULT_HORIZON
) -> float:
    """Failure probability per (layer, head, step) so that every certificate of a request holds at once
    with probability ``>= 1 - delta_req`` (union bound over ``L * H_q * T`` certificates)."""
    if not 0 < delta_req < 1:
        raise ValueError(f"delta_req must be in (0, 1), got {delta_req}")
    if num_layers <= 0 or num_q_heads <= 0 or horizon <= 0:
        raise ValueError("num_layers, num_q_heads and horizon must be positive")
    return delta_req / (num_layers * num_q_heads * horizon)


def tail_multiplier(num_tokens: int, delta: float) -> float:
    """``c = sqrt(2 ln(2 S / delta))``: a union bound over ``S`` two-sided sub-Gaussian tails."""
    if not 0 < delta < 1:
        raise ValueError(f"delta_step must be in (0, 1), got {delta}")
    if num_tokens <= 0:
        raise ValueError("num_tokens must be positive")
    return math.sqrt(2.0 * math.log(2.0 * num_tokens / delta))


def expm1_minus_x(x: torch.Tensor) -> torch.Tensor:
    """``g(x) = expm1(x) - x`` without cancellation for small ``x`` (Taylor series below 0.05), and ``+inf`` at
    ``x = +inf`` (a radius that overflowed float32), where ``expm1(x) - x`` would be ``inf - inf``."""
    small = x.abs() < 0.05
    # Horner form of x^2/2! + ... + x^8/8!: truncation below 1e-14 relative for |x| < 0.05.
    series = torch.zeros_like(x)
    for n in range(8, 1, -1):
        series = (series + 1.0 / math.factorial(n)) * x
    series = series * x
    return torch.where(small, series, torch.where(x == math.inf, x, torch.expm1(x) - x))


def mul_nonneg(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Product of non-negative bounds where an overflowed (+inf) factor makes the product +inf, never NaN."""
    return torch.where(torch.isinf(a) | torch.isinf(b), torch.full_like(a * 1.0, math.inf), a * b)


def bias_multiplier(dither_bits: int, quantized_channels: int) -> float:
    """``kappa = beta sqrt(12 D_q)``: the dither's bias ``bias_t`` is at most ``kappa sigma_t`` for a head with
    ``D_q`` quantized channels (THEORY.md section 2)."""
    if quantized_channels < 0:
        raise ValueError(f"quantized_channels must be >= 0, got {quantized_channels}")
    return fp_slack(dither_bits) * math.sqrt(12.0 * quantized_channels)


def radius_multiplier(num_tokens: int, delta: float, dither_bits: int, quantized_channels: int) -> float:
    """``c + kappa``: every logit's radius is ``(c + kappa) sigma_t`` (THEORY.md section 2)."""
    return tail_multiplier(num_tokens, delta) + bias_multiplier(dither_bits, quantized_channels)


def logit_sigma(q: torch.Tensor, k: QuantizedKV, *, sm_scale: float, kv_head_of_query: torch.Tensor) -> torch.Tensor:
    """``sigma_t`` for every query head and token ``[H_q, S]``: the sub-Gaussian proxy of the logit's error
    (THEORY.md section 2), exact channels left out."""
    dtype = q.dtype
    num_q_heads, head_dim = q.shape
    groups = head_dim // k.group_size
    q_masked = q
    if k.outlier_channels.numel():
        # Outlier channels are exact: they contribute nothing to the radius.
        mask = torch.ones(k.num_kv_heads, head_dim, dtype=dtype, device=q.device)
        mask.scatter_(-1, k.outlier_channels, 0.0)
        q_masked = q * mask[kv_head_of_query]
    q_sq = q_masked.view(num_q_heads, groups, k.group_size).square().sum(-1)  # [H_q, G]
    scales = k.scales.to(dtype)[:, kv_head_of_query, :].permute(1, 0, 2)  # [H_q, S, G]
    # An overflowed |q_g|^2 beside a zero scale (an all-zero group) is 0 * inf: +inf by section 3's rule for
    # products with an overflowed factor, as the kernels have it, never NaN.
    return sm_scale * torch.sqrt(mul_nonneg(scales.square(), q_sq[:, None, :]).sum(-1) / 12.0)


def logit_radius(
    q: torch.Tensor, k: QuantizedKV, *, sm_scale: float, delta: float, kv_head_of_query: torch.Tensor
) -> torch.Tensor:
    """``u_t = (c + kappa) sigma_t`` for every query head and token ``[H_q, S]`` (THEORY.md section 2)."""
    quantized_channels = k.head_dim - k.outlier_channels.shape[-1]
    multiplier = radius_multiplier(k.num_tokens, delta, k.dither_bits, quantized_channels)
    return multiplier * logit_sigma(q, k, sm_scale=sm_scale, kv_head_of_query=kv_head_of_query)


@dataclass
class CertificateTerms:
    """The bound family evaluated from the accumulators, each ``[H_q]``."""

    t1: torch.Tensor
    t4: torch.Tensor
    p: torch.Tensor
    pa: torch.Tensor

    @property
    def certificate(self) -> torch.Tensor:
        tightest = torch.minimum(torch.minimum(self.t1, self.t4), torch.minimum(self.p, self.pa))
        return tightest * CERTIFICATE_EVAL_SLACK


def certificate_from_accumulators(
    a1_rest: torch.Tensor,
    b_rest: torch.Tensor,
    u_rest: torch.Tensor,
    p_rest: torch.Tensor,
    p_max: torch.Tensor,
    u_max: torch.Tensor,
) -> CertificateTerms:
    """Evaluate T1, T4, P and PA (THEORY.md section 3) from the accumulators.

    ``a1_rest = sum_{t != m} p~_t expm1(u_t)``, ``b_rest = sum_{t != m} p~_t g(u_t)``,
    ``u_rest = sum_{t != m} p~_t u_t``, ``p_rest = sum_{t != m} p~_t`` and ``(p_max, u_max) = (p~_m, u_m)``
    at the held-apart token ``m``. Each is a sum of non-negative terms and the formulas only add and
    multiply them: nothing cancels. (``1 - p_max`` and ``a1_rest - b_rest`` would: near a sink token,
    ``1 - p_max`` in float32 can be off by far more than the evaluation slack.)
    """
    e_m = torch.exp(u_max)
    expm1_m = torch.expm1(u_max)
    g_m = expm1_minus_x(u_max)
    a1 = a1_rest + mul_nonneg(p_max, expm1_m)
    b = b_rest + mul_nonneg(p_max, g_m)
    t4 = mul_nonneg(e_m, a1_rest) + mul_nonneg(expm1_m, p_rest)
    pa_inner = mul_nonneg(e_m, b_rest) + mul_nonneg(expm1_m, u_rest) + mul_nonneg(g_m, p_rest)
    return CertificateTerms(t1=a1, t4=t4, p=torch.sqrt(b / 2.0), pa=torch.sqrt(pa_inner / 2.0))


# Where the certificate's sums are taken together (THEORY.md section 3), as the decode kernels' threads hold
# tokens: a cell is the tokens t, t + 8, t + 16, t + 24 of a block of 32 (from the sequence's start), and the token
# held apart is found among the first and last tiles of 128 tokens alone.
CELL_BLOCK = 32
CELL_STRIDE = 8
END_TILE = 128


def h_of(x: torch.Tensor) -> torch.Tensor:
    """``h(x) = g(x) / x^2`` for ``x >= 0``: increasing, ``1/2`` at 0, ``+inf`` once ``g`` overflows. A series
    below 0.05 (truncation below 1e-13 relative), so that ``x^2`` never underflows into the division."""
    small = x < 0.05
    series = torch.zeros_like(x)
    for n in range(9, 1, -1):
        series = series * x + 1.0 / math.factorial(n)
    safe = torch.where(small, 1.0, x)
    g = expm1_minus_x(safe)
    # g overflows (x above 88 in float32) long before x^2 does: inf / x^2, or inf / inf, reads as +inf.
    return torch.where(small, series, torch.where(torch.isinf(g), g, g / (safe * safe)))


def end_tokens(num_tokens: int, device=None) -> torch.Tensor:
    """``[S]`` bool: the tokens of the sequence's first and last tiles of ``END_TILE`` (one tile when ``S <=
    END_TILE``), among which the certificate finds the token it holds apart."""
    position = torch.arange(num_tokens, device=device)
    return (position < END_TILE) | (position >= (num_tokens - 1) // END_TILE * END_TILE)


def _by_cell(x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``x`` ``[..., S]`` as ``[..., S / 32, 8, 4]`` (padded with ``fill``): each block's cells, a cell's four tokens
    on the last axis."""
    padded = torch.nn.functional.pad(x, (0, -x.shape[-1] % CELL_BLOCK), value=fill)
    return padded.unflatten(-1, (-1, CELL_BLOCK // CELL_STRIDE, CELL_STRIDE)).transpose(-1, -2)


def _block_first_argmax(candidates: torch.Tensor) -> torch.Tensor:
    """``[..., S]`` bool: in each block of 32 tokens, the first token with the largest ``candidates`` value, where
    that value is ``>= 0`` (a block whose values are all negative has none)."""
    num_tokens = candidates.shape[-1]
    blocks = torch.nn.functional.pad(candidates, (0, -num_tokens % CELL_BLOCK), value=-1.0).unflatten(
        -1, (-1, CELL_BLOCK)
    )
    first = blocks.argmax(-1, keepdim=True)
    picked = torch.zeros_like(blocks, dtype=torch.bool).scatter(-1, first, blocks.gather(-1, first) >= 0)
    return picked.flatten(-2)[..., :num_tokens]


@dataclass
class CertificateAccumulators:
    """Upper bounds on the softmax-weighted sums over tokens, with one token ``m`` held apart (THEORY.md section 3).
    ``p_max = u_max = 0`` when no token is held apart."""

    a1_rest: torch.Tensor  # >= sum_{t != m} p~_t expm1(u_t)
    b_rest: torch.Tensor  # >= sum_{t != m} p~_t g(u_t)
    u_rest: torch.Tensor  # >= sum_{t != m} p~_t u_t
    p_rest: torch.Tensor  # sum_{t != m} p~_t
    p_max: torch.Tensor  # p~_m
    u_max: torch.Tensor  # u_m

    @property
    def terms(self) -> CertificateTerms:
        return certificate_from_accumulators(
            self.a1_rest, self.b_rest, self.u_rest, self.p_rest, self.p_max, self.u_max
        )

    @property
    def certificate(self) -> torch.Tensor:
        return self.terms.certificate


def accumulate_certificate(
    probs: torch.Tensor, radius: torch.Tensor, exact: torch.Tensor | None = None
) -> CertificateAccumulators:
    """The accumulators from the softmax ``probs`` and radii ``radius``, both ``[..., S]`` in sequence order
    (THEORY.md section 3).

    In each block of 32 tokens of the first and last tiles of 128 (``end_tokens``), the first argmax of ``probs``
    is a *singleton*: its terms are exact. The first argmax among the singletons is held apart as ``m``. Every other
    token sits in its *cell* (``_by_cell``), whose sums are bounded from its weight ``W``, ``S = sum p~ u^2`` and its
    largest radius ``u_c``: ``U <= sqrt(W S)``, ``B <= h(u_c) S``, and ``A1 <= U + B``.

    ``exact`` ``[..., S]`` (bool): tokens read exactly (radius 0) beside the quantized ones, as gating repairs
    them: they add their weight to ``P_rest`` alone, and are never a singleton or held apart.
    """
    num_tokens = probs.shape[-1]
    zero = torch.zeros((), dtype=probs.dtype, device=probs.device)
    quantized = torch.ones_like(probs, dtype=torch.bool) if exact is None else ~exact.expand_as(probs)
    candidates = probs.masked_fill(~(quantized & end_tokens(num_tokens, probs.device)), -1.0)
    singleton = _block_first_argmax(candidates)
    held_candidates = probs.masked_fill(~singleton, -1.0)
    argmax = held_candidates.argmax(-1, keepdim=True)
    has_held = held_candidates.gather(-1, argmax) >= 0
    held = torch.zeros_like(singleton).scatter(-1, argmax, has_held)
    p_max = torch.where(has_held, probs.gather(-1, argmax), zero).squeeze(-1)
    u_max = torch.where(has_held, radius.gather(-1, argmax), zero).squeeze(-1)

    alone = singleton & ~held
    u_alone = torch.where(alone, mul_nonneg(probs, radius), zero).sum(-1)
    b_alone = torch.where(alone, mul_nonneg(probs, expm1_minus_x(radius)), zero).sum(-1)
    in_cells = quantized & ~singleton
    weight = _by_cell(torch.where(in_cells, probs, zero)).sum(-1)
    moment = _by_cell(torch.where(in_cells, mul_nonneg(probs, radius.square()), zero)).sum(-1)
    largest = _by_cell(radius).amax(-1)
    u_rest = u_alone + torch.sqrt(mul_nonneg(weight, moment)).sum((-2, -1))
    b_rest = b_alone + mul_nonneg(h_of(largest), moment).sum((-2, -1))
    p_rest = torch.where(held, zero, probs).sum(-1)
    return CertificateAccumulators(u_rest + b_rest, b_rest, u_rest, p_rest, p_max, u_max)


@dataclass
class DecodeResult:
    """Output of one decode step for one sequence."""

    out: torch.Tensor  # [H_q, D]
    lse: torch.Tensor  # [H_q], natural log of sum_t exp(z~_t)
    radius: torch.Tensor  # [H_q, S], u_t
    probs: torch.Tensor  # [H_q, S], p~_t
    accumulators: CertificateAccumulators

    @property
    def terms(self) -> CertificateTerms:
        return self.accumulators.terms

    @property
    def certificate(self) -> torch.Tensor:
        return self.accumulators.certificate


def _kv_head_of_query(num_q_heads: int, num_kv_heads: int, device) -> torch.Tensor:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    return torch.arange(num_q_heads, device=device) // (num_q_heads // num_kv_heads)


def softmax_scale(sm_scale: float | None, head_dim: int) -> float:
    """The logits' scale: ``sm_scale``, or ``1 / sqrt(head_dim)`` when it is None."""
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


def decode_attention(
    q: torch.Tensor,
    k: QuantizedKV,
    v: QuantizedKV,
    *,
    sm_scale: float | None = None,
    delta_step: float,
    skip: torch.Tensor | None = None,
    k_hat: torch.Tensor | None = None,
    v_hat: torch.Tensor | None = None,
) -> DecodeResult:
    """One decode step of one sequence over a quantized cache, with the certificate.

    ``k_hat``, ``v_hat``: ``[S, H_kv, D]``, when the caller has dequantized ``k`` and ``v`` already (in the
    computation dtype); they must equal ``k.dequantize(dtype)`` and ``v.dequantize(dtype)``.

    ``q`` ``[H_q, D]`` (GQA when ``H_q > H_kv``; query head ``i`` reads KV head ``i // (H_q / H_kv)``).
    Computes in float64 for float64 queries, otherwise float32. ``skip`` ``[S, H_kv]`` (bool) leaves
    those (token, KV head) pairs out of the attention, as if absent; the radius still counts all ``S``
    tokens in its union bound (conservative, and what the kernel does). A head that skips every token
    gets ``out = 0``, ``lse = -inf`` and certificate 0, like an empty sequence.
    """
    if q.dim() != 2:
        raise ValueError(f"q must be [H_q, D], got shape {tuple(q.shape)}")
    if k.codes.shape != v.codes.shape:
        raise ValueError("k and v must cover the same tokens, heads and head_dim")
    if k.kind != "k" or v.kind != "v":
        raise ValueError("k must be the 'k' side and v the 'v' side")
    if q.shape[1] != k.head_dim:
        raise ValueError(f"q head_dim {q.shape[1]} does not match the cache's {k.head_dim}")
    if k.num_tokens == 0:
        raise ValueError("decode_attention needs at least one token")
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q = q.to(dtype)
    num_q_heads, head_dim = q.shape
    sm_scale = softmax_scale(sm_scale, head_dim)
    kv_head = _kv_head_of_query(num_q_heads, k.num_kv_heads, q.device)

    k_hat = (k.dequantize(dtype) if k_hat is None else k_hat.to(dtype))[:, kv_head, :]  # [S, H_q, D]
    v_hat = (v.dequantize(dtype) if v_hat is None else v_hat.to(dtype))[:, kv_head, :]
    logits = sm_scale * torch.einsum("hd,shd->hs", q, k_hat)
    if skip is not None:
        if skip.shape != (k.num_tokens, k.num_kv_heads) or skip.dtype != torch.bool:
            raise ValueError(f"skip must be a bool [{k.num_tokens}, {k.num_kv_heads}] tensor")
        logits = logits.masked_fill(skip.to(q.device)[:, kv_head].T, -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    live = lse > -math.inf
    probs = torch.where(live[:, None], torch.exp(logits - torch.where(live, lse, 0.0)[:, None]), 0.0)
    out = torch.einsum("hs,shd->hd", probs, v_hat)

    radius = logit_radius(q, k, sm_scale=sm_scale, delta=delta_step, kv_head_of_query=kv_head)
    if skip is not None:
        # A skipped token is not read: like one past the end, it has radius 0 in its cell.
        radius = radius.masked_fill(skip.to(q.device)[:, kv_head].T, 0.0)
    acc = accumulate_certificate(probs, radius)
    return DecodeResult(out=out, lse=lse, radius=radius, probs=probs, accumulators=acc)


def output_error_bound(result: DecodeResult, v: QuantizedKV, *, delta: float) -> torch.Tensor:
    """A per-channel bound ``[H_q, D]`` on ``|o - o~|``, the output's distance from exact attention.

    THEORY.md section 5: ``o - o~ = sum_t (p_t - p~_t) v_t - sum_t p~_t eta_t`` with ``eta = v~ - v``.
    The first sum is at most ``TV * range_t(v_c)``, with TV bounded by the certificate and ``v_c``
    within ``r = s (1/2 + 2^-16)`` of ``v~_c``. The second is at most ``sum_t p~_t r_t`` always and, for
    a dithered V (independent of ``p~``, which depends on K's stream only), at most
    ``c_V sqrt(sum_t p~_t^2 s_t^2 / 12) + beta_V sum_t p~_t s_t`` with ``c_V = sqrt(2 ln(2 D / delta))`` and
    ``beta_V = fp_slack(min(b, 16))``
    for all ``D`` channels of a head at once with probability ``>= 1 - delta``. The bound then holds
    whenever the certificate does and that event holds.
    """
    dtype = result.probs.dtype
    kv_head = _kv_head_of_query(result.probs.shape[0], v.num_kv_heads, result.probs.device)
    v_hat = v.dequantize(dtype)[:, kv_head, :]  # [S, H_q, D]
    scales = v.channel_scales(dtype)[:, kv_head, :]
    half_step = scales * (0.5 + 2.0**-16)
    spread = (v_hat + half_step).amax(0) - (v_hat - half_step).amin(0)  # [H_q, D]
    attention_shift = mul_nonneg(result.certificate[:, None], spread)
    dither_error = torch.einsum("hs,shd->hd", result.probs, half_step)
    if v.dithered:
        c_v = math.sqrt(2.0 * math.log(2.0 * v.head_dim / delta))
        sigma = torch.sqrt(torch.einsum("hs,shd->hd", result.probs.square(), scales.square()) / 12.0)
        # Across slots one channel's dither varies by its per-slot part only: min(b, 16) bits (section 1).
        bias = torch.einsum("hs,shd->hd", result.probs, scales) * fp_slack(slot_dither_bits(v.dither_bits))
        dither_error = torch.minimum(dither_error, c_v * sigma + bias)
    return (attention_shift + dither_error) * CERTIFICATE_EVAL_SLACK


def total_variation(p: torch.Tensor, p_tilde: torch.Tensor) -> torch.Tensor:
    """``TV(p, p~) = 1/2 sum |p - p~|`` over the last dimension."""
    return 0.5 * (p - p_tilde).abs().sum(-1)


def worst_case_tv(probs: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """Exact ``max TV(p(d), p~)`` over the box ``|d_t| <= u_t``, by enumerating its corners.

    For any token set A, the softmax mass of A is monotone in every ``d_t``, so the maximum of
    ``p(A) - p~(A)`` sits at the corner ``d = -u`` on A and ``+u`` off A; TV is the maximum over A.
    Exponential in S: for small test cases only. ``probs``, ``radius``: ``[..., S]``.
    """
    num_tokens = probs.shape[-1]
    if num_tokens > 16:
        raise ValueError("corner enumeration is for S <= 16")
    corners = torch.arange(2**num_tokens, device=probs.device)
    in_set = ((corners[:, None] >> torch.arange(num_tokens, device=probs.device)) & 1).bool()  # [2^S, S]
    sign = torch.where(in_set, 1.0, -1.0).to(probs.dtype)
    # p_t proportional to p~_t exp(-d_t); on the corner of A, -d_t = +u_t on A and -u_t off A.
    weights = probs[..., None, :] * torch.exp(sign * radius[..., None, :])
    p = weights / weights.sum(-1, keepdim=True)
    gain = torch.where(in_set, p - probs[..., None, :], torch.zeros((), dtype=probs.dtype)).sum(-1)
    return gain.amax(-1)
