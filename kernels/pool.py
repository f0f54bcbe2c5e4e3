"""The quantized KV pool: int8 codes, fp16 group scales and exact outlier values, per layer and side.

Layout (one tensor each, indexed ``[layer, side, slot, kv_head, ...]``, side 0 = K, 1 = V): a token's
codes for one head are ``head_dim`` contiguous bytes, so a decode tile of tokens reads whole 128-byte
rows. A code is stored as the byte ``code + 128`` (``uint8``, the int8 code with its sign bit flipped:
``encode_codes``), which is what the read kernels' fp16 construction needs, so they skip a ``xor`` per four
codes. The dither is never stored: it is regenerated from ``(seed, layer, slot, kv_head, side)`` as a
per-channel part, plus a per-slot part on V (docs/THEORY.md, section 1).
"""

from __future__ import annotations

import os
import secrets

import torch

from witcert.kernels import reference
from witcert.kernels.backend import kernels_module, select_path
from witcert.kernels.outliers import OutlierFile

SIDES: tuple[reference.Kind, reference.Kind] = ("k", "v")
_WRITE_BLOCK_TOKENS = 32
# The write kernel's (token, head) rows per program; every head of a token goes to the same program. 128 rows
# write faster than 32 on the H200 (2% at 1M tokens, timed in interleaved A/B runs).
_WRITE_ROWS = 128


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# The nearest-V decode forms scale * code in fp16 (docs/KERNELS.md): scales up to 515.5, times 127.
NEAREST_V_MAX = 65_000.0


def encode_codes(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes -> the stored bytes ``code + 128`` (uint8): the sign bit flipped."""
    return codes.view(torch.uint8) ^ 0x80


def decode_codes(stored: torch.Tensor) -> torch.Tensor:
    """The stored bytes ``code + 128`` (uint8) -> int8 codes. Raw zeros (a slot never written) read as -128."""
    return (stored ^ 0x80).view(torch.int8)


class KVPool:
    """A paged, dither-quantized KV cache for ``num_layers`` layers and ``num_slots`` token slots.

    ``outlier_channels``: ``None``, ``[2m]`` (every layer and head), ``[H_kv, 2m]`` (every layer),
    ``[L, H_kv, 2m]``, or an ``OutlierFile`` (or the path of one, ``witcert calibrate``) made for this pool's
    shape; those channels are stored exactly in ``dtype``. ``v_dither=False`` rounds V to
    nearest: the TV certificate needs dither on K only, and the read path then regenerates half as
    much. ``seed`` keys the dither streams; ``None`` (the default) draws a fresh 64-bit seed from the operating
    system's generator, so no two pools share their rounding offsets (``self.seed`` records it; pass a fixed seed
    for reproducible tests). ``page_size`` is the allocation granule of the engine using the pool (slots of one page are
    contiguous); the kernels address tokens by slot, so any page size works.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        group_size: int = 32,
        outlier_channels: torch.Tensor | OutlierFile | str | os.PathLike | None = None,
        seed: int | None = None,
        dither_bits: int = 8,
        v_dither: bool = False,
        page_size: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float16,
    ) -> None:
        if min(num_slots, num_layers, kv_heads, head_dim, page_size) <= 0:
            raise ValueError("num_slots, num_layers, kv_heads, head_dim and page_size must be positive")
        if num_slots % page_size:
            raise ValueError(f"num_slots {num_slots} must be a multiple of page_size {page_size}")
        if group_size <= 0 or head_dim % group_size:
            raise ValueError(f"group_size {group_size} must divide head_dim {head_dim}")
        if dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be torch.float16 or torch.bfloat16 (the model's KV dtype), got {dtype}")
        per_call = reference.channels_per_philox_call(dither_bits)  # validates dither_bits
        if group_size % per_call:
            raise ValueError(f"group_size {group_size} must be a multiple of {per_call} for {dither_bits}-bit dither")
        if seed is None:
            # Drawn per pool: the certificate's probability is over this draw (docs/THEORY.md, section 2).
            seed = secrets.randbits(64)
        reference.seed_key(seed)  # validates the seed
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and device.index is None:
            # Tensors report "cuda:N": compare against the same spelling.
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.num_slots, self.num_layers, self.kv_heads, self.head_dim = num_slots, num_layers, kv_heads, head_dim
        self.group_size, self.seed, self.dither_bits = group_size, seed, dither_bits
        self.v_dither, self.page_size, self.dtype = v_dither, page_size, dtype
        self.num_groups = head_dim // group_size

        # The calibration file the outlier channels came from, if they came from one.
        self.outlier_file: OutlierFile | None = None
        channels = self._layer_outlier_channels(outlier_channels)
        self.outlier_channels = channels  # int64 [L, H_kv, 2m]
        self.num_outliers = channels.shape[-1]
        # Per channel: its index among the head's outliers, or -1 (what the kernels test).
        index = torch.full((num_layers, kv_heads, head_dim), -1, dtype=torch.int32, device=self.device)
        if self.num_outliers:
            order = torch.arange(self.num_outliers, dtype=torch.int32, device=self.device)
            index.scatter_(-1, channels, order.expand_as(channels).contiguous())
        self.outlier_index = index
        self.outlier_channels_i32 = channels.to(torch.int32).contiguous()

        # The dither's per-channel part alpha of every layer, side and head (float32 [L, 2, H_kv, D]): the decode
        # kernels read it (a few KB) instead of regenerating it per program; the write and gather kernels
        # regenerate it, and the tests hold both to the reference.
        self.channel_dither = torch.stack(
            [
                torch.stack(
                    [
                        reference.channel_dither_values(
                            reference.channel_dither_fields(
                                seed=seed, layer=layer, num_kv_heads=kv_heads, head_dim=head_dim, kind=kind,
                                dither_bits=dither_bits, device=self.device,
                            ),
                            dither_bits,
                            torch.float32,
                        )
                        for kind in SIDES
                    ]
                )
                for layer in range(num_layers)
            ]
        ).contiguous()  # fmt: skip
        shape = (num_layers, 2, num_slots, kv_heads)
        self.codes = torch.zeros(*shape, head_dim, dtype=torch.uint8, device=self.device)  # encode_codes
        self.scales = torch.zeros(*shape, self.num_groups, dtype=torch.float16, device=self.device)
        self.outlier_values = torch.zeros(*shape, self.num_outliers, dtype=dtype, device=self.device)

    def _layer_outlier_channels(
        self, outlier_channels: torch.Tensor | OutlierFile | str | os.PathLike | None
    ) -> torch.Tensor:
        if outlier_channels is None:
            return torch.empty(self.num_layers, self.kv_heads, 0, dtype=torch.int64, device=self.device)
        if isinstance(outlier_channels, str | os.PathLike):
            outlier_channels = OutlierFile.load(outlier_channels)
        if isinstance(outlier_channels, OutlierFile):
            outlier_channels.check(num_layers=self.num_layers, num_kv_heads=self.kv_heads, head_dim=self.head_dim)
            self.outlier_file = outlier_channels
            outlier_channels = outlier_channels.channels()
        channels = torch.as_tensor(outlier_channels, device=self.device)
        if channels.dim() == 3:
            if channels.shape[0] != self.num_layers:
                raise ValueError(f"outlier_channels [L, H_kv, 2m] must have L = {self.num_layers}")
            per_layer = [
                reference.check_outlier_channels(c, self.kv_heads, self.head_dim, self.device) for c in channels
            ]
            return torch.stack(per_layer).contiguous()
        checked = reference.check_outlier_channels(channels, self.kv_heads, self.head_dim, self.device)
        return checked.expand(self.num_layers, -1, -1).contiguous()

    @property
    def bytes_per_token(self) -> int:
        """Stored bytes per token over all layers, both sides and all heads: ``D + 2 D/G + 2m * elem``."""
        per_head = (
            self.head_dim
            + self.num_groups * self.scales.element_size()
            + self.num_outliers * self.outlier_values.element_size()
        )
        return self.num_layers * 2 * self.kv_heads * per_head

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size

    def dithered(self, kind: reference.Kind) -> bool:
        return kind == "k" or self.v_dither

    def check_layer(self, layer: int) -> None:
        if not 0 <= int(layer) < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")

    def _check_slots(self, slots: torch.Tensor, count: int | None = None, *, values: bool = True) -> torch.Tensor:
        """``slots`` on the pool's device, its dtype and shape checked, and with ``values`` its range (a sync)."""
        slots = torch.as_tensor(slots, device=self.device)
        if slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
            raise TypeError(f"slots must be a 1-D int32/int64 tensor, got {slots.dtype} of shape {tuple(slots.shape)}")
        if count is not None and slots.shape[0] != count:
            raise ValueError(f"slots has {slots.shape[0]} entries for {count} tokens")
        if values and slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_slots):
            raise ValueError(f"slots must lie in [0, {self.num_slots})")
        return slots

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        validate: bool | None = None,
    ) -> None:
        """Quantize ``k`` and ``v`` ``[N, H_kv, D]`` into ``slots`` ``[N]`` of ``layer``.

        Bit-identical to ``reference.quantize``. ``slots`` must be distinct. The checks that read tensor
        values (slot range, finiteness, magnitude) synchronise with the device, so ``validate=None``
        makes them on CPU only; unvalidated, the kernel skips out-of-range slots (never writes outside
        the pool), and non-finite input leaves meaningless codes in its own slots only.
        """
        self.check_layer(layer)
        for name, x in (("k", k), ("v", v)):
            if x.dim() != 3 or tuple(x.shape[1:]) != (self.kv_heads, self.head_dim):
                raise ValueError(f"{name} must be [N, {self.kv_heads}, {self.head_dim}], got shape {tuple(x.shape)}")
            if x.dtype != self.dtype:
                raise TypeError(f"{name} must be {self.dtype} (the pool's dtype), got {x.dtype}")
            if x.device != self.device:
                raise ValueError(f"{name} is on {x.device}, the pool on {self.device}")
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        if validate if validate is not None else self.device.type != "cuda":
            slots = self._check_slots(slots, k.shape[0])
            for name, x in (("k", k), ("v", v)):
                if not bool(torch.isfinite(x).all()):
                    raise ValueError(f"{name} contains NaN or inf: a quantized cache cannot represent it")
                largest = float(x.abs().max())
                reach = reference.largest_amax(name)
                if largest > reach:
                    raise ValueError(
                        f"|{name}| exceeds what a group scale of {name.upper()} can cover (max {reach:.6g})"
                    )
                if name == "v" and not self.v_dither and largest > NEAREST_V_MAX:
                    raise ValueError(
                        f"|v| reaches {largest:.4g}: a V rounded to nearest is decoded through fp16 products "
                        f"scale * code, which hold |v| up to {NEAREST_V_MAX:g}; use v_dither=True for larger values"
                    )
        else:
            slots = torch.as_tensor(slots, device=self.device)
        if k.shape[0] == 0:
            return
        if select_path(self.device) == "reference":
            self._write_reference(layer, slots, k, v)
            return
        kernels = kernels_module()
        constants = self._pool_constants()
        for side, x in enumerate((k, v)):
            x = x.contiguous()
            kernels.write_kernel[(triton_cdiv(x.shape[0], constants["BLOCK_T"]),)](
                x,
                slots,
                self.codes[layer, side],
                self.scales[layer, side],
                self.outlier_values[layer, side],
                self.outlier_index[layer],
                self.outlier_channels_i32[layer],
                x.shape[0],
                self.num_slots,
                x.stride(0),
                x.stride(1),
                self.seed,
                layer,
                OUTLIERS_PAD=max(2, _pow2(self.num_outliers)),
                KIND_BIT=side,
                DITHER=self.dithered(SIDES[side]),
                INTERPRETED=self.device.type != "cuda",
                **constants,
            )

    def _pool_constants(self) -> dict:
        """The compile-time parameters the write and gather kernels share (per side, the write adds which side
        and whether it is dithered). A program takes ``BLOCK_T`` tokens of all (padded) KV heads."""
        heads_pad = _pow2(self.kv_heads)
        block_tokens = max(1, _WRITE_ROWS // heads_pad)
        return dict(
            NUM_KV_HEADS=self.kv_heads,
            HEADS_PAD=heads_pad,
            HEAD_DIM=self.head_dim,
            GROUP_SIZE=self.group_size,
            DITHER_BITS=self.dither_bits,
            HAS_OUTLIERS=self.num_outliers > 0,
            NUM_OUTLIERS=max(1, self.num_outliers),
            BLOCK_T=block_tokens,
        )

    def dither(self, layer: int, slots: torch.Tensor, kind: reference.Kind, kv_head: int) -> torch.Tensor:
        """The dither ``xi`` ``[N, D]`` (float32) the write and gather kernels regenerate for one head: what
        ``reference.dither_values`` must equal, bit for bit (``selftest`` and the tests compare them)."""
        self.check_layer(layer)
        slots = self._check_slots(slots)
        if not 0 <= kv_head < self.kv_heads or kind not in SIDES:
            raise ValueError(f"kv_head must be in [0, {self.kv_heads}) and kind 'k' or 'v'")
        if select_path(self.device) == "reference":
            return reference.dither_values(
                seed=self.seed,
                layer=layer,
                slots=slots,
                num_kv_heads=self.kv_heads,
                head_dim=self.head_dim,
                kind=kind,
                dither_bits=self.dither_bits,
            )[:, kv_head]
        xi = torch.empty(slots.shape[0], self.head_dim, dtype=torch.float32, device=self.device)
        if slots.numel():
            kernels_module()._dither_values_kernel[(triton_cdiv(slots.shape[0], _WRITE_BLOCK_TOKENS),)](
                slots,
                xi,
                slots.shape[0],
                self.seed,
                layer,
                kv_head | (SIDES.index(kind) << 31),
                HEAD_DIM=self.head_dim,
                DITHER_BITS=self.dither_bits,
                SLOT_PART=reference.has_slot_part(kind),
                BLOCK_T=_WRITE_BLOCK_TOKENS,
            )
        return xi

    def _channel_table(self, layer: int, side: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The dither ``[H_kv, D]`` of a side whose dither is its per-channel part alone (K), from the pool's table;
        ``None`` where it is not (V dithered) or the float32 table could differ from ``reference.dither_values``
        (24-bit fields)."""
        kind = SIDES[side]
        if not self.dithered(kind) or reference.has_slot_part(kind) or self.dither_bits > 16:
            return None
        return self.channel_dither[layer, side].to(dtype)

    def _write_reference(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = slots.to(torch.int64)
        for side, (kind, x) in enumerate(zip(SIDES, (k, v), strict=True)):
            quantized = reference.quantize(
                x,
                seed=self.seed,
                layer=layer,
                slots=slots,
                kind=kind,
                group_size=self.group_size,
                outlier_channels=self.outlier_channels[layer],
                dither_bits=self.dither_bits,
                dither=self.dithered(kind),
                xi=self._channel_table(layer, side, torch.float32),  # instead of regenerating it (a Philox call)
            )
            self.codes[layer, side, slots] = encode_codes(quantized.codes)
            self.scales[layer, side, slots] = quantized.scales
            self.outlier_values[layer, side, slots] = quantized.outlier_values.to(self.dtype)

    def quantized(self, layer: int, slots: torch.Tensor, kind: reference.Kind) -> reference.QuantizedKV:
        """The stored tokens of ``slots`` as a ``reference.QuantizedKV``: the oracle's view of the pool."""
        self.check_layer(layer)
        if kind not in SIDES:
            raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
        slots = self._check_slots(slots).to(torch.int64)
        side = SIDES.index(kind)
        return reference.QuantizedKV(
            codes=decode_codes(self.codes[layer, side, slots]),
            scales=self.scales[layer, side, slots],
            outlier_values=self.outlier_values[layer, side, slots],
            outlier_channels=self.outlier_channels[layer],
            slots=slots,
            seed=self.seed,
            layer=int(layer),
            kind=kind,
            group_size=self.group_size,
            dither_bits=self.dither_bits,
            dithered=self.dithered(kind),
        )

    def dequantize(
        self, layer: int, slots: torch.Tensor, kind: reference.Kind, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``x_hat`` ``[N, H_kv, D]`` of the stored tokens: ``QuantizedKV.dequantize``'s arithmetic, with K's dither
        read from the pool's channel table rather than regenerated (the CPU decode path, repair, tests)."""
        stored = self.quantized(layer, slots, kind)
        table = self._channel_table(layer, SIDES.index(kind), dtype)
        if table is None:
            return stored.dequantize(dtype)
        scales = stored.scales.to(dtype).repeat_interleave(self.group_size, dim=-1)
        x_hat = scales * (stored.codes.to(dtype) - table)
        if self.num_outliers:
            index = stored.outlier_channels.expand(stored.num_tokens, -1, -1)
            x_hat = x_hat.scatter(-1, index, stored.outlier_values.to(dtype))
        return x_hat

    def gather(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype | None = None, *, validate: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_hat, v_hat)``, each ``[N, H_kv, D]`` in ``dtype`` (default: the pool's), of the stored tokens of
        ``slots``: the Triton gather kernel (``triton_gather``), bit-identical to ``dequantize(layer, slots,
        kind).to(dtype)``. ``validate`` (default: on except on CUDA, where it costs a sync) checks the slots;
        unchecked, a slot out of range gives a NaN row."""
        self.check_layer(layer)
        dtype = self.dtype if dtype is None else dtype
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
        slots = self._check_slots(slots, values=validate if validate is not None else self.device.type != "cuda")
        if select_path(self.device) == "reference":
            return tuple(self.dequantize(layer, slots, kind).to(dtype) for kind in SIDES)  # type: ignore[return-value]
        from witcert.kernels import triton_gather

        constants = self._pool_constants()
        out = torch.empty(len(SIDES), slots.shape[0], self.kv_heads, self.head_dim, dtype=dtype, device=self.device)
        if slots.numel():
            triton_gather.gather_dequantize[(triton_cdiv(slots.shape[0], constants["BLOCK_T"]), len(SIDES))](
                slots,
                self.codes[layer],
                self.scales[layer],
                self.outlier_values[layer],
                self.outlier_index[layer],
                out,
                self.codes.stride(1),
                self.scales.stride(1),
                self.outlier_values.stride(1),
                out.stride(0),
                slots.shape[0],
                self.num_slots,
                self.seed,
                layer,
                DITHER_K=self.dithered("k"),
                DITHER_V=self.dithered("v"),
                **constants,
            )
        return out[0], out[1]


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
