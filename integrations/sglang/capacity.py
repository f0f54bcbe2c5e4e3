"""The byte account of the witcert pool, which SGLang's capacity computation must use.

SGLang sizes its KV pool as ``available bytes // cell size`` (bytes per token over all layers). The
witcert pool stores, per layer, per side (K, V) and per KV head of a token: ``D`` int8 codes,
``D / G`` fp16 group scales and ``2m`` outlier values in the model's 16-bit dtype. The exact backup
used by gate mode lives in host memory and costs no device bytes; the device copy of repaired pairs
(``gating.RepairedStore``) is not counted here.
"""

from __future__ import annotations

SCALE_BYTES = 2  # fp16 group scales
OUTLIER_BYTES = 2  # outliers keep the model's fp16/bf16 value


def cell_size_bytes(*, num_layers: int, num_kv_heads: int, head_dim: int, group_size: int, outlier_pairs: int) -> int:
    """Device bytes per token: ``L * 2 * H_kv * (D + 2 D/G + 2 * 2m)``."""
    if head_dim % group_size:
        raise ValueError(f"group_size {group_size} must divide head_dim {head_dim}")
    if 2 * outlier_pairs > head_dim:
        raise ValueError(f"{outlier_pairs} outlier pairs exceed the {head_dim // 2} RoPE pairs of a head")
    per_head = head_dim + SCALE_BYTES * (head_dim // group_size) + OUTLIER_BYTES * 2 * outlier_pairs
    return num_layers * 2 * num_kv_heads * per_head


def fp16_cell_size_bytes(*, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """What SGLang's default account charges for a 16-bit cache: ``L * 2 * H_kv * D * 2``."""
    return num_layers * 2 * num_kv_heads * head_dim * 2
