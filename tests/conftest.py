"""Suite-wide test setup.

Triton's interpreter (``TRITON_INTERPRET=1``) is how the fused attention kernels (`service.quant.kernels`) run on
CPU tensors. Triton reads the variable when it decorates a kernel, its own standard library included, which is
decorated the moment anything first imports ``triton`` (loading a model does, through transformers), so it is
set here, before any test module is imported, and only where no GPU is present: a GPU host runs the same tests
with the compiled kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
