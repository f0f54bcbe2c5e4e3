"""The ``witcert`` SGLang attention backend: decode and extend over the witcert pool, certified decode steps.

Decode: the new token's K/V are quantized into its slot, then ``gating.CertifiedDecode`` runs the step: the
fused kernel (``witcert.kernels.decode_attention``) returns the output and a certificate per (sequence, head);
in ``gate`` mode it skips the (slot, KV head) pairs repaired at earlier steps (the pool's ``repaired`` mask),
whose exact K/V sit on the device in the pool's per-layer ``RepairedStore`` and are merged in, and the
sequences still above tau are recomputed on the repair path with new blocks paged in from the pool's host
backup. This module is the paging glue: SGLang's ``req_to_token`` table gives each batch's ``kv_indptr`` /
``kv_indices``, a slot may be read by several rows (a radix-shared prefix), and a pair stays exact until SGLang
rewrites its slot (``set_kv_buffer`` clears its mask, and the store drops the entry at its next addition). Gate
mode syncs with the host once per decode step (the batch's paging and how often a slot repeats in it) and once
per layer (which rows exceed tau); observe and off modes never.
Each layer's certificates go into per-step buffers ``[L, B_max, H_q]`` (the kernel writes them there; fallbacks and
repaired bytes in gate mode are copied); when the last layer of the step has written, this TP rank's
``CertificateAggregator`` counts the whole step in one ``observe_layers`` launch (not one per layer).
When a collector is configured, the counts stream out over OTLP with the rank as a resource attribute.

Extend (prefill, chunked prefill, prefix-cache hits): causal attention over the int8 pool
(``witcert.kernels.extend_attention``) without a certificate; only decode steps are certified. On a GPU
that is PyTorch's SDPA over the K/V gathered from the pool, with the batch's offsets read back once per
batch (``init_forward_metadata``), not once per layer.
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.runtime_context import get_parallel

from witcert.integrations.gating import CachePolicy, CertifiedDecode, DecodePaging, GateMode
from witcert.integrations.sglang.capacity import fp16_cell_size_bytes
from witcert.integrations.sglang.checks import WitcertStartupError
from witcert.integrations.sglang.pool import WitcertKVPool
from witcert.integrations.telemetry.aggregator import CertificateAggregator
from witcert.integrations.telemetry.exporter import EngineIdentity, TelemetryStream, export_configured, otlp_exporter
from witcert.integrations.telemetry.step_report import StepReport
from witcert.kernels import ExtendBounds, extend_attention

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger("witcert.sglang")


@dataclass
class WitcertForwardMetadata:
    """Paging of one batch: sequence ``b`` reads slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr: torch.Tensor | None  # extend only: query rows of each sequence
    paging: DecodePaging | None = None  # decode only
    # Extend only: qo_indptr and kv_indptr on the host, read back and checked once per batch rather than once
    # per layer (extend_attention's SDPA path slices sequences on the host).
    extend_bounds: ExtendBounds | None = None


class WitcertAttnBackend(AttentionBackend):
    """SGLang attention backend over a ``WitcertKVPool``; one aggregator (and OTLP stream) per TP rank."""

    def __init__(self, model_runner: ModelRunner) -> None:
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, WitcertKVPool):
            raise WitcertStartupError(
                f"the witcert backend needs the witcert KV pool, but SGLang built {type(pool).__name__}: the "
                "plugin's pool hook did not run (is the witcert plugin excluded by SGLANG_PLUGINS?)"
            )
        if model_runner.use_mla_backend:
            raise WitcertStartupError("witcert covers multi-head / grouped-query attention, not MLA models")
        self.pool = pool
        self.settings = pool.settings
        policy = pool.policy
        self.device = torch.device(model_runner.device)
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        model_config = model_runner.model_config
        self.num_q_heads = model_config.get_num_attention_heads(get_parallel().attn_tp_size)
        # The union bound runs over every certificate of a request: all layers, all heads of all ranks.
        self.delta_step = policy.delta_step(pool.layer_num, model_config.num_attention_heads)
        self.forward_metadata: WitcertForwardMetadata | None = None
        self.aggregator: CertificateAggregator | None = None
        self.stream: TelemetryStream | None = None
        self._report: StepReport | None = None
        if policy.mode is not GateMode.OFF:
            self.aggregator = CertificateAggregator(
                pool.layer_num, self.num_q_heads, tau=policy.tau, stride=policy.stride, device=self.device
            )
            # Per-step report buffers [L, B_max, H_q]: a decode batch holds at most one sequence per request
            # slot (its padding row included).
            self._report = StepReport(
                self.aggregator,
                pool.layer_num,
                self.req_to_token.shape[0],
                self.num_q_heads,
                gate=policy.mode is GateMode.GATE,
                device=self.device,
                owner="the witcert backend",
            )
            endpoint = self.settings.collector_endpoint
            if endpoint is not None or export_configured():
                server_args = model_runner.server_args
                parallel = get_parallel()
                self.stream = TelemetryStream(
                    self.aggregator,
                    otlp_exporter(None if endpoint is None else str(endpoint)),
                    EngineIdentity(
                        model=str(getattr(server_args, "served_model_name", None) or server_args.model_path),
                        engine="sglang",
                        tp_rank=parallel.tp_rank,
                        # Each worker process of a server on this host: the port and the GPU tell them apart.
                        instance_key=f"{server_args.port}/{getattr(model_runner, 'gpu_id', '')}",
                        dither_seed=pool.witcert.seed,
                    ),
                    flush_seconds=self.settings.flush_seconds,
                    first_head=parallel.attn_tp_rank * self.num_q_heads,
                )
                # Export what was counted since the last flush when the worker exits normally.
                atexit.register(self._close_stream)
        self.certified = CertifiedDecode(
            pool.witcert,
            policy,
            self.delta_step,
            skip=pool.repaired,
            stores=pool.exact_store,
            fetch=self._fetch_exact,
            report=self._report,
        )
        logger.info(
            "witcert backend: mode=%s tau=%s, %d B/token (fp16 would be %d B/token)",
            self.policy.mode.value,
            self.policy.tau,
            pool.bytes_per_token,
            fp16_cell_size_bytes(num_layers=pool.layer_num, num_kv_heads=pool.head_num, head_dim=pool.head_dim),
        )

    @property
    def policy(self) -> CachePolicy:
        """The gating policy, the certified decode's (from the pool's settings)."""
        return self.certified.policy

    @policy.setter
    def policy(self, policy: CachePolicy) -> None:
        self.certified.policy = policy

    # --- metadata ----------------------------------------------------------------------------------

    def _paging(
        self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq_lens_sum: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lens = seq_lens.to(device=self.device, dtype=torch.int64)
        indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(lens, 0, out=indptr[1:])
        # The batch carries the total on the host; reading it off the device would synchronise.
        total = int(seq_lens_sum) if seq_lens_sum is not None else int(indptr[-1])
        rows = torch.repeat_interleave(req_pool_indices.to(self.device, torch.int64), lens, output_size=total)
        starts = torch.repeat_interleave(indptr[:-1], lens, output_size=total)
        positions = torch.arange(total, device=self.device) - starts
        return indptr, self.req_to_token[rows, positions].to(torch.int64)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if not (mode.is_decode() or mode.is_extend()) or mode.is_target_verify():
            raise RuntimeError(f"the witcert backend does not serve forward mode {mode.name}")
        kv_indptr, kv_indices = self._paging(
            forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.seq_lens_sum
        )
        qo_indptr = extend_bounds = None
        if mode.is_extend():
            qo_indptr = torch.zeros_like(kv_indptr)
            torch.cumsum(forward_batch.extend_seq_lens.to(self.device, torch.int64), 0, out=qo_indptr[1:])
            offsets = torch.cat((qo_indptr, kv_indptr)).tolist()
            extend_bounds = ExtendBounds(offsets[: qo_indptr.numel()], offsets[qo_indptr.numel() :])
        paging = None
        if mode.is_decode():
            paging = DecodePaging.build(kv_indptr, kv_indices, gate=self.policy.mode is GateMode.GATE)
        self.forward_metadata = WitcertForwardMetadata(kv_indptr, kv_indices, qo_indptr, paging, extend_bounds)
        if mode.is_decode() and self.stream is not None:
            self.stream.poll()

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise WitcertStartupError(
            "the witcert backend does not support CUDA graphs yet; launch with --cuda-graph-backend-decode disabled "
            "--cuda-graph-backend-prefill disabled"
        )

    # --- forward -----------------------------------------------------------------------------------

    def _check_layer(self, layer: RadixAttention) -> None:
        if layer.is_cross_attention or layer.qk_head_dim != layer.v_head_dim:
            raise RuntimeError(f"layer {layer.layer_id}: witcert serves self-attention with equal K/V head dims")
        if layer.logit_cap and layer.logit_cap > 0:
            raise RuntimeError(f"layer {layer.layer_id}: logit soft-capping is outside the certificate's softmax model")
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            raise RuntimeError(f"layer {layer.layer_id}: sliding-window attention is not covered by witcert")

    def _prepare(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool,
    ) -> torch.Tensor:
        """Checks the layer, writes the new K/V, and returns the query as ``[tokens, H_q, D]`` in the pool's dtype."""
        self._check_layer(layer)
        if save_kv_cache:
            self.pool.set_kv_buffer(layer, KVWriteLoc.for_batch(forward_batch), k, v, layer.k_scale, layer.v_scale)
        return q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim).to(self.pool.dtype)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        query = self._prepare(q, k, v, layer, forward_batch, save_kv_cache)
        local = layer.layer_id - self.pool.start_layer
        step = self.certified(local, query, self.forward_metadata.paging, layer.scaling)
        return step.out.to(q.dtype).reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def flush_certificates(self) -> None:
        """Report the layers of a decode step that stopped before its last layer (``StepReport.flush``;
        called at worker exit before the last export)."""
        if self._report is not None:
            self._report.flush()

    def _close_stream(self) -> None:
        try:
            self.flush_certificates()
        finally:
            self.stream.close()

    def _fetch_exact(
        self, local: int, slots: torch.Tensor, kv_heads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact K and V rows ``[n, D]`` of the pool's local layer ``local`` from its host backup."""
        return self.pool.exact_rows(local + self.pool.start_layer, slots, kv_heads)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        query = self._prepare(q, k, v, layer, forward_batch, save_kv_cache)
        meta = self.forward_metadata
        result = extend_attention(
            query,
            self.pool.witcert,
            layer.layer_id - self.pool.start_layer,
            meta.qo_indptr,
            meta.kv_indptr,
            meta.kv_indices,
            sm_scale=layer.scaling,
            delta_step=self.delta_step,
            certificate=False,
            bounds=meta.extend_bounds,
        )
        return result.out.to(q.dtype).reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
