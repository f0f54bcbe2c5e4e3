"""Extend without the certificate on FlashAttention, over keys and values gathered from the pool.

The tiled extend kernel (``triton_extend``) keeps every operand exact and computes on the CUDA cores what
FlashAttention leaves to the tensor cores; on the H200 it takes 4.6-8.9x the time of fp16 SDPA
(docs/KERNELS.md, Extend). Prefill needs no certificate (the SGLang backend asks for none), so this path
trades the exactness for speed instead: ``KVPool.gather`` dequantizes every key and value the batch's
sequences see into dense tensors of the query's dtype (``x_hat`` rounded once), and
``torch.nn.attention.varlen.varlen_attn`` (FlashAttention in PyTorch) attends to them, causal with each
sequence's queries aligned to the end of its keys. It computes the same attention over the same
dequantized values, rounded as any fp16 or bf16 attention is (``x_hat`` to the query dtype, the weights
before PV): about 1e-3 relative against the float32 reference, where the exact kernels reach 1e-5.

Runs on CUDA devices of compute capability 8.0 or newer, fp16 or bf16 queries, head_dim up to 256, where
the gathered K and V fit ``LAUNCH.extend_flash_max_bytes``; ``covers`` decides, ``attend`` returns ``None``
where this PyTorch lacks what it needs, and ``extend_attention`` then runs the tiled kernel.
"""

from __future__ import annotations

import inspect
import logging
import math

import torch

from witcert.kernels.pool import KVPool

logger = logging.getLogger("witcert.kernels")
_said: set[str] = set()


def covers(q: torch.Tensor, pool: KVPool, num_keys: int) -> bool:
    """Whether extend without the certificate takes this path (``LAUNCH.extend_flash`` and the limits above)."""
    from witcert.kernels.attention import LAUNCH

    if not LAUNCH.extend_flash or q.device.type != "cuda" or q.shape[0] == 0:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[2] > 256 or q.shape[2] % 8:
        return False
    gathered = 2 * num_keys * pool.kv_heads * pool.head_dim * q.element_size()
    return gathered <= LAUNCH.extend_flash_max_bytes and torch.cuda.get_device_capability(q.device)[0] >= 8


def attend(
    q: torch.Tensor,
    pool: KVPool,
    layer: int,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    sm_scale: float | None,
    max_new: int,
    max_keys: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out [T, H_q, D] in q's dtype, lse [T, H_q] float32)``, or ``None`` where this PyTorch's
    ``varlen_attn`` cannot express the call. The index tensors must have passed extend's checks
    (``max_new`` and ``max_keys`` come from them): FlashAttention trusts its offsets."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        _unavailable("this PyTorch has no torch.nn.attention.varlen")
        return None
    parameters = inspect.signature(varlen.varlen_attn).parameters
    head_dim = q.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    options: dict = {"return_aux": varlen.AuxRequest(lse=True)}
    if "scale" in parameters:
        options["scale"] = scale
    elif scale != 1.0 / math.sqrt(head_dim):
        _unavailable("this PyTorch's varlen_attn takes no softmax scale")
        return None
    # Causal with the queries at the end of their sequence: FlashAttention aligns the causal mask to the
    # bottom-right corner when a sequence has more keys than queries (the tests check a prefix hit).
    if "window_size" in parameters:
        options["window_size"] = (-1, 0)
    else:
        options["is_causal"] = True
    keys, values = pool.gather(layer, kv_indices, q.dtype, validate=False)
    group = q.shape[1] // pool.kv_heads
    if "enable_gqa" in parameters:
        options["enable_gqa"] = True
    elif group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    out, lse = varlen.varlen_attn(
        q if q.stride(2) == 1 else q.contiguous(),
        keys,
        values,
        qo_indptr.to(torch.int32),
        kv_indptr.to(torch.int32),
        max_new,
        max_keys,
        **options,
    )
    # FlashAttention's varlen LSE is [H_q, T].
    if lse.shape != (q.shape[1], q.shape[0]):
        _unavailable(f"varlen_attn returned an LSE of shape {tuple(lse.shape)}, not [H_q, T]")
        return None
    return out, lse.t().float().contiguous()


def _unavailable(reason: str) -> None:
    if reason not in _said:
        _said.add(reason)
        logger.warning("extend runs the tiled kernel instead of FlashAttention: %s", reason)
