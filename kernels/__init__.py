"""Computes: the reference mathematics (``witcert.kernels.reference``) and the Triton kernels.

Public entry points: ``KVPool`` (the dithered int8 cache and its write kernel), ``decode_attention``
and ``extend_attention`` (paged attention with the certificate fused in; ``ExtendBounds``, an extend batch's
offsets on the host, checked once per batch), ``select_path`` (which implementation runs on a device). Their
launch parameters are ``witcert.kernels.launch.LAUNCH``; ``witcert.kernels.soundness`` measures the certificate
against the true TV by Monte Carlo; ``witcert selftest`` (``cli``) checks the kernels on this machine.
docs/KERNELS.md describes them, docs/THEORY.md is their contract.
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
