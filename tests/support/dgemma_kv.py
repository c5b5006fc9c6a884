"""DiffusionGemma's quantized committed K/V, measured: the stores of each method and how closely a quantized cache's
decoder logits follow the unquantized cache's (tests/engine/test_diffusion_gemma_quant.py and
benchmarks/diffusion_gemma_kv_bytes.py share these)."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from service.engine.models.diffusion_gemma import DiffusionGemmaModel, make_canvas_cache
from service.engine.spec import ModelSpec
from service.quant.config import KVQuantConfig
from service.quant.store import QuantizedKVStore, make_kv_store
from tests.support.artifacts import kvquant_state_for, policy_for
from tests.support.quantizers import HeldQuantizer

METHODS = ("kivi", "dllm_kvq", "kvquant")


def store_for(method: str, bits: int, spec: ModelSpec, group: int = 8) -> QuantizedKVStore:
    """A store of ``method`` at ``bits`` with K groups of ``group`` tokens: dLLM-KVQ with one protected K token per
    group on every layer ranked by ``qerror`` (the score this family can give, `service.quant.canvas`); KVQuant with
    the small valid state of tests/support/artifacts.py (evenly spaced codebooks), its key ranges +-2.5 (the
    tiny checkpoints' keys are RMS-normed, about unit scale: about 1% fall outside, KVQuant's outlier share)."""
    if method == "kivi":
        return make_kv_store(KVQuantConfig(method="kivi", bits=bits, k_group_size=group), spec, attention="torch")
    if method == "dllm_kvq":
        policy = policy_for(spec, bits=bits, p=1, score_type="qerror", k_group_size=group)
        return make_kv_store(KVQuantConfig(method="dllm_kvq", bits=bits, k_group_size=group, artifact_id=policy.id),
                             spec, policy, attention="torch")
    state = kvquant_state_for(spec, bits=bits, k_range=2.5)
    return make_kv_store(KVQuantConfig(method="kvquant", bits=bits, k_group_size=group, artifact_id=state.id), spec,
                         state, attention="torch")


def held_store(spec: ModelSpec, group: int = 8) -> QuantizedKVStore:
    """A lossless store (:class:`HeldQuantizer`) with K pieces of ``group`` tokens on sliding layers."""
    return QuantizedKVStore(HeldQuantizer(KVQuantConfig(method="kivi", k_group_size=group), spec), attention="torch")


def scramble(cache, generator: torch.Generator) -> None:
    """Replace every K and V a :func:`held_store` cache holds by normal noise of their own scale: a garbage
    cache with the shapes and magnitudes of the real one."""
    holders = {id(entry[0]): entry[0] for entry in cache.packed if entry is not None}
    for blocks in (b for holder in holders.values() for held in holder.rows for b in held.layers.values()):
        for _, _, packed in blocks:
            for t in (packed.k.tensors["held"], packed.v.tensors["held"]):
                t.copy_(torch.randn(t.shape, generator=generator) * t.std())


def decoder_agreement(model: DiffusionGemmaModel, make_store: Callable[[], object], prompts: list[list[int]],
                      canvases: int = 3, seed: int = 0, garbage: bool = False) -> tuple[int, int]:
    """Teacher-forced top-1 agreement of the decoder over a quantized cache with the decoder over the unquantized
    one: for each prompt, the prompt and then ``canvases - 1`` canvases (the unquantized decode's argmax of a random
    canvas) are encoded into both caches, and at each canvas the argmax of both decoders' logits on the same random
    canvas is compared position by position. ``garbage``: the quantized cache's K/V are replaced by noise
    (:func:`scramble`, ``make_store`` must then be :func:`held_store`). Returns (positions agreeing, positions)."""
    gen = torch.Generator().manual_seed(seed)
    vocab, width = model.config.vocab_size, model.config.canvas_length
    same = total = 0
    with torch.inference_mode():
        for prompt in prompts:
            exact, quant = make_canvas_cache(model, 1), make_canvas_cache(model, 1, make_store())
            pending = torch.tensor([prompt])
            for _ in range(canvases):
                for cache in (exact, quant):
                    model.encode(pending, [pending.shape[1]], cache)
                if garbage:
                    scramble(quant, gen)
                canvas = torch.randint(0, vocab, (1, width), generator=gen)
                want = model.decode(canvas, exact).argmax(-1)
                got = model.decode(canvas, quant).argmax(-1)
                same += int((want == got).sum())
                total += want.numel()
                pending = want
    return same, total


def prompts_for(count: int, length: int, bos: int, seed: int = 0, top: int = 496) -> list[list[int]]:
    """``count`` seeded random prompts of ``length`` ids (``bos`` first, the rest below ``top``)."""
    rng = random.Random(seed)
    return [[bos] + [rng.randrange(0, top) for _ in range(length - 1)] for _ in range(count)]
