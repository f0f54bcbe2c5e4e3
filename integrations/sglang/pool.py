"""The witcert KV pool as an SGLang ``MHATokenToKVPool``: int8 codes, fp16 scales, exact outliers, exact backup.

SGLang's configurator builds the pool class the plugin hands it (``plugin.py`` hooks
``KVCacheConfigurator._resolve_kv_pool_class``) with the same arguments as its own MHA pool. This
subclass keeps SGLang's addressing (slots, layers, ``start_layer``) and replaces the storage with a
``witcert.kernels.KVPool``; ``k_buffer`` / ``v_buffer`` are views of its stored codes, so SGLang code
that only asks for shapes or pointers still works. Everything that would read codes as values, or
move a token to another slot, is refused.
"""

from __future__ import annotations

import logging

import psutil
import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool, unwrap_write_loc

from witcert.integrations.gating import GateMode, RepairedStore
from witcert.integrations.sglang.capacity import cell_size_bytes
from witcert.integrations.sglang.config import WitcertSGLangSettings, load_settings
from witcert.kernels import KVPool

logger = logging.getLogger("witcert.sglang")

# Gate mode's exact backup must leave this fraction of the host's available memory free.
_HOST_HEADROOM = 0.1


class WitcertKVPool(MHATokenToKVPool):
    """``MHATokenToKVPool`` whose storage is a ``witcert.kernels.KVPool`` (plus an exact host backup in gate mode)."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str,
        enable_memory_saver: bool,
        v_head_dim: int | None = None,
        *,
        settings: WitcertSGLangSettings | None = None,
        quant_method: object | None = None,
        post_capture_active: bool = False,
        kv_cache_layout: str | None = None,
        swa_head_num: int | None = None,
        **kwargs,
    ) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"the witcert pool stores the model's fp16/bf16 K/V (--kv-cache-dtype auto), got {dtype}")
        if v_head_dim not in (None, head_dim):
            raise ValueError(f"the witcert pool needs equal K and V head dims, got {head_dim} and {v_head_dim}")
        if quant_method is not None or post_capture_active or kv_cache_layout not in (None, "nhd") or swa_head_num:
            raise ValueError(
                "the witcert pool replaces SGLang's KV quantization, post-capture backing, custom layouts and "
                "SWA sub-pools; none of them can be combined with it"
            )
        self.settings = settings if settings is not None else load_settings()
        self.policy = self.settings.policy()
        super().__init__(
            size, page_size, dtype, head_num, head_dim, layer_num, device, enable_memory_saver, v_head_dim, **kwargs
        )

    # --- storage ---------------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        """Slots held: ``size`` usable ones plus the padding page that absorbs dummy writes."""
        return self.size + self.page_size

    @property
    def bytes_per_token(self) -> int:
        return cell_size_bytes(
            num_layers=self.layer_num,
            num_kv_heads=self.head_num,
            head_dim=self.head_dim,
            group_size=self.policy.group_size,
            outlier_pairs=self.policy.exact_pairs(),
        )

    def _create_buffers(self) -> None:
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            self.witcert = KVPool(
                self.num_rows,
                self.layer_num,
                self.head_num,
                self.head_dim,
                group_size=self.policy.group_size,
                outlier_channels=self.policy.outlier_channels(self.layer_num, self.head_num, self.head_dim),
                seed=self.policy.seed,
                dither_bits=self.policy.dither_bits,
                v_dither=self.policy.v_dither,
                device=self.device,
                dtype=self.dtype,
            )
        self.store_dtype = torch.uint8
        self.k_buffer = [self.witcert.codes[layer, 0] for layer in range(self.layer_num)]
        self.v_buffer = [self.witcert.codes[layer, 1] for layer in range(self.layer_num)]
        for name in ("k_scale_buffer", "v_scale_buffer", "native_k_scale_buffer", "native_v_scale_buffer"):
            setattr(self, name, None)
        self.dq_k_buffer = self.dq_v_buffer = None
        self.exact: tuple[torch.Tensor, torch.Tensor] | None = None
        # Gate mode: (layer, slot, KV head) already paged in from the backup; a repair reuses them, so a
        # request pays for each slot at most once. One byte per head and slot, cleared when the slot is rewritten.
        self.repaired: torch.Tensor | None = None
        # Gate mode: the exact K/V of those pairs, per layer, on the device (read by every later decode step).
        # Their bytes are outside SGLang's capacity account: they grow with what gating repairs and shrink
        # at the next repair after SGLang reuses the slots.
        self.exact_store: list[RepairedStore] = []
        if self.policy.mode is GateMode.GATE:
            self.exact = self._allocate_exact_backup()
            self.repaired = torch.zeros(
                self.layer_num, self.num_rows, self.head_num, dtype=torch.bool, device=self.device
            )
            self.exact_store = [
                RepairedStore(self.head_num, self.head_dim, torch.device(self.device), self.dtype)
                for _ in range(self.layer_num)
            ]
        self._kv_buffer_descs = self._build_kv_buffer_descs()
        self._init_data_ptrs_and_strides()

    def _allocate_exact_backup(self) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.layer_num, self.num_rows, self.head_num, self.head_dim)
        needed = 2 * self.layer_num * self.num_rows * self.head_num * self.head_dim * self.dtype.itemsize
        available = psutil.virtual_memory().available
        if needed > (1.0 - _HOST_HEADROOM) * available:
            raise MemoryError(
                f"gate mode keeps an exact K/V backup in host memory: {needed / 2**30:.1f} GiB for "
                f"{self.num_rows} slots, but only {available / 2**30:.1f} GiB is available; lower "
                "--mem-fraction-static or --max-total-tokens, or use WITCERT_MODE=observe"
            )
        pin = torch.device(self.device).type == "cuda"
        return (
            torch.zeros(shape, dtype=self.dtype, pin_memory=pin),
            torch.zeros(shape, dtype=self.dtype, pin_memory=pin),
        )

    def get_kv_size_bytes(self) -> tuple[int, int]:
        side_bytes = []
        for side in (0, 1):
            side_bytes.append(
                sum(
                    t[:, side].numel() * t.element_size()
                    for t in (self.witcert.codes, self.witcert.scales, self.witcert.outlier_values)
                )
            )
        return side_bytes[0], side_bytes[1]

    def _get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The stored codes of ``layer_id`` (bytes ``code + 128``; not values: they decode only with scales and
        the dither)."""
        return self.k_buffer[layer_id - self.start_layer]

    def _get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id - self.start_layer]

    # --- writes ----------------------------------------------------------------------------------

    def set_kv_buffer(
        self,
        layer: RadixAttention | None,
        loc_info: KVWriteLoc | torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: float | None = None,
        v_scale: float | None = None,
        layer_id_override: int | None = None,
        dcp_kv_mask: torch.Tensor | None = None,
    ) -> None:
        """Quantize the new tokens' K/V into their slots (and copy them to the exact backup in gate mode)."""
        if dcp_kv_mask is not None:
            raise RuntimeError("decode context parallelism is not supported by the witcert pool")
        loc, _, _ = unwrap_write_loc(loc_info)
        self._check_physical_write_loc(loc_info, "set_kv_buffer (witcert)")
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        local = layer_id - self.start_layer
        k = cache_k.reshape(-1, self.head_num, self.head_dim)
        v = cache_v.reshape(-1, self.head_num, self.head_dim)
        if k_scale is not None:
            k = k / k_scale
        if v_scale is not None:
            v = v / v_scale
        k, v = k.to(self.dtype), v.to(self.dtype)
        # Value checks (finite, slot range) synchronise with the GPU: made on CPU only.
        self.witcert.write(local, loc, k, v, validate=torch.device(self.device).type != "cuda")
        if self.exact is not None:
            self.repaired[local, loc] = False
            host_loc = loc.to("cpu", torch.int64)
            self.exact[0][local, host_loc] = k.to("cpu")
            self.exact[1][local, host_loc] = v.to("cpu")

    def exact_rows(
        self, layer_id: int, slots: torch.Tensor, kv_heads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact K and V rows ``[n, D]`` of the pairs ``(slots[i], kv_heads[i])``, on the pool's device (gate
        mode only)."""
        if self.exact is None:
            raise RuntimeError("the exact backup is kept in gate mode only (WITCERT_MODE=gate)")
        local = layer_id - self.start_layer
        host, heads = slots.to("cpu", torch.int64), kv_heads.to("cpu", torch.int64)
        return (
            self.exact[0][local, host, heads].to(self.device),
            self.exact[1][local, host, heads].to(self.device),
        )

    # --- operations the pool refuses ---------------------------------------------------------------

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        # SGLang moves slots for speculative decoding only, which the launch checks refuse. K's codes would
        # survive a move (K's dither is per channel), but a dithered V's code decodes only with its own slot's
        # dither, and gate mode keeps its repaired state per slot.
        raise RuntimeError(
            "the witcert pool does not move tokens between slots (SGLang does for speculative decoding, which "
            "witcert does not support): a dithered V's code decodes only with its own slot's dither, and "
            "re-quantizing a decoded value would add an error no certificate covers"
        )

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None) -> None:
        raise RuntimeError("CPU offload of the witcert pool is not supported (codes without scales are meaningless)")

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None) -> None:
        raise RuntimeError("CPU offload of the witcert pool is not supported (codes without scales are meaningless)")
