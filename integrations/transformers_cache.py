"""A Hugging Face transformers ``Cache`` that keeps K/V in the witcert int8 pool and certifies every decode step.

Use::

    model = AutoModelForCausalLM.from_config(config)        # Llama / Qwen2 / Mistral style
    use_witcert_attention(model)                             # routes attention through witcert_attention
    cache = WitcertCache(model.config, policy, max_cache_len=512, observer=aggregator)
    model.generate(input_ids, past_key_values=cache, max_new_tokens=64)

Prefill attends on the exact K/V it has just written (no certificate: there is no quantized read).
Each decode step (one new token) attends over the pool with the real post-RoPE query through
``gating.CertifiedDecode`` (the fused ``witcert.kernels.decode_attention``, Triton on GPU, its torch reference
on CPU), so the certificate describes exactly the attention the model used. In gate mode the kernel skips the
(slot, KV head) pairs repaired earlier, whose exact part is merged in, and every head still above tau is
repaired from the exact host backup as soon as its layer has run. This module is the paging glue: sequence
``b`` owns the slots ``[b * max_cache_len, (b + 1) * max_cache_len)``, and the backup is a pinned host copy
of every written K/V. Each layer's certificates ``[B, H_q]`` go into a per-step buffer ``[L, B, H_q]`` (the kernel
writes them there; fallbacks and repaired bytes in gate mode are copied), and the observer gets the whole step in one
``observe_layers`` call when the last layer has run: one aggregator launch per step instead of one per layer.

How the attention function finds the cache: ``update`` returns the new K/V tensors and remembers
them; ``witcert_attention`` treats a call whose key tensor *is* the one the active cache just
returned as its own, and hands any other call (a plain ``DynamicCache``, an encoder) to SDPA.
Batches must be unpadded (equal lengths): a padded mask is refused with an error.
"""

from __future__ import annotations

import contextvars
import inspect
from typing import Any, Protocol

import torch
from transformers import AttentionInterface, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from witcert.integrations.gating import (
    CachePolicy,
    CertifiedDecode,
    CertifiedStep,
    DecodePaging,
    GateMode,
    RepairedStore,
)
from witcert.integrations.telemetry.step_report import CertificateObserver, StepReport
from witcert.kernels import KVPool

ATTENTION_NAME = "witcert"


class DecodeAudit(Protocol):
    """Called after every decode step at every layer with the query the attention read and the certificates."""

    def __call__(
        self, cache: WitcertCache, layer: int, query: torch.Tensor, certificate: torch.Tensor, sm_scale: float
    ) -> None: ...


class WitcertLayer(CacheLayerMixin):
    """One layer's view of the shared pool: it only tracks the length and delegates to the cache."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, cache: WitcertCache, layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.cache._allocate(key_states)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.cache._write(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.cache.max_cache_len

    def reset(self) -> None:
        raise NotImplementedError("a WitcertCache serves one request: make a new one instead of resetting it")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search is not supported by WitcertCache (slots key the dither streams)")


_ACTIVE_CACHE: contextvars.ContextVar[WitcertCache | None] = contextvars.ContextVar("witcert_cache", default=None)


class WitcertCache(Cache):
    """K/V for a batch of unpadded sequences in the witcert int8 pool, certified and gated at every decode step."""

    @property
    def max_cache_len(self) -> int:
        """Tokens per sequence; batch row ``b`` owns slots ``[b * max_cache_len, (b + 1) * max_cache_len)``. A
        property of our own: some transformers 5 releases (5.17) define a read-only ``Cache.max_cache_len``."""
        return self._max_cache_len

    def __init__(
        self,
        config: PreTrainedConfig,
        policy: CachePolicy | None = None,
        *,
        max_cache_len: int,
        observer: CertificateObserver | None = None,
        keep_exact: bool = False,
        audit: DecodeAudit | None = None,
    ) -> None:
        text_config = config.get_text_config(decoder=True)
        self.model_name: str | None = getattr(config, "name_or_path", None) or None
        self.num_layers: int = text_config.num_hidden_layers
        self.num_q_heads: int = text_config.num_attention_heads
        self.windows: list[int | None] = layer_windows(text_config)
        if max_cache_len <= 0:
            raise ValueError(f"max_cache_len must be positive, got {max_cache_len}")
        super().__init__(layers=[WitcertLayer(self, i) for i in range(self.num_layers)])
        self.policy = policy or CachePolicy()
        self._max_cache_len = max_cache_len
        self.observer = observer
        self.audit = audit
        # The exact backup costs host memory: keep it only where gating (or an audit) reads it.
        self.keep_exact = keep_exact or self.policy.mode is GateMode.GATE
        self.delta = self.policy.delta_step(self.num_layers, self.num_q_heads)
        self.decode_steps = 0
        # Running totals (no host sync per step): what this cache produced. The certificate count is known on
        # the host; fallbacks and bytes are summed on the compute device.
        self.certificate_total = 0
        self.fallback_total = torch.zeros((), dtype=torch.int64)
        self.repaired_bytes_total = torch.zeros((), dtype=torch.int64)
        self.pool: KVPool | None = None
        self.backup: dict[str, torch.Tensor] | None = None
        # Gate mode, per layer: the repaired (slot, KV head) pairs (the kernel's skip mask) and their exact rows.
        self.skip: list[torch.Tensor] = []
        self.repaired: list[RepairedStore] = []
        self._returned: tuple[int, torch.Tensor] | None = None
        # The layers of a decode step read the same slots, or on sliding-window layers the same window: the step's
        # pagings, keyed (batch, first, length), one per window size.
        self._paging: dict[tuple[int, int, int], DecodePaging] = {}
        # Per-step report buffers [L, B, H_q], allocated with the pool (the batch is fixed from then on).
        self._report: StepReport | None = None
        self._decode: CertifiedDecode | None = None

    # --- storage ---------------------------------------------------------------------------------

    def _allocate(self, key_states: torch.Tensor) -> None:
        if self.pool is not None:
            return
        batch, kv_heads, _, head_dim = key_states.shape
        if head_dim % self.policy.group_size:
            raise ValueError(f"group_size {self.policy.group_size} must divide head_dim {head_dim}")
        if self.policy.outlier_pairs > head_dim // 2:
            raise ValueError(f"outlier_pairs {self.policy.outlier_pairs} exceeds the {head_dim // 2} RoPE pairs")
        self._batch = batch
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.fallback_total = self.fallback_total.to(self.device)
        self.repaired_bytes_total = self.repaired_bytes_total.to(self.device)
        num_slots = batch * self.max_cache_len
        outliers = self.policy.outlier_channels(self.num_layers, kv_heads, head_dim, model=self.model_name)
        if isinstance(outliers, torch.Tensor):
            outliers = outliers.to(self.device)
        # The pool stores fp16/bf16 activations; an fp32 model (CPU tests) is cached as fp16.
        self.cache_dtype = self.dtype if self.dtype in (torch.float16, torch.bfloat16) else torch.float16
        self.pool = KVPool(
            num_slots,
            self.num_layers,
            kv_heads,
            head_dim,
            group_size=self.policy.group_size,
            outlier_channels=outliers,
            seed=self.policy.seed,
            dither_bits=self.policy.dither_bits,
            v_dither=self.policy.v_dither,
            device=self.device,
            dtype=self.cache_dtype,
        )
        if self.keep_exact:
            pin = self.device.type == "cuda"
            self.backup = {
                kind: torch.empty(
                    self.num_layers, num_slots, kv_heads, head_dim, dtype=self.cache_dtype, pin_memory=pin
                )
                for kind in ("k", "v")
            }
        # Pairs are only ever added: a WitcertCache serves one request and never frees or reorders slots.
        self.skip = [
            torch.zeros(num_slots, kv_heads, dtype=torch.bool, device=self.device) for _ in range(self.num_layers)
        ]
        self.repaired = [
            RepairedStore(kv_heads, head_dim, self.device, self.cache_dtype) for _ in range(self.num_layers)
        ]
        if self.observer is not None and self.policy.mode is not GateMode.OFF:
            self._report = StepReport(
                self.observer,
                self.num_layers,
                batch,
                self.num_q_heads,
                gate=self.policy.mode is GateMode.GATE,
                device=self.device,
                owner="WitcertCache",
            )
        self._decode = CertifiedDecode(
            self.pool,
            self.policy,
            self.delta,
            skip=self.skip,
            stores=self.repaired,
            fetch=self._fetch_exact,
            report=self._report,
            on_step=self._account,
        )

    def slots(self, batch_index: int, length: int, first: int = 0) -> torch.Tensor:
        """Pool slots of one sequence's positions ``first .. length - 1`` (sequence ``b`` owns a contiguous range)."""
        start = batch_index * self.max_cache_len
        return torch.arange(start + first, start + length, device=self.device)

    def visible(self, layer: int) -> tuple[int, int]:
        """``(first, length)``: the positions the newest token of ``layer`` attends to, ``first .. length - 1``: all
        of them, or on a sliding-window layer the last ``window`` (the token itself included, as transformers'
        sliding mask has it)."""
        length = self.layers[layer].length
        window = self.windows[layer]
        return (0 if window is None else max(0, length - window)), length

    @property
    def bytes_per_token(self) -> int:
        """Pool bytes per token, all layers, K and V."""
        if self.pool is None:
            raise RuntimeError("the cache holds nothing yet")
        return self.pool.bytes_per_token

    @property
    def fp16_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_heads * self.head_dim * 2 * 2

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, _, new, head_dim = k.shape
        if batch != self._batch:
            raise ValueError(f"this cache holds a batch of {self._batch}, got {batch}")
        state = self.layers[layer]
        start = state.length
        if start + new > self.max_cache_len:
            raise ValueError(f"sequence length {start + new} exceeds max_cache_len={self.max_cache_len}")
        positions = torch.arange(start, start + new, device=self.device)
        slots = (torch.arange(batch, device=self.device)[:, None] * self.max_cache_len + positions).reshape(-1)
        k_rows = k.transpose(1, 2).reshape(batch * new, self.kv_heads, head_dim).to(self.cache_dtype)
        v_rows = v.transpose(1, 2).reshape(batch * new, self.kv_heads, head_dim).to(self.cache_dtype)
        # Value checks (finite, in range) synchronise with the GPU: made on CPU only (docs/DEMO.md).
        self.pool.write(layer, slots, k_rows, v_rows, validate=self.device.type != "cuda")
        if self.backup is not None:
            # Copies into slices of the pinned backup are truly asynchronous; readers synchronise first.
            for b in range(batch):
                first = b * self.max_cache_len + start
                rows = slice(b * new, (b + 1) * new)
                self.backup["k"][layer, first : first + new].copy_(k_rows[rows], non_blocking=True)
                self.backup["v"][layer, first : first + new].copy_(v_rows[rows], non_blocking=True)
        state.length = start + new

        if new == 1:
            self._returned = (layer, k)
            _ACTIVE_CACHE.set(self)
            return k, v
        if start == 0:
            return k, v
        # A multi-token step after the prompt (chunked prefill) reads the past from the pool.
        past = [self._read_back(layer, b, start) for b in range(batch)]
        past_k = torch.stack([p[0] for p in past]).transpose(1, 2).to(k.dtype)
        past_v = torch.stack([p[1] for p in past]).transpose(1, 2).to(v.dtype)
        return torch.cat((past_k, k), dim=-2), torch.cat((past_v, v), dim=-2)

    def _read_back(
        self, layer: int, batch_index: int, length: int, first: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.slots(batch_index, length, first)
        mask, exact_k, exact_v = self.repaired[layer].dense(self.skip[layer], slots)
        k = torch.where(mask[..., None], exact_k.float(), self.pool.dequantize(layer, slots, "k"))
        v = torch.where(mask[..., None], exact_v.float(), self.pool.dequantize(layer, slots, "v"))
        return k, v

    def exact_keys(self, layer: int, batch_index: int) -> torch.Tensor:
        """The unquantized keys ``[S, H_kv, D]`` of one sequence at one layer (needs ``keep_exact``)."""
        if self.backup is None:
            raise RuntimeError("exact keys are kept only in gate mode or with keep_exact=True")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the backup copies are asynchronous
        first, length = self.visible(layer)
        return self.backup["k"][layer, self.slots(batch_index, length, first).cpu()].to(self.device)

    def keys_read(self, layer: int, batch_index: int) -> torch.Tensor:
        """The keys ``[S, H_kv, D]`` (float32) the latest decode step of ``layer`` read for one row (``visible``).

        The dequantized pool, except exact rows at the repaired (slot, KV head) pairs (gate mode).
        """
        first, length = self.visible(layer)
        return self._read_back(layer, batch_index, length, first)[0]

    # --- decode ----------------------------------------------------------------------------------

    def claims(self, layer: int, key: torch.Tensor) -> bool:
        return self._returned is not None and self._returned[0] == layer and self._returned[1] is key

    def _paging_for(self, batch: int, first: int, length: int) -> DecodePaging:
        """The pool's paging for ``batch`` sequences reading positions ``first .. length - 1`` each (sequence ``b``
        from slot ``b * max_cache_len``); no slot is read by two sequences, so gate mode needs no host sync for it."""
        key = (batch, first, length)
        if key not in self._paging:
            read = length - first
            kv_indices = (
                torch.arange(batch, device=self.device)[:, None] * self.max_cache_len
                + torch.arange(first, length, device=self.device)
            ).reshape(-1)
            kv_indptr = torch.arange(batch + 1, device=self.device) * read
            host = ([b * read for b in range(batch + 1)], 1 if read else 0)
            paging = DecodePaging.build(kv_indptr, kv_indices, gate=self.policy.mode is GateMode.GATE, host=host)
            self._paging = {k: v for k, v in self._paging.items() if k[2] == length} | {key: paging}
        return self._paging[key]

    def decode(self, layer: int, query: torch.Tensor, sm_scale: float) -> torch.Tensor:
        """Attention of one new token per sequence over the pool: ``query`` ``[B, H_q, D]`` -> ``[B, H_q, D]``.

        ``gating.CertifiedDecode``: the fused kernel reads every row; in gate mode it skips the (slot, KV head)
        pairs repaired at earlier steps, whose exact part is merged in, and rows where some head's merged
        certificate exceeds tau are recomputed on the repair path, all together (more blocks paged in until every
        head is within tau); their new pairs join the skip mask, so later steps read them through the kernel and
        the merge. Gate mode syncs with the host once per layer (to find those rows); observe and off modes never.
        """
        self._returned = None
        batch, _, _ = query.shape
        q = query.to(self.cache_dtype).contiguous()
        if layer == 0:
            self.decode_steps += 1
        return self._decode(layer, q, self._paging_for(batch, *self.visible(layer)), sm_scale).out

    def _account(self, layer: int, query: torch.Tensor, step: CertifiedStep, sm_scale: float) -> None:
        """Each certified layer, before it is reported: the running totals, then the audit."""
        if step.fallback is not None:
            self.fallback_total += step.fallback.sum()
            self.repaired_bytes_total += step.repaired_bytes.sum()
        self.certificate_total += step.certificate.numel()
        if self.audit is not None:
            self.audit(self, layer, query.float(), step.certificate, sm_scale)

    def flush_certificates(self) -> None:
        """Report the layers of a decode step that stopped before its last layer (``StepReport.flush``)."""
        if self._report is not None:
            self._report.flush()

    def _fetch_exact(
        self, layer: int, slots: torch.Tensor, kv_heads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact K and V rows ``[n, D]`` of the pairs ``(slots[i], kv_heads[i])`` from the host backup."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the backup copies are asynchronous
        picked, heads = slots.cpu(), kv_heads.cpu()
        return (
            self.backup["k"][layer, picked, heads].to(self.device),
            self.backup["v"][layer, picked, heads].to(self.device),
        )


def layer_windows(text_config: PreTrainedConfig) -> list[int | None]:
    """Each layer's sliding window (the tokens a new token attends to, itself included), or ``None`` where it
    attends to the whole sequence: from ``layer_types`` (Gemma 2 and 3, Qwen2 with ``use_sliding_window``), else one
    ``sliding_window`` for every layer (Mistral). A kind of attention the cache does not implement is refused."""
    window = getattr(text_config, "sliding_window", None)
    types = getattr(text_config, "layer_types", None)
    if types is None:
        return [window] * text_config.num_hidden_layers
    windows: list[int | None] = []
    for index, kind in enumerate(types):
        if kind == "full_attention":
            windows.append(None)
        elif kind == "sliding_attention" and window:
            windows.append(int(window))
        else:
            raise ValueError(f"layer {index}'s attention is {kind!r}: WitcertCache reads whole or sliding windows only")
    return windows


def witcert_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: decode steps of a ``WitcertCache`` read the pool, all else goes to SDPA."""
    cache = _ACTIVE_CACHE.get()
    layer = getattr(module, "layer_idx", None)
    if cache is None or layer is None or query.shape[2] != 1 or not cache.claims(layer, key):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # Every layer of a step gets the same padding mask, less what a sliding window hides: check it once per step (it
    # syncs with the host), over the tokens the layer reads.
    if layer == 0 and attention_mask is not None:
        read = attention_mask[..., cache.visible(layer)[0] :]
        if not bool((read == 0).all() if read.is_floating_point() else read.all()):
            raise ValueError("WitcertCache needs unpadded batches: the attention mask hides some cached tokens")
    sm_scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = cache.decode(layer, query[:, :, 0, :], sm_scale)
    return out[:, None].to(query.dtype), None


def use_witcert_attention(model: PreTrainedModel) -> None:
    """Route ``model``'s attention through ``witcert_attention`` (other caches keep exact SDPA behaviour)."""
    AttentionInterface.register(ATTENTION_NAME, witcert_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)


def cache_kwarg(model: PreTrainedModel) -> str:
    """The forward argument that takes the cache: ``cache`` from transformers 5.2x, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
