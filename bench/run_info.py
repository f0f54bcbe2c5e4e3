"""What a GPU benchmark's results file records about the run: device, library versions, start time."""

from __future__ import annotations

import platform
import time

import torch
import triton


def gpu_run_info() -> dict:
    """The device, torch, Triton and Python versions and the UTC start time (needs a CUDA device)."""
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
