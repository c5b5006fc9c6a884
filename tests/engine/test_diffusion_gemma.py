"""DiffusionGemma against the live transformers reference (its ``generate`` under ``torch.manual_seed``), on the tiny
seeded checkpoints of ``tests/data/diffusion_gemma`` (scripts/make_diffusion_gemma_tiny.py).

Token-exact at batch 1 over 30 runs (steps, entropy bound, temperature schedule, the stopping rule, several
canvases, prompt lengths on both sides of the sliding window, an EOS), with as many decoder and encoder passes as
the reference; the per-row generator mode equals the reference at batch 1 and each row's solo run in a batch.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from service.engine.errors import EngineInputError
from service.engine.loading import detect_arch, load_checkpoint
from service.engine.models.diffusion_gemma import GLOBAL, SLIDING, CanvasCache, DiffusionGemmaModel
from service.engine.renoise import RenoiseParams, entropy, generate, sample_row

DATA = Path(__file__).resolve().parents[1] / "data" / "diffusion_gemma"
TINY, W8, SETTLING = DATA / "dgemma-tiny", DATA / "dgemma-tiny-w8", DATA / "dgemma-tiny-settling"
PAD = 496


@dataclass(frozen=True)
class Case:
    checkpoint: Path
    prompt_length: int
    gen: int
    steps: int
    seed: int
    entropy_bound: float | None = None
    t_max: float | None = None
    t_min: float | None = None
    stability: int | None = None
    confidence: float | None = None

    @property
    def prompt(self) -> list[int]:
        rng = random.Random(self.prompt_length * 7919 + self.seed)
        return [498] + [rng.randrange(0, 496) for _ in range(self.prompt_length - 1)]

    def params(self) -> RenoiseParams:
        return RenoiseParams.for_checkpoint(
            self.checkpoint, max_new_tokens=self.gen, max_denoising_steps=self.steps,
            entropy_bound=self.entropy_bound, t_max=self.t_max, t_min=self.t_min,
            stability_threshold=self.stability, confidence_threshold=self.confidence)


LOW_T = {"t_max": 0.1, "t_min": 0.01}
CASES = [
    # steps
    Case(TINY, 14, 32, 1, 0), Case(TINY, 14, 32, 2, 1), Case(TINY, 5, 16, 5, 2), Case(TINY, 3, 16, 12, 3),
    Case(TINY, 9, 16, 48, 4),  # every default: 48 steps, bound 0.1, t 0.8 -> 0.4, stability 1, confidence 0.005
    # entropy bound
    Case(TINY, 7, 24, 4, 5, entropy_bound=0.05), Case(TINY, 7, 24, 4, 6, entropy_bound=1.0),
    Case(TINY, 7, 24, 4, 7, entropy_bound=5.0), Case(W8, 6, 16, 6, 8, entropy_bound=20.0),
    # temperature schedule
    Case(TINY, 4, 16, 6, 9, t_max=2.0, t_min=0.5), Case(TINY, 4, 16, 6, 10, t_max=1.0, t_min=0.0),
    Case(W8, 10, 24, 5, 11, t_max=0.3, t_min=0.29),
    # the stopping rule (low temperature: confident canvases), thresholds 0, 1, 2
    Case(TINY, 8, 48, 10, 12, stability=0, confidence=3.0, **LOW_T),
    Case(TINY, 8, 48, 10, 13, stability=1, confidence=3.0, **LOW_T),
    Case(W8, 8, 32, 12, 14, stability=2, confidence=4.0, **LOW_T),
    Case(W8, 3, 24, 8, 15, stability=1, confidence=1.0, entropy_bound=2.0, **LOW_T),
    # (a checkpoint whose canvases settle: the stability half fires)
    Case(SETTLING, 8, 24, 12, 6, stability=1, confidence=3.0, **LOW_T),
    Case(SETTLING, 8, 24, 12, 7, stability=2, confidence=3.0, **LOW_T),
    # several canvases, a length not a multiple of the canvas
    Case(TINY, 12, 40, 3, 16), Case(TINY, 1, 50, 2, 17), Case(W8, 2, 60, 2, 18), Case(W8, 20, 17, 3, 19),
    # prompt lengths around the sliding window (12 on dgemma-tiny, 8 on dgemma-tiny-w8): below, at, above, far above
    Case(TINY, 11, 16, 3, 20), Case(TINY, 12, 16, 3, 21), Case(TINY, 13, 16, 3, 22), Case(TINY, 40, 32, 3, 23),
    Case(W8, 7, 16, 3, 24), Case(W8, 8, 16, 3, 25), Case(W8, 33, 16, 3, 26),
    # an EOS ends the text (tokens after it: pad)
    Case(W8, 3, 64, 2, 19),
]


def _case(checkpoint: Path, prompt_length: int) -> Case:
    return next(c for c in CASES if c.checkpoint == checkpoint and c.prompt_length == prompt_length)


def reference_generate(ref, case: Case) -> tuple[list[int], int, int]:
    """The reference's new tokens, decoder passes and encoder passes for ``case`` (``torch.manual_seed`` then
    ``generate``)."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    kwargs = {"max_new_tokens": case.gen, "max_denoising_steps": case.steps}
    if case.entropy_bound is not None:
        kwargs["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=case.entropy_bound)
    if case.t_max is not None:
        kwargs.update(t_max=case.t_max, t_min=case.t_min)
    if case.stability is not None:
        kwargs.update(stability_threshold=case.stability, confidence_threshold=case.confidence)
    calls = {"decoder": 0, "encoder": 0}
    forward = ref.forward

    def counted(*args, **kw):
        calls["decoder"] += 1
        return forward(*args, **kw)

    hook = ref.model.encoder.register_forward_hook(lambda *_: calls.__setitem__("encoder", calls["encoder"] + 1))
    ref.forward = counted
    try:
        torch.manual_seed(case.seed)
        out = ref.generate(torch.tensor([case.prompt]), **kwargs)
    finally:
        del ref.forward
        hook.remove()
    return out.sequences[0, len(case.prompt):].tolist(), calls["decoder"], calls["encoder"]


@pytest.fixture(scope="module")
def references():
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.set_num_threads(1)
    return {path: DiffusionGemmaForBlockDiffusion.from_pretrained(path).eval() for path in (TINY, W8, SETTLING)}


@pytest.fixture(scope="module")
def engines():
    return {path: load_checkpoint(path) for path in (TINY, W8, SETTLING)}


@pytest.fixture(scope="module")
def runs(references, engines):
    """Every case decoded by the reference and by the engine (shared generator seeded as the reference)."""
    out = {}
    for case in CASES:
        loaded = engines[case.checkpoint]
        mine = generate(loaded.model, [case.prompt], case.params(), loaded.spec.eos_ids, PAD,
                        torch.Generator().manual_seed(case.seed), mode="shared")[0]
        out[case] = (reference_generate(references[case.checkpoint], case), mine)
    return out


@pytest.mark.parametrize("index", range(len(CASES)))
def test_token_exact_with_the_reference_at_batch_1(runs, index):
    (ids, decoder_passes, encoder_passes), mine = runs[CASES[index]]
    assert mine.generated_ids == ids
    assert mine.nfe == decoder_passes and mine.encoder_passes == encoder_passes


def test_the_cases_cover_the_rules(runs):
    """The table reaches what it is meant to: early stops under each stability threshold, several canvases, an EOS
    with pad after it, prompts longer than the sliding window (a test whose cases never stop early cannot check
    the stopping rule)."""
    early = {case.stability for case, (_, mine) in runs.items()
             if mine.nfe < case.steps * len(mine.steps_per_canvas)}
    assert {0, 1, 2} <= early
    assert sum(len(mine.steps_per_canvas) >= 3 for _, mine in runs.values()) >= 4
    stopped = [mine for _, mine in runs.values() if mine.finish_reason == "stop"]
    assert stopped and any(PAD in mine.generated_ids for mine in stopped)
    assert any(case.prompt_length > 2 * 12 for case in runs)
    assert len(CASES) >= 24


def test_the_per_row_generator_is_the_reference_at_batch_1(runs, engines):
    for case in CASES[::7]:
        loaded = engines[case.checkpoint]
        mine = generate(loaded.model, [case.prompt], case.params(), loaded.spec.eos_ids, PAD,
                        [torch.Generator().manual_seed(case.seed)], mode="per_row")[0]
        assert mine.generated_ids == runs[case][0][0]


def test_a_row_decodes_as_alone_in_any_batch(engines):
    """Per-row generators: each row of a batch (different prompt lengths, settings, stopping) equals its solo run,
    token for token and pass for pass."""
    cases = [CASES[i] for i in (2, 13, 18, 22, 25, 6)]
    assert {case.checkpoint for case in cases} == {TINY}
    loaded = engines[TINY]
    params = [case.params() for case in cases]
    prompts = [case.prompt for case in cases]
    solo = [generate(loaded.model, [p], q, loaded.spec.eos_ids, PAD, [torch.Generator().manual_seed(c.seed)])[0]
            for p, q, c in zip(prompts, params, cases, strict=True)]
    together = generate(loaded.model, prompts, params, loaded.spec.eos_ids, PAD,
                        [torch.Generator().manual_seed(c.seed) for c in cases])
    for alone, row in zip(solo, together, strict=True):
        assert row.generated_ids == alone.generated_ids
        assert row.nfe == alone.nfe and row.steps_per_canvas == alone.steps_per_canvas
    assert len({len(r.steps_per_canvas) for r in together}) > 1  # rows of different lengths finished apart


def test_decoder_logits_are_the_references_bit_for_bit(references, engines):
    """One encoder pass over a prompt longer than the window, then decoder passes with and without the
    self-conditioning input: the float32 logits equal the reference's ``forward`` (not a tolerance)."""
    ref, model = references[TINY], engines[TINY].model
    prompt = torch.tensor([_case(TINY, 40).prompt])
    canvas = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        from transformers import DynamicCache

        ref_cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
        ref.model.encoder(input_ids=prompt, cache=ref_cache)
        positions = torch.arange(prompt.shape[1], prompt.shape[1] + 16)[None]
        first = ref(decoder_input_ids=canvas, cache=ref_cache, decoder_position_ids=positions).logits
        second = ref(decoder_input_ids=canvas, cache=ref_cache, decoder_position_ids=positions,
                     self_conditioning_logits=first / 0.7).logits
        cache = CanvasCache(model.config, 1)
        model.encode(prompt, [prompt.shape[1]], cache)
        mine_first = model.decode(canvas, cache)
        mine_second = model.decode(canvas, cache, model.soft_embeddings(mine_first / 0.7))
    assert torch.equal(mine_first, first) and torch.equal(mine_second, second)


def test_detected_loaded_and_the_vision_tower_skipped(caplog):
    hf = json.loads((TINY / "config.json").read_text())
    assert detect_arch(hf) == "diffusion_gemma"
    with caplog.at_level(logging.INFO, logger="service.engine.models.diffusion_gemma"):
        loaded = load_checkpoint(TINY)
    skipped = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(skipped) == 1
    config = loaded.model.config
    assert isinstance(loaded.model, DiffusionGemmaModel)
    assert {SLIDING, GLOBAL} == set(config.layer_types) and config.num_experts == 8 and config.softcap == 30.0
    assert config.global_head_dim == 32 and config.global_kv_heads == 1 and config.global_rotary_pairs == 4
    assert loaded.spec.mask_id == config.vocab_size  # no mask token: an id no token has
    assert loaded.tokenizer is not None and loaded.tokenizer.chat_template
    # the passes' scalars are their own (the checkpoint's two buffers), not one tied copy
    layer = loaded.model.layers[0]
    assert not torch.equal(layer.encoder_scalar, layer.decoder_scalar)


def test_unsupported_config_values_are_refused_in_one_line():
    hf = json.loads((TINY / "config.json").read_text())
    hf["text_config"]["use_bidirectional_attention"] = "all"
    with pytest.raises(ValueError, match="use_bidirectional_attention='all'"):
        DiffusionGemmaModel.config_from_hf(hf)


def test_settings_the_reference_refuses_are_refused():
    with pytest.raises(EngineInputError, match="t_max"):
        RenoiseParams(t_max=0.3, t_min=0.4)
    with pytest.raises(EngineInputError, match="entropy_bound"):
        RenoiseParams(entropy_bound=0.0)
    with pytest.raises(EngineInputError, match="max_denoising_steps"):
        RenoiseParams(max_denoising_steps=0)


def test_sliding_layers_hold_at_most_w_minus_1_positions(engines):
    loaded = engines[W8]
    config = loaded.model.config
    cache = CanvasCache(config, 1)
    prompt = torch.tensor([_case(W8, 33).prompt])
    with torch.inference_mode():
        loaded.model.encode(prompt, [prompt.shape[1]], cache)
        loaded.model.encode(torch.zeros(1, config.canvas_length, dtype=torch.long), [config.canvas_length], cache)
    for index, kind in enumerate(config.layer_types):
        held = cache.k[index][0].shape[2]
        assert held == (config.sliding_window - 1 if kind == SLIDING else prompt.shape[1] + config.canvas_length)
    per_token = config.kv_bytes_per_token(4)
    held = cache.row_bytes(0)
    assert held[GLOBAL] == per_token[GLOBAL] * cache.length[0]
    assert held[SLIDING] == per_token[SLIDING] * (config.sliding_window - 1)


def test_the_sampler_in_chunks_draws_what_one_piece_draws():
    """The [C, V] work in pieces of any size draws the same tokens from the same generator (exponentials drawn in
    element order) and computes the same argmax and entropies: the chunk bounds memory, not results."""
    logits = torch.randn(1, 40, 300, generator=torch.Generator().manual_seed(1)) * 3
    whole = sample_row(logits, torch.Generator().manual_seed(5), chunk=40)
    for chunk in (1, 7, 16):
        parts = sample_row(logits, torch.Generator().manual_seed(5), chunk=chunk)
        assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True))
    torch.manual_seed(5)
    assert torch.equal(whole[0][0], torch.multinomial(torch.softmax(logits[0], -1, dtype=torch.float32), 1)[:, 0])
    assert torch.equal(whole[2], torch.distributions.Categorical(logits=logits).entropy())


def test_canvases_follow_max_new_tokens(engines):
    loaded = engines[W8]
    width = loaded.model.config.canvas_length
    result = generate(loaded.model, [[498, 5]], RenoiseParams(max_new_tokens=width + 1, max_denoising_steps=1),
                      (), None, torch.Generator().manual_seed(0))[0]
    assert len(result.steps_per_canvas) == math.ceil((width + 1) / width) == 2
    assert len(result.generated_ids) == 2 * width  # whole canvases, as the reference returns them
    assert entropy(torch.zeros(1, 4)).item() == pytest.approx(math.log(4))


def test_a_masked_decoding_setting_is_refused_at_admission(engines):
    """Served through the runtime now: a request with a masked family's setting is refused by the engine with a
    400 naming the field (no masked-decoding path runs on these weights)."""
    from service.engine import Engine
    from service.engine.params import DecodeParams

    loaded = engines[TINY]
    engine = Engine(loaded.model, loaded.spec, loaded.tokenizer, torch.float32, torch.device("cpu"))
    with pytest.raises(EngineInputError, match="send max_denoising_steps") as refused:
        engine.generate([[1, 2, 3]], DecodeParams(gen_length=32, steps=32))
    assert refused.value.field == "steps" and engine.capabilities.mask_kind == "renoising"


def test_a_canvas_of_256_sampled_in_chunks_is_the_reference(tmp_path):
    """The public canvas length (256 positions, so the sampler works in pieces of 64) on a checkpoint written by
    ``save_pretrained`` of a fresh seeded model (its generation config has no EOS ids: every canvas runs), a window
    shorter than the prompt, vocabulary 2,048."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from service.engine.renoise_settings import stop_ids

    torch.manual_seed(7)
    text = {"vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
            "num_global_key_value_heads": 1, "sliding_window": 64, "num_experts": 16, "top_k_experts": 4,
            "moe_intermediate_size": 32, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    vision = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "patch_size": 4,
              "position_embedding_size": 16, "pooling_kernel_size": 2}
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=256, image_token_id=2047,
                                  boi_token_id=2046, eoi_token_id=2045)
    DiffusionGemmaForBlockDiffusion(config).eval().save_pretrained(tmp_path)
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path).eval()
    loaded = load_checkpoint(tmp_path)
    eos_ids, pad_id = stop_ids(tmp_path)
    assert (eos_ids, pad_id) == ((), None)
    prompt, gen, steps, seed = list(range(3, 80)), 300, 2, 1
    torch.manual_seed(seed)
    expected = ref.generate(torch.tensor([prompt]), max_new_tokens=gen, max_denoising_steps=steps)
    params = RenoiseParams.for_checkpoint(tmp_path, max_new_tokens=gen, max_denoising_steps=steps)
    mine = generate(loaded.model, [prompt], params, eos_ids, pad_id, torch.Generator().manual_seed(seed),
                    mode="shared")[0]
    assert mine.generated_ids == expected.sequences[0, len(prompt):].tolist()
    assert mine.nfe == 2 * steps and len(mine.generated_ids) == 512
