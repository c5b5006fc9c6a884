"""Small builders shared by the quantizer tests: a model spec, policies, states, random K/V."""

import dataclasses

import torch

from service.artifacts.base import Provenance, default_v_group_size
from service.artifacts.policy import LayerPolicy, PolicyTable
from service.engine.spec import ModelSpec
from service.quant.kvquant import fit_state

SPEC = ModelSpec(
    arch="dream", model_id="tiny-gqa", fingerprint="ab" * 32, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, vocab_size=100, mask_id=99, eos_ids=(1,), pad_id=0, max_length=512,
)
PROV = Provenance(data="random test tensors", code="tests/quant")


def kv(batch, tokens, dtype=torch.float32, seed=0, spec=SPEC):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, spec.num_kv_heads, tokens, spec.head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def policy(entries, bits=4, cache_mode="dual", k_group_size=8, spec=SPEC, cap=16.0):
    return PolicyTable(
        model_id=spec.model_id, weights_fingerprint=spec.fingerprint, cache_mode=cache_mode, bits=bits,
        k_group_size=k_group_size, v_group_size=default_v_group_size(spec.head_dim), k_bit_cap=cap,
        layers=[LayerPolicy(score_type=s, p=p) for s, p in entries], provenance=PROV,
    )


def state(bits=4, spec=SPEC, seed=1):
    keys, values = zip(*(kv(4, 64, seed=seed + i, spec=spec) for i in range(spec.num_layers)))
    return fit_state(list(keys), list(values), bits, spec, PROV)


def with_layers(spec, n):
    return dataclasses.replace(spec, num_layers=n)
