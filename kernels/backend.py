"""Which implementation runs: compiled Triton on a GPU, Triton's interpreter on CPU, or the reference.

The choice is per device. Triton fixes compile-or-interpret when a kernel is decorated
(``TRITON_INTERPRET=1`` must be set before ``witcert.kernels.triton_kernels`` is imported), so the
module is imported lazily here, and a CPU tensor only takes the Triton path if the imported kernels
really are interpreted. Each path announces itself once, on the ``witcert.kernels`` logger.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Literal

import torch

# "gluon-gpu": decode whose stage 1 ran the Gluon kernel (kernels/gluon_decode.py); "gluon-ws-gpu": its
# warp-specialised form (kernels/gluon_decode_ws.py, LAUNCH.gluon_ws); otherwise "triton-gpu".
# "sdpa-gpu": extend without the certificate on PyTorch's SDPA over gathered K/V (kernels/extend_sdpa.py).
Path = Literal["gluon-gpu", "gluon-ws-gpu", "sdpa-gpu", "triton-gpu", "triton-interpreter", "reference"]

logger = logging.getLogger("witcert.kernels")
_announced: set[str] = set()


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def kernels_module() -> ModuleType:
    """The Triton kernels, imported on first use (after the caller settled ``TRITON_INTERPRET``)."""
    from witcert.kernels import triton_kernels

    return triton_kernels


def _kernels_are_interpreted() -> bool:
    """Ours and Triton's own library functions (``tl.max``...) must both be interpreted: the latter
    are decorated when ``triton`` is first imported, so the variable must precede that import."""
    import triton.language.standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton.language.standard.max, InterpretedFunction) and isinstance(
        kernels_module().write_kernel, InterpretedFunction
    )


def select_path(device: torch.device) -> Path:
    """The path for tensors on ``device``; logs which one the first time each is chosen."""
    if device.type == "cuda":
        path: Path = "triton-gpu"
        reason = "compiled Triton kernels on the GPU"
    elif device.type == "cpu" and _interpreter_requested() and _kernels_are_interpreted():
        path = "triton-interpreter"
        reason = "Triton kernels in the CPU interpreter (TRITON_INTERPRET=1): exact but slow"
    else:
        path = "reference"
        reason = (
            f"the torch reference on {device.type} (no GPU, and TRITON_INTERPRET=1 was not set before triton "
            "was first imported): exact but slow"
        )
    if path not in _announced:
        _announced.add(path)
        (logger.info if path == "triton-gpu" else logger.warning)("witcert kernels run %s", reason)
    return path
