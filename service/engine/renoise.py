"""Renoising decode of DiffusionGemma: the reference ``generate`` token for token at batch 1.

Reference: transformers' ``models/diffusion_gemma/generation_diffusion_gemma.py`` (5.25),
``DiffusionGemmaGenerationMixin.generate`` with ``EntropyBoundSampler``, ``LinearTemperatureScheduleLogitsProcessor``
and ``StableAndConfidentStoppingCriteria``. Per canvas:

1. an encoder pass writes the prompt's (first canvas) or the last committed canvas's K/V into the cache;
2. the canvas starts as uniform random ids (no mask token);
3. for ``step = N .. 1`` (N = ``max_denoising_steps``): a decoder pass gives logits (self-conditioned on the previous
   step's processed logits), divided by the temperature ``t_min + (t_max - t_min) * step / N``; every position
   draws a token (``multinomial`` of the softmax), the argmax is the step's clean prediction; the positions sorted
   by entropy are accepted while ``sum of the accepted entropies - the largest <= entropy_bound``, the others
   redrawn uniformly; the canvas stops when its argmax has been the same for ``stability_threshold`` steps and the
   mean entropy is under ``confidence_threshold``;
4. the last argmax is committed; a canvas holding an EOS ends the text (tokens after the first EOS become pad), as
   does reaching ``ceil(max_new_tokens / canvas_length)`` canvases.

**Random draws.** The reference draws from torch's global generator: per canvas ``randint(0, V, (B, C))``, then per
step ``multinomial(probs [B*C, V], 1)`` (for one sample torch draws an exponential per (position, id) and takes
``argmax(p / q)``; CPU draws them in element order) and ``randint(0, V, (B, C))``. Two modes here:

* ``shared`` (one generator for the batch): those calls in that order; a ``torch.Generator`` seeded S gives the
  draws of ``torch.manual_seed(S)`` (CPU), so at batch 1 this *is* the reference's order (tested);
* ``per_row`` (each row its own generator, seeded by its request's ``seed``): each row makes its own calls of the
  same shapes with one row (``(1, C)``, ``[C, V]``) while it decodes, and none after; a row's draws never depend on
  the other rows, so it decodes as alone in any batch. At batch 1 the two modes are the same calls.

**Memory.** The per-step ``[C, V]`` float32 work (softmax, the exponentials, the entropy's normalised logits and
probabilities) runs one row and ``chunk`` positions at a time (the exponentials are drawn in element order, so the
draws do not change), so its peak is ``~4 x chunk x V x 4`` bytes whatever the rows; the logits ``[B, C, V]``
themselves (the model's output, kept as the next step's self-conditioning input as the reference keeps them) are
the one tensor that grows with the rows.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from service.engine.errors import EngineInputError
from service.engine.models.diffusion_gemma import CanvasCache, DiffusionGemmaModel, make_canvas_cache
from service.engine.params import EDITING_FIELDS
from service.engine.protocol import CacheCost, Capabilities, SettingRule, only

#: The reference's global defaults (``DiffusionGemmaGenerationConfig._get_default_generation_params``), applied
#: where neither the call nor the checkpoint's ``generation_config.json`` sets a value.
DEFAULTS = {"max_new_tokens": 256, "max_denoising_steps": 48, "entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8,
            "stability_threshold": 1, "confidence_threshold": 0.005}


@dataclass(frozen=True)
class RenoiseParams:
    """One request's renoising settings (the reference's ``generate`` arguments), checked as the reference checks
    them (``DiffusionGemmaGenerationConfig.validate``, ``EntropyBoundSamplerConfig``).

    Attributes:
        max_new_tokens: G; ``ceil(G / canvas_length)`` canvases at most (each whole: the reference returns them).
        max_denoising_steps: N > 0, decoder passes per canvas at most.
        entropy_bound: > 0, the accepted positions' summed entropy less the largest, in nats.
        t_min, t_max: the temperature schedule's ends, ``0 <= t_min < t_max``.
        stability_threshold: >= 0 steps the argmax must have been the same (0: no stability condition).
        confidence_threshold: > 0, mean entropy (nats) under which a stable canvas stops.

    Raises:
        EngineInputError: a value the reference refuses (the message names the field).
    """

    max_new_tokens: int = DEFAULTS["max_new_tokens"]
    max_denoising_steps: int = DEFAULTS["max_denoising_steps"]
    entropy_bound: float = DEFAULTS["entropy_bound"]
    t_min: float = DEFAULTS["t_min"]
    t_max: float = DEFAULTS["t_max"]
    stability_threshold: int = DEFAULTS["stability_threshold"]
    confidence_threshold: float = DEFAULTS["confidence_threshold"]

    def __post_init__(self) -> None:
        checks = [
            ("max_new_tokens", self.max_new_tokens > 0, "a positive integer"),
            ("max_denoising_steps", self.max_denoising_steps > 0, "a positive integer"),
            ("entropy_bound", self.entropy_bound > 0, "a float > 0"),
            ("t_min", self.t_min >= 0, ">= 0"),
            ("t_max", self.t_max > self.t_min, f"> t_min ({self.t_min})"),
            ("stability_threshold", self.stability_threshold >= 0, "an integer >= 0"),
            ("confidence_threshold", self.confidence_threshold > 0, "a float > 0"),
        ]
        for name, ok, legal in checks:
            if not ok:
                raise EngineInputError(f"{name} must be {legal}, got {getattr(self, name)!r}", name)

    @classmethod
    def for_checkpoint(cls, directory: Path | None, **given) -> RenoiseParams:
        """The settings of a call: ``given`` (None values dropped) over the checkpoint's ``generation_config.json``
        over :data:`DEFAULTS`, the reference's order of precedence (``_prepare_generation_config``)."""
        values = dict(DEFAULTS)
        generation = directory / "generation_config.json" if directory is not None else None
        if generation is not None and generation.is_file():
            saved = json.loads(generation.read_text())
            sampler = saved.get("sampler_config") or {}
            if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
                values["entropy_bound"] = sampler["entropy_bound"]
            values.update({k: saved[k] for k in DEFAULTS if saved.get(k) is not None})
        values.update({k: v for k, v in given.items() if v is not None})
        return cls(**values)


def stop_ids(directory: Path | None) -> tuple[tuple[int, ...], int | None]:
    """The EOS ids and the pad id the reference's ``generate`` uses: its generation config's, i.e. the checkpoint's
    ``generation_config.json`` (none there, or no such file: no EOS ends the text and nothing is padded; the
    reference does not fall back on ``config.json``)."""
    generation = directory / "generation_config.json" if directory is not None else None
    saved = json.loads(generation.read_text()) if generation is not None and generation.is_file() else {}
    eos = saved.get("eos_token_id")
    eos_ids = tuple(int(i) for i in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    pad = saved.get("pad_token_id")
    return eos_ids, int(pad) if pad is not None else None


@dataclass
class RenoiseResult:
    """One row's decode.

    Attributes:
        generated_ids: the reference's new tokens: every committed canvas whole, the tokens after the first EOS of
            the canvas holding it replaced by ``pad_id`` (``generate(...).sequences[0, len(prompt):]``).
        nfe: decoder passes (the reference's ``decoder_forward_passes``); encoder_passes: encoder passes (the
            prompt and each committed canvas but the last).
        steps_per_canvas: decoder passes of each canvas; finish_reason: ``"stop"`` (an EOS) or ``"length"``.
    """

    generated_ids: list[int] = field(default_factory=list)
    nfe: int = 0
    encoder_passes: int = 0
    steps_per_canvas: list[int] = field(default_factory=list)
    finish_reason: str = "length"

    def ids_to_eos(self, eos_ids: tuple[int, ...]) -> list[int]:
        """``generated_ids`` cut after the first EOS (the text's tokens)."""
        for i, token in enumerate(self.generated_ids):
            if token in eos_ids:
                return self.generated_ids[: i + 1]
        return list(self.generated_ids)

    def to_dict(self) -> dict:
        return asdict(self)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """``torch.distributions.Categorical(logits=logits).entropy()`` op for op: float32 ``[..., V]`` -> ``[...]``."""
    normed = logits - logits.logsumexp(dim=-1, keepdim=True)
    probs = torch.softmax(normed, dim=-1)
    return -(torch.clamp(normed, min=torch.finfo(normed.dtype).min) * probs).sum(-1)


def sample_row(logits: torch.Tensor, generator: torch.Generator | None, chunk: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw, argmax and entropy of one row's processed logits float32 ``[1, C, V]``, ``chunk`` positions at a time.

    The draw is ``multinomial(softmax32(logits), 1)`` as torch computes it for one sample (``argmax(p / q)``, ``q``
    exponentials drawn in element order: the same draws in chunks). Returns int64 ``[1, C]`` draws, int64 ``[1, C]``
    argmax, float32 ``[1, C]`` entropies.
    """
    _, c, _ = logits.shape
    drawn = torch.empty(1, c, dtype=torch.long, device=logits.device)
    argmax = torch.empty_like(drawn)
    ent = torch.empty(1, c, dtype=torch.float32, device=logits.device)
    for start in range(0, c, chunk):
        block = logits[0, start:start + chunk]  # [c', V]
        probs = torch.softmax(block, dim=-1, dtype=torch.float32)
        q = torch.empty_like(probs).exponential_(1, generator=generator)
        drawn[0, start:start + chunk] = torch.div(probs, q, out=q).argmax(dim=-1)
        del probs, q
        argmax[0, start:start + chunk] = block.argmax(dim=-1)
        ent[0, start:start + chunk] = entropy(block)
    return drawn, argmax, ent


def accept_mask(ent: torch.Tensor, bound: float) -> torch.Tensor:
    """The entropy-bounded acceptance (reference ``EntropyBoundSampler.accept_canvas``): positions sorted by entropy
    are kept while ``cumsum - current <= bound``. ent float32 ``[1, C]`` -> bool ``[1, C]``."""
    ordered, order = torch.sort(ent, dim=-1, descending=False)
    keep = torch.cumsum(ordered, dim=-1) - ordered <= bound
    return torch.scatter(torch.zeros_like(keep), dim=-1, index=order, src=keep)


def temperature(step: int, params: RenoiseParams) -> torch.Tensor:
    """The reference's ``LinearTemperatureScheduleLogitsProcessor`` at ``step`` (steps count down N..1), computed
    as it does (an int32 step tensor divided by N, in float32): a 0-dim float32 tensor."""
    t = torch.tensor(step, dtype=torch.int32) / params.max_denoising_steps
    return params.t_min + ((params.t_max - params.t_min) * t)


@dataclass
class _Row:
    """A row's state between steps."""

    params: RenoiseParams
    generator: torch.Generator | None
    result: RenoiseResult = field(default_factory=RenoiseResult)
    canvases_left: int = 0
    done: bool = False  # its text ended (EOS or length)
    settled: bool = False  # its current canvas stopped denoising
    history: list[torch.Tensor] = field(default_factory=list)


def generate(
    model: DiffusionGemmaModel,
    prompts: list[list[int]],
    params: RenoiseParams | list[RenoiseParams],
    eos_ids: tuple[int, ...],
    pad_id: int | None,
    generators: torch.Generator | list[torch.Generator | None] | None = None,
    mode: Literal["shared", "per_row"] = "per_row",
    chunk: int = 64,
    caches: list[CanvasCache] | None = None,
    kv_store=None,
) -> list[RenoiseResult]:
    """Decode ``prompts`` together by renoising (module doc), one decoder pass per step for all rows.

    Args:
        model: a loaded :class:`DiffusionGemmaModel` (eval, no grad needed: this runs under ``inference_mode``).
        prompts: token ids per row (non-empty, below the vocabulary size).
        params: one :class:`RenoiseParams` for every row, or one per row (``max_denoising_steps`` and the schedule
            may differ per row; a row stops on its own rule).
        eos_ids: ids that end the text (the reference's ``eos_token_id``); pad_id: what replaces the tokens after
            the first EOS (None: nothing is replaced, as the reference without a pad id).
        generators: ``shared``: one generator (None: torch's global one, the reference's); ``per_row``: one per row
            (None entries: the global one) or one for every row.
        mode: ``shared`` or ``per_row`` (module doc).
        chunk: positions per piece of the sampler's ``[C, V]`` work.
        caches: a list the rows' :class:`CanvasCache` is appended to (to read what they held at the end).
        kv_store: the request's KV store (`service.quant.store.make_kv_store`), or one per row: a quantized one
            holds its rows' committed K/V packed (`make_canvas_cache`) and counts them in its report; None: the
            unquantized cache.

    Returns:
        One :class:`RenoiseResult` per prompt, in order.

    Raises:
        EngineInputError: an empty prompt or an id outside the vocabulary; bad settings (:class:`RenoiseParams`).
        KVQuantError: a KV configuration the family cannot run (`make_canvas_cache`); a quantizer's refusal of
            non-finite K/V (`service.quant.errors.NonFiniteKVError`).
    """
    config = model.config
    vocab, width = config.vocab_size, config.canvas_length
    b = len(prompts)
    per_params = list(params) if isinstance(params, list) else [params] * b
    if mode not in ("shared", "per_row"):
        raise EngineInputError(f"unknown generator mode {mode!r}; legal: shared, per_row", "mode")
    for prompt in prompts:
        if not prompt or min(prompt) < 0 or max(prompt) >= vocab:
            raise EngineInputError(f"a prompt must be non-empty token ids in [0, {vocab})", "prompt")
    if mode == "shared" or not isinstance(generators, list):
        shared = generators if not isinstance(generators, list) else generators[0]
        row_generators = [shared] * b
    else:
        row_generators = list(generators)
    device = model.embed.weight.device
    rows = [_Row(p, g, canvases_left=math.ceil(p.max_new_tokens / width)) for p, g in zip(per_params, row_generators,
                                                                                         strict=True)]
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
    cache = make_canvas_cache(model, b, kv_store)
    if caches is not None:
        caches.append(cache)
    with torch.inference_mode():
        pending = [torch.tensor(p, device=device) for p in prompts]  # what the next encoder pass runs, per row
        while not all(row.done for row in rows):
            lengths = [0 if row.done else len(ids) for row, ids in zip(rows, pending, strict=True)]
            batch_ids = torch.full((b, max(lengths)), config.pad_id, dtype=torch.long, device=device)
            for r, ids in enumerate(pending):
                if lengths[r]:
                    batch_ids[r, : lengths[r]] = ids
            model.encode(batch_ids, lengths, cache)
            for r, row in enumerate(rows):
                row.result.encoder_passes += bool(lengths[r])
            argmax = _denoise(model, cache, rows, device, mode, chunk)
            # Every row's committed ids and first EOS read at once (two host syncs per commit whatever the rows).
            hits = torch.isin(argmax, eos)  # [B, C]
            first_eos = torch.where(hits.any(dim=-1), hits.int().argmax(dim=-1), -1).tolist()
            ids = argmax.tolist()
            for r, row in enumerate(rows):
                if row.done:
                    continue
                committed = ids[r]
                row.canvases_left -= 1
                if first_eos[r] >= 0:
                    if pad_id is not None:
                        committed = committed[: first_eos[r] + 1] + [pad_id] * (width - first_eos[r] - 1)
                    row.done, row.result.finish_reason = True, "stop"
                elif row.canvases_left == 0:
                    row.done = True
                row.result.generated_ids += committed
                pending[r] = argmax[r]
    return [row.result for row in rows]


def _denoise(model: DiffusionGemmaModel, cache: CanvasCache, rows: list[_Row], device: torch.device, mode: str,
             chunk: int) -> torch.Tensor:
    """One canvas for every row not done: returns its last argmax int64 ``[B, C]`` (rows done: junk)."""
    b, width, vocab = len(rows), model.config.canvas_length, model.config.vocab_size
    if mode == "shared":
        canvas = torch.randint(0, vocab, (b, width), generator=rows[0].generator, device=device)
    else:
        canvas = torch.zeros(b, width, dtype=torch.long, device=device)
        for r, row in enumerate(rows):
            if not row.done:
                canvas[r] = torch.randint(0, vocab, (1, width), generator=row.generator, device=device)[0]
    argmax = canvas.clone()
    for row in rows:
        row.settled, row.history = row.done, []
    before = [row.result.nfe for row in rows]
    soft = None
    step_count = 0
    steps = max(row.params.max_denoising_steps for row in rows if not row.done)
    while not all(row.settled for row in rows) and step_count < steps:
        step_count += 1
        live = [not row.settled for row in rows]
        logits = model.decode(canvas, cache, soft, rows=live)  # [B, C, V] float32 (rows not live: junk)
        accepted: list[torch.Tensor | None] = [None] * b
        tests: list[tuple[_Row, torch.Tensor]] = []  # (row, its stopping test on the device)
        for r, row in enumerate(rows):
            if not live[r] and mode != "shared":
                continue
            step = row.params.max_denoising_steps - step_count + 1
            if step >= 1:
                logits[r].div_(temperature(step, row.params))
            drawn, new_argmax, ent = sample_row(logits[r:r + 1], row.generator, chunk)
            if not live[r]:
                continue  # shared mode: the reference draws for finished rows too, and discards them
            row.result.nfe += 1
            keep = accept_mask(ent, row.params.entropy_bound)
            accepted[r] = keep
            canvas_r = torch.where(keep, drawn, canvas[r:r + 1])
            canvas[r] = canvas_r[0]
            stable = _stable(row, new_argmax)
            argmax[r] = new_argmax[0]
            if row.params.max_denoising_steps <= step_count:
                row.settled = True
            elif stable is not False:
                confident = torch.mean(ent, dim=-1)[0] < row.params.confidence_threshold  # 0-dim bool, on device
                tests.append((row, confident if stable is True else stable & confident))
        if tests:  # every row's stopping test read at once: one host sync per step whatever the rows
            for (row, _), stop in zip(tests, torch.stack([t for _, t in tests]).tolist(), strict=True):
                row.settled = stop
        if mode == "shared":
            noise = torch.randint(0, vocab, (b, width), generator=rows[0].generator, device=device)
        for r, row in enumerate(rows):
            if accepted[r] is None:
                continue
            fresh = noise[r:r + 1] if mode == "shared" else torch.randint(
                0, vocab, (1, width), generator=row.generator, device=device)
            canvas[r] = torch.where(~accepted[r], fresh, canvas[r:r + 1])[0]
        sc = logits.to(model.embed.weight.dtype)
        # One row at a time: the softmax's [C, V] float32 copy does not multiply with the rows (and a row's matmul
        # is the one it makes alone).
        soft = torch.zeros(b, width, model.config.width, dtype=sc.dtype, device=device)
        for r, row in enumerate(rows):
            if not row.settled:
                soft[r] = model.soft_embeddings(sc[r:r + 1])[0]
    for row, nfe in zip(rows, before, strict=True):
        if not row.done:
            row.result.steps_per_canvas.append(row.result.nfe - nfe)
    return argmax


def _stable(row: _Row, new_argmax: torch.Tensor) -> bool | torch.Tensor:
    """The stability half of ``StableAndConfidentStoppingCriteria``: the last ``stability_threshold`` argmax
    canvases all equal this one. True when the threshold is 0, False during the first that many steps, else a 0-dim
    bool tensor on the device (read with the step's other tests)."""
    k = row.params.stability_threshold
    if k == 0:
        return True
    stable = False if len(row.history) < k else torch.stack([(h == new_argmax).all() for h in row.history]).all()
    row.history = (row.history + [new_argmax.clone()])[-k:]
    return stable


# ---- the family's decoder (service.engine.protocol.FamilyDecoder) ---------------------------------------------------
# Serving a renoising family through the runtime (a running batch whose iterations are encoder passes, denoising
# steps and commits of many requests' canvases) is not built yet: the decoder declares the family and refuses each
# request at admission with a 400 that says what decodes it (`dllm-kvq generate`), so no masked-decoding path ever
# runs on these weights.

_NOT_SERVED = "DiffusionGemma is decoded by `dllm-kvq generate` only in this version (no running batch yet)"

CAPABILITIES = Capabilities(likelihood=False, layer_split=False, preemption=False, plan_bounded=False,
                            cache_kind="committed", mask_kind="renoising", served=False)

#: How the family would take each `DecodeSettings` field; every request is refused at admission for now (above).
SETTINGS: dict[str, SettingRule] = {
    "cache_mode": only(("prefix", "dual", "block"), "its decoder always reads the committed canvases' cache (no "
                       "recompute mode)", "the committed canvases' cache (prefix, dual and block name it)"),
    "block_length": SettingRule("not read: a canvas is the checkpoint's canvas_length"),
    "threshold": SettingRule("not read: acceptance is entropy-bounded (entropy_bound)"),
    "steps": SettingRule("would be max_denoising_steps per canvas"),
    "remasking": only(("low_confidence",), "there is no mask: non-accepted positions are redrawn uniformly"),
    "ignore_eos": only((False,), "the reference ends the text after the canvas holding its EOS"),
    "dream_schedule": only(("origin",), "dream_schedule is a Dream setting"),
    **{name: only((None,), "a LLaDA2.1 setting: this family does not edit tokens") for name in EDITING_FIELDS},
}


class RenoisingBatch:
    """The family's running batch (`service.engine.protocol.DecodeBatch`): empty, since no cohort is admitted."""

    def __init__(self) -> None:
        self.failed: list = []
        self.forwards = 0
        self.rows = 0
        self.cohorts: list = []

    def passes(self, cohorts):
        return []

    def run(self, forwards):
        return []

    def step(self):
        return []

    def join(self, cohort) -> None:
        raise EngineInputError(_NOT_SERVED, "model")

    def leave(self, cohort) -> None:
        return None

    def preemptible(self, cohort) -> bool:
        return False

    def preempt(self, cohort):
        raise ValueError("a renoising cohort cannot be preempted")

    def resume(self, cohort, call) -> None:
        raise ValueError("a renoising cohort cannot be preempted")


class RenoisingDecoder:
    """The `service.engine.protocol.FamilyDecoder` of DiffusionGemma: declared, refusing requests (module part
    above). Args: model, spec: the loaded model and its spec."""

    capabilities = CAPABILITIES
    settings = SETTINGS

    def __init__(self, model: DiffusionGemmaModel, spec) -> None:
        self.model, self.spec, self.family = model, spec, spec.arch
        #: Not read yet: no CUDA graphs and no prefix cache until the family is served (issues 41, 44).
        self.later_steps = None
        self.prefix_cache = None

    def batch(self, plan=None) -> RenoisingBatch:
        return RenoisingBatch()

    def cohort(self, prompts, params, rows, kv_store, on_block, cancelled):
        """Raises EngineInputError (HTTP 400, field ``model``): not served yet."""
        raise EngineInputError(_NOT_SERVED, "model")

    def report(self, cohort, decode_text):
        raise EngineInputError(_NOT_SERVED, "model")

    def cache_cost(self, prompt_len, params, store_bytes, quantized) -> CacheCost:
        """Nothing is served yet: counted as a store of its own would hold."""
        return CacheCost(store_bytes)
