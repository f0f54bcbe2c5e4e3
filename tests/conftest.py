"""Test-session set-up shared by every test module."""

import os

import torch

# Without a GPU, Triton kernels run in its interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
