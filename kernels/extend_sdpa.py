"""Extend without the certificate on PyTorch's SDPA (cuDNN or FlashAttention), over K/V gathered from the pool.

The tiled extend kernel (``triton_extend``) keeps every operand exact and computes on the CUDA cores what
FlashAttention leaves to the tensor cores; on the H200 it takes 4.6-8.9x the time of fp16 SDPA
(docs/KERNELS.md, Extend). Prefill needs no certificate (the SGLang backend asks for none), so this path
trades the exactness for speed instead: ``KVPool.gather`` dequantizes every key and value the batch's
sequences see into dense tensors of the query's dtype (``x_hat`` rounded once), and
``torch.nn.functional.scaled_dot_product_attention`` attends to them, one call per sequence, causal with
its queries aligned to the end of its keys. It computes the same attention over the same dequantized
values, rounded as any fp16 or bf16 attention is (``x_hat`` to the query dtype, the weights before PV):
about 1e-3 relative against the float32 reference, where the exact kernels reach 1e-5. No LSE comes back.

Session 9 first used ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention 2 over all sequences at
once): on the H200 with PyTorch 2.11 it took 1.3-1.8 ms where SDPA took 0.21-0.48 ms on the same shapes
(``bench/results/extend_varlen_h200.json``, ``flash`` against ``sdpa_fp16_eager``).

Runs on CUDA devices of compute capability 8.0 or newer, fp16 or bf16 queries, head_dim up to 256, where
the gathered K and V fit ``LAUNCH.extend_sdpa_max_bytes``; ``covers`` decides.
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from witcert.kernels.pool import KVPool


def covers(q: torch.Tensor, pool: KVPool, num_keys: int) -> bool:
    """Whether extend without the certificate takes this path (``LAUNCH.extend_sdpa`` and the limits above)."""
    from witcert.kernels.attention import LAUNCH

    if not LAUNCH.extend_sdpa or q.device.type != "cuda" or q.shape[0] == 0:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[2] > 256 or q.shape[2] % 8:
        return False
    gathered = 2 * num_keys * pool.kv_heads * pool.head_dim * q.element_size()
    return gathered <= LAUNCH.extend_sdpa_max_bytes and torch.cuda.get_device_capability(q.device)[0] >= 8


def attend(
    q: torch.Tensor,
    pool: KVPool,
    layer: int,
    qo_indptr: list[int],
    kv_indptr: list[int],
    kv_indices: torch.Tensor,
    *,
    sm_scale: float | None,
) -> torch.Tensor:
    """``out`` ``[T, H_q, D]`` in q's dtype, one SDPA call per sequence. The offsets are host lists, checked
    by ``extend_attention``: SDPA trusts them. A slot out of the pool's range makes its sequence's rows NaN
    (``KVPool.gather``)."""
    scale = 1.0 / math.sqrt(q.shape[2]) if sm_scale is None else float(sm_scale)
    keys, values = pool.gather(layer, kv_indices, q.dtype, validate=False)
    out = torch.empty_like(q)
    for (q_lo, q_hi), (kv_lo, kv_hi) in zip(pairwise(qo_indptr), pairwise(kv_indptr), strict=True):
        new, seen = q_hi - q_lo, kv_hi - kv_lo
        if new == 0:
            continue
        # New token i of n sees the first S - n + i + 1 keys: the causal mask aligned bottom-right, which
        # is the plain causal mask when the sequence has no prefix.
        mask = {"is_causal": True} if new == seen else {"attn_mask": causal_lower_right(new, seen)}
        attended = F.scaled_dot_product_attention(
            q[q_lo:q_hi].transpose(0, 1).unsqueeze(0),
            keys[kv_lo:kv_hi].transpose(0, 1).unsqueeze(0),
            values[kv_lo:kv_hi].transpose(0, 1).unsqueeze(0),
            scale=scale,
            enable_gqa=True,
            **mask,
        )
        out[q_lo:q_hi] = attended[0].transpose(0, 1)
    return out
