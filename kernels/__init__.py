"""Computes: the reference mathematics (``witcert.kernels.reference``) and the Triton kernels.

Public entry points: ``KVPool`` (the dithered int8 cache and its write kernel), ``decode_attention``
and ``extend_attention`` (paged attention with the certificate fused in; ``ExtendBounds``, an extend batch's
offsets on the host, checked once per batch), ``select_path`` (which implementation runs on a device).
"""

from witcert.kernels import reference
from witcert.kernels.attention import (
    AttentionOutput,
    decode_attention,
    extend_attention,
)
from witcert.kernels.backend import select_path
from witcert.kernels.extend_bounds import ExtendBounds
from witcert.kernels.pool import KVPool

__all__ = [
    "AttentionOutput",
    "ExtendBounds",
    "KVPool",
    "decode_attention",
    "extend_attention",
    "reference",
    "select_path",
]
