"""Fused attention over the packed reused cache (Triton), and the kernel-ready views of the packed formats.

`service.quant.kernels.operands` and `service.quant.kernels.parts` (several stores' operands side by side, for
one launch over the rows of many requests) are plain torch (importable without Triton); `service.quant.kernels.attention`
imports Triton and is loaded only when the kernel path is taken (see `service.quant.store.QuantizedKVStore`).
"""
