"""KIVI as a plug-in: the base quantizer's own formats (`service.quant.base`: K per channel over groups of
``k_group_size`` tokens, 32 in the paper's adaptation; V per token over groups of ``v_group_size`` channels;
residual_length 0), no fitted artifact, and the pooled reader of the uniform formats (`service.quant.rows`), which
dLLM-KVQ's plug-in shares."""

from __future__ import annotations

from service.quant.base import KVQuantizer
from service.quant.plugin import PooledReader, QuantMethod, code_bits
from service.quant.rows import batch_key, dequantize_rows, forget


def _uniform_key(store, packed):
    return batch_key(store.quantizer, packed)


def _uniform_read(stores, layer, key_len, positions=None, rope=None):
    return dequantize_rows(stores, layer, key_len)


def _uniform_read_steps(stores, layer, key_len, positions=None, rope=None):
    k, v, steps = dequantize_rows(stores, layer, key_len, steps=True)
    return k, v, steps, None, None


#: The pooled reader of the uniform formats (KIVI's and dLLM-KVQ's; `service.quant.rows`).
UNIFORM_ROWS = PooledReader(key=_uniform_key, read=_uniform_read, forget=forget, read_steps=_uniform_read_steps)

METHOD = QuantMethod("kivi", quantizer=KVQuantizer, label="KIVI", pooled=UNIFORM_ROWS, configured_bits=code_bits,
                     fused_rows=True)
