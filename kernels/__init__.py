"""Computes: the reference mathematics (``witcert.kernels.reference``) and the Triton kernels."""

from witcert.kernels import reference

__all__ = ["reference"]
