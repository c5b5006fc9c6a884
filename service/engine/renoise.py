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
  the other rows, so it decodes as alone in any batch. At batch 1 the two modes are the same calls. This mode is
  the server's running batch (:class:`RenoisingBatch`, below: rows join and leave between iterations).

**Memory.** The per-step ``[C, V]`` float32 work (softmax, the exponentials, the entropy's normalised logits and
probabilities) runs one row and ``chunk`` positions at a time (the exponentials are drawn in element order, so the
draws do not change), so its peak is ``~4 x chunk x V x 4`` bytes whatever the rows; the logits ``[B, C, V]``
themselves (the model's output, kept as the next step's self-conditioning input as the reference keeps them) are
the one tensor that grows with the rows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from service.engine.decode import CommittedIds
from service.engine.errors import EngineInputError
from service.engine.models.diffusion_gemma import CanvasCache, DiffusionGemmaModel, make_canvas_cache
from service.engine.params import EDITING_FIELDS, RENOISING_FIELDS, DecodeParams, RowOptions
from service.engine.protocol import (
    CacheCost,
    Cancelled,
    Capabilities,
    OnBlock,
    Plan,
    SettingRule,
    after_iteration,
    honoured,
    only,
    refused_all,
)
from service.engine.renoise_settings import (
    DEFAULTS,
    RenoiseParams,
    checkpoint_directory,
    settings_for,
)
from service.engine.report import DecodeReport, RowReport, Timings
from service.engine.response import cut_response


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
    eos = eos_tensor(eos_ids, device)
    if mode == "per_row":  # the running batch's iterations (rows apart: each as alone)
        with torch.inference_mode():
            batch = [RenoisingRow(model, p, q, g, c) for p, q, g, c in zip(
                prompts, per_params, row_generators, new_caches(model, b, kv_store), strict=True)]
            while any(not row.done for row in batch):
                iterate(model, [row for row in batch if not row.done], eos, pad_id, chunk)
        if caches is not None:
            caches.append(CanvasCache.of_rows([row.cache for row in batch]))
        return [row.result for row in batch]
    rows = [_Row(p, g, canvases_left=math.ceil(p.max_new_tokens / width)) for p, g in zip(per_params, row_generators,
                                                                                         strict=True)]
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
            argmax = _denoise(model, cache, rows, device, chunk)
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


def _denoise(model: DiffusionGemmaModel, cache: CanvasCache, rows: list[_Row], device: torch.device,
             chunk: int) -> torch.Tensor:
    """One canvas for every row not done, in ``shared`` mode (the reference's draws on one generator, the rows in
    step): returns its last argmax int64 ``[B, C]`` (rows done: junk)."""
    b, width, vocab = len(rows), model.config.canvas_length, model.config.vocab_size
    canvas = torch.randint(0, vocab, (b, width), generator=rows[0].generator, device=device)
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
            step = row.params.max_denoising_steps - step_count + 1
            if step >= 1:
                logits[r].div_(temperature(step, row.params))
            drawn, new_argmax, ent = sample_row(logits[r:r + 1], row.generator, chunk)
            if not live[r]:
                continue  # the reference draws for finished rows too, and discards them
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
        noise = torch.randint(0, vocab, (b, width), generator=rows[0].generator, device=device)
        for r in range(b):
            if accepted[r] is not None:
                canvas[r] = torch.where(~accepted[r], noise[r:r + 1], canvas[r:r + 1])[0]
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


# ---- the running batch (service.engine.protocol.DecodeBatch) --------------------------------------------------------
# Requests join and leave between iterations. Each request row keeps its own generator (``per_row``: seeded by its
# request's seed), its own committed K/V (one-row `CanvasCache`, made by `new_caches`) and its own place in its
# canvas, so rows need not move together: an iteration runs one encoder pass over every row whose prompt or last
# committed canvas is not encoded yet (after which that row starts a canvas), then one decoder pass (one denoising
# step) over every row that is denoising, then commits the canvases that stopped. A row's tokens and passes are its
# solo run's (tested: rows joining mid-run, other lengths and settings).


def new_caches(model: DiffusionGemmaModel, rows: int, kv_store: Any = None) -> list[CanvasCache]:
    """One one-row `CanvasCache` per row of a request (the one place the running batch makes caches):
    ``kv_store`` is the request's store (or one per row), a quantized one holding the rows' committed K/V packed,
    one holder for the request's rows (`service.engine.models.diffusion_gemma.make_canvas_cache`), each row its
    own entry in it.

    Raises:
        KVQuantError: a store configuration this family cannot run (see ``make_canvas_cache``).
    """
    whole = make_canvas_cache(model, rows, kv_store)
    return [CanvasCache(model.config, 1, None if whole.packed is None else [whole.packed[r]]) for r in range(rows)]


class RenoisingRow:
    """One row's renoising state between iterations (the solo run of :func:`generate` in ``per_row`` mode, cut
    at its iterations).

    Args:
        model: the loaded model. prompt: its token ids (non-empty, in the vocabulary). params: its settings.
        generator: its own generator (None: torch's global one). cache: its committed K/V (`new_caches`;
        None: an unquantized one-row cache).
    """

    def __init__(self, model: DiffusionGemmaModel, prompt: list[int], params: RenoiseParams,
                 generator: torch.Generator | None, cache: CanvasCache | None = None) -> None:
        device = model.embed.weight.device
        self.params, self.generator = params, generator
        self.result = RenoiseResult()
        self.canvases_left = math.ceil(params.max_new_tokens / model.config.canvas_length)
        self.cache = cache if cache is not None else CanvasCache(model.config, 1)
        #: What its next encoder pass runs (the prompt, then each committed canvas); None while it denoises.
        self.pending: torch.Tensor | None = torch.tensor(prompt, device=device)
        #: The runs its encoder passes wrote into its cache so far (the prompt, then each committed canvas), one
        #: per pass: what a preempted row re-encodes, pass for pass, before :attr:`pending`.
        self.encoded: list[torch.Tensor] = []
        #: Runs still to re-encode after a preemption (:meth:`RenoisingBatch.resume`), oldest first.
        self.replay: list[torch.Tensor] = []
        self.canvas: torch.Tensor | None = None  # int64 [C]
        self.argmax: torch.Tensor | None = None  # int64 [C], the last step's clean prediction
        self.soft: torch.Tensor | None = None  # [C, width], the next step's self-conditioning input
        self.keep: torch.Tensor | None = None  # bool [1, C], the last step's accepted positions
        self.history: list[torch.Tensor] = []
        self.step_count = 0
        self.settled = False
        self.done = False

    @property
    def denoising(self) -> bool:
        """Its next pass is a denoising step (its text goes on and its context is encoded)."""
        return not self.done and self.pending is None

    def start_canvas(self, vocab: int, width: int) -> None:
        """A fresh canvas: uniform random ids (the reference's ``randint(0, V, (1, C))``, on its generator)."""
        self.canvas = torch.randint(0, vocab, (1, width), generator=self.generator, device=self.pending.device)[0]
        self.argmax = self.canvas.clone()
        self.pending, self.soft, self.history, self.step_count, self.settled = None, None, [], 0, False


#: Fewest tokens of a row's pass that may share a forward with other rows. torch's CPU matmul takes another kernel
#: below 4 rows of input (measured: ``linear(x[:m])`` is not ``linear(x)[:m]`` bit for bit for m = 1, 2, 3, and is
#: for m >= 4), so a row whose solo pass has fewer tokens (a prompt of 1 to 3 tokens) rounds as alone only alone.
STACKABLE_TOKENS = 4


def encode_groups(rows: list[RenoisingRow], runs: list[torch.Tensor] | None = None) -> list[list[int]]:
    """The encoder forwards of ``rows`` (indices into it), each row encoding its run (``runs[r]``; default its
    pending tokens): every row of at least :data:`STACKABLE_TOKENS` tokens in one, each shorter row in one of its
    own (so each row's K/V are its solo run's bit for bit)."""
    runs = [row.pending for row in rows] if runs is None else runs
    stacked = [r for r, run in enumerate(runs) if len(run) >= STACKABLE_TOKENS]
    return ([stacked] if stacked else []) + [[r] for r, run in enumerate(runs) if len(run) < STACKABLE_TOKENS]


def _encode(model: DiffusionGemmaModel, rows: list[RenoisingRow], runs: list[torch.Tensor]) -> None:
    """One encoder pass of ``runs[r]`` after row r's committed text (right-padded together), written into each
    row's cache and recorded as encoded."""
    lengths = [len(run) for run in runs]
    ids = torch.full((len(rows), max(lengths)), model.config.pad_id, dtype=torch.long, device=runs[0].device)
    for r, run in enumerate(runs):
        ids[r, : lengths[r]] = run
    caches = [row.cache for row in rows]
    view = CanvasCache.of_rows(caches)
    model.encode(ids, lengths, view)
    view.write_back(caches)
    for row, run in zip(rows, runs, strict=True):
        row.encoded.append(run)


def encode_rows(model: DiffusionGemmaModel, rows: list[RenoisingRow]) -> None:
    """One encoder pass over ``rows``' pending tokens (:func:`encode_groups` says which rows may share one),
    written into each row's cache; each row then starts a canvas."""
    _encode(model, rows, [row.pending for row in rows])
    for row in rows:
        row.result.encoder_passes += 1
        row.start_canvas(model.config.vocab_size, model.config.canvas_length)


def replay_rows(model: DiffusionGemmaModel, rows: list[RenoisingRow]) -> tuple[int, int]:
    """Rebuild preempted rows' committed K/V: each row's :attr:`RenoisingRow.replay` runs re-encoded one pass per
    run, in their order, grouped as :func:`encode_groups` groups them: each pass has the inputs, positions and
    shapes of the pass that first wrote them (the prompt's, then each canvas's), so the K/V are the same bit for
    bit (one pass over the whole text would not be: the experts' ``grouped_mm`` rounds an expert's group by its
    size, docs/diffusion_gemma.md). No draw, no canvas: the row then encodes its pending run as it would have.
    Returns (forwards, row-forwards) run."""
    forwards = row_forwards = 0
    while waiting := [row for row in rows if row.replay]:
        runs = [row.replay[0] for row in waiting]
        for group in encode_groups(waiting, runs):
            _encode(model, [waiting[r] for r in group], [runs[r] for r in group])
            forwards, row_forwards = forwards + 1, row_forwards + len(group)
        for row in waiting:
            row.replay.pop(0)
    return forwards, row_forwards


def denoise_rows(model: DiffusionGemmaModel, rows: list[RenoisingRow], chunk: int) -> list[RenoisingRow]:
    """One denoising step of ``rows`` (one decoder pass): each row's draws from its own generator in its solo
    order (the sample, then the renoise draw), its stopping test read with the others' at once (one host sync).
    Returns the rows whose canvas stopped."""
    canvas = torch.stack([row.canvas for row in rows])
    soft = None
    if any(row.soft is not None for row in rows):
        # A row at its canvas's first step takes zeros: the self-conditioning MLP of zeros is exactly zero, so it
        # reads what it reads alone (no input, the reference's zero signal).
        like = next(row.soft for row in rows if row.soft is not None)
        soft = torch.stack([row.soft if row.soft is not None else torch.zeros_like(like) for row in rows])
    logits = model.decode(canvas, CanvasCache.of_rows([row.cache for row in rows]), soft)  # [B, C, V] float32
    tests: list[tuple[RenoisingRow, torch.Tensor]] = []
    for r, row in enumerate(rows):
        row.step_count += 1
        steps = row.params.max_denoising_steps
        logits[r].div_(temperature(steps - row.step_count + 1, row.params))
        drawn, new_argmax, ent = sample_row(logits[r:r + 1], row.generator, chunk)
        row.result.nfe += 1
        row.keep = accept_mask(ent, row.params.entropy_bound)
        row.canvas = torch.where(row.keep, drawn, row.canvas[None])[0]
        stable = _stable(row, new_argmax)
        row.argmax = new_argmax[0]
        if steps <= row.step_count:
            row.settled = True
        elif stable is not False:
            confident = torch.mean(ent, dim=-1)[0] < row.params.confidence_threshold
            tests.append((row, confident if stable is True else stable & confident))
    if tests:
        for (row, _), stop in zip(tests, torch.stack([t for _, t in tests]).tolist(), strict=True):
            row.settled = stop
    vocab, dtype = model.config.vocab_size, model.embed.weight.dtype
    for r, row in enumerate(rows):
        fresh = torch.randint(0, vocab, row.keep.shape, generator=row.generator, device=canvas.device)
        row.canvas = torch.where(~row.keep, fresh, row.canvas[None])[0]
        row.soft = None if row.settled else model.soft_embeddings(logits[r:r + 1].to(dtype))[0]
    return [row for row in rows if row.settled]


def commit_rows(rows: list[RenoisingRow], eos: torch.Tensor, pad_id: int | None, width: int) -> None:
    """Commit each row's canvas (its last argmax): every row's ids and first EOS read at once (two host syncs
    whatever the rows); the text ends at the canvas holding an EOS (pad after it) or at its last canvas; a row that
    goes on encodes the canvas next."""
    argmax = torch.stack([row.argmax for row in rows])  # [B, C]
    hits = torch.isin(argmax, eos)
    first_eos = torch.where(hits.any(dim=-1), hits.int().argmax(dim=-1), -1).tolist()
    for row, committed, first in zip(rows, argmax.tolist(), first_eos, strict=True):
        row.canvases_left -= 1
        if first >= 0:
            if pad_id is not None:
                committed = committed[: first + 1] + [pad_id] * (width - first - 1)
            row.done, row.result.finish_reason = True, "stop"
        elif row.canvases_left == 0:
            row.done = True
        row.result.generated_ids += committed
        row.result.steps_per_canvas.append(row.step_count)
        row.pending = None if row.done else row.argmax
        row.canvas = row.soft = row.keep = None


def iterate(model: DiffusionGemmaModel, rows: list[RenoisingRow], eos: torch.Tensor, pad_id: int | None,
            chunk: int) -> tuple[int, int]:
    """One iteration of ``rows`` (none done): the encoder pass, the denoising step, the commits (section doc).
    Returns (forwards, row-forwards) run."""
    forwards, row_forwards = replay_rows(model, [row for row in rows if row.replay])
    encoding = [row for row in rows if row.pending is not None]
    for group in encode_groups(encoding):
        encode_rows(model, [encoding[r] for r in group])
        forwards, row_forwards = forwards + 1, row_forwards + len(group)
    # A canvas shorter than STACKABLE_TOKENS (no real checkpoint's: 256) denoises each row alone.
    steps = [rows] if model.config.canvas_length >= STACKABLE_TOKENS else [[row] for row in rows]
    settled = [row for group in steps for row in denoise_rows(model, group, chunk)]
    if settled:
        commit_rows(settled, eos, pad_id, model.config.canvas_length)
    return forwards + len(steps), row_forwards + len(rows)


def eos_tensor(eos_ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The EOS ids as an int64 tensor on ``device`` (what the commits test the canvases against)."""
    return torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)


# ---- the family's decoder (service.engine.protocol.FamilyDecoder) ---------------------------------------------------

CAPABILITIES = Capabilities(likelihood=False, layer_split=False, preemption=True, plan_bounded=False,
                            cache_kind="committed", mask_kind="renoising", served=True,
                            prefix_cache="its encoder's K/V of a prompt's leading tokens are not the same bit for "
                            "bit when those tokens are encoded in a pass of their own (its attention and experts "
                            "round by the pass's length), so a request reading them from a cache would not decode "
                            "as with the cache off (docs/diffusion_gemma.md, 'Prefix cache')",
                            unconstrained="each denoising step redraws every position it does not accept, so a "
                            "constrained position would be redrawn unconstrained")

_NOT_RENOISING = "a setting of the masked families: DiffusionGemma renoises"

#: How DiffusionGemma serves each `DecodeSettings` field (`settings_for` maps them to `RenoiseParams`).
SETTINGS: dict[str, SettingRule] = {
    "cache_mode": only(("prefix", "dual", "block"), "its decoder always reads the committed canvases' cache (no "
                       "recompute mode)", "the committed canvases' cache (prefix, dual and block name it)"),
    # Honoured as "the canvas": its legal value is the checkpoint's canvas_length, which a static rule cannot
    # state; a client's other value is refused by the API (`service.api.planning`), the server's at start
    # (`RenoisingRule.check_defaults`), and the decode window is max_tokens rounded up to whole canvases.
    "block_length": honoured("the checkpoint's canvas (canvas_length) only: max_tokens is decoded in "
                             "ceil(max_tokens / canvas_length) canvases, cut at max_tokens"),
    "threshold": only((0.9, None), f"{_NOT_RENOISING}: acceptance is entropy-bounded, send entropy_bound",
                      "not read (the default 0.9 only): acceptance is entropy_bound's"),
    "steps": only((None,), f"{_NOT_RENOISING}: send max_denoising_steps (decoder passes per canvas)"),
    "remasking": only(("low_confidence",), "there is no mask: non-accepted positions are redrawn uniformly"),
    "ignore_eos": only((False,), "the reference ends the text after the canvas holding its EOS"),
    "dream_schedule": only(("origin",), "dream_schedule is a Dream setting"),
    **refused_all(EDITING_FIELDS, "a LLaDA2.1 setting: this family does not edit tokens"),
    **{name: honoured(f"the reference's {name} (unset: the checkpoint's generation_config.json, else "
                      f"{DEFAULTS[name]})") for name in RENOISING_FIELDS},
}


class NoStore:
    """The K/V store slot of a renoising cohort: its committed K/V live in its rows' caches (no report)."""

    def clear(self) -> None:
        """Nothing held outside the rows."""

    def report(self) -> None:
        """No quantized store: no KV report."""


class RenoisingCohort:
    """One request's rows (its ``n`` choices), each decoding as alone (per-row generators seeded by the row's
    seed; a row without one draws a fresh seed).

    Args:
        model: the loaded model. prompts: token ids per row. settings: one :class:`RenoiseParams` per row.
        rows: per-row options (seed; stop strings and ``max_tokens`` for the report). eos_ids: where the report
        cuts each text (the batch's, which end the decode). params: the request's settings (the report's).
        on_block: ``on_block(canvas, ids_per_row)`` once every live row committed one more canvas (each row's
        committed ids so far). cancelled: per-row flags, polled after each iteration. store: the request's store
        (a quantized one holds the rows' committed K/V packed, `new_caches`, and gives the report's ``kv``).
    """

    def __init__(self, model: DiffusionGemmaModel, prompts: list[list[int]], settings: list[RenoiseParams],
                 rows: list[RowOptions], eos_ids: tuple[int, ...], params: DecodeParams,
                 on_block: OnBlock | None = None, cancelled: Cancelled | None = None, store: Any = None) -> None:
        device = model.embed.weight.device
        caches = new_caches(model, len(prompts), store)
        self.rows = [RenoisingRow(model, prompt, s, _generator(o.seed, device), cache)
                     for prompt, s, o, cache in zip(prompts, settings, rows, caches, strict=True)]
        self.row_options, self.eos_ids, self.params = rows, tuple(eos_ids), params
        self.on_block, self.cancelled = on_block, cancelled
        self.store = store if store is not None else NoStore()
        self.status = ["running"] * len(self.rows)
        self.width = model.config.canvas_length
        self.started_s = time.perf_counter()
        self.finished_s: float | None = None
        self.first_block_s = 0.0
        self._emitted = 0

    def live(self) -> list[RenoisingRow]:
        """The rows still decoding (not done, not cancelled)."""
        return [row for row, status in zip(self.rows, self.status, strict=True)
                if status == "running" and not row.done]

    @property
    def done(self) -> bool:
        """No row decodes any more."""
        return not self.live()

    def poll_cancelled(self) -> None:
        """Rows whose flag is set stop now (status ``cancelled``)."""
        flags = self.cancelled() if self.cancelled is not None else []
        for i, flag in enumerate(flags):
            if flag and self.status[i] == "running" and not self.rows[i].done:
                self.status[i] = "cancelled"

    def emit_blocks(self) -> None:
        """Call ``on_block`` for each canvas every row not cancelled has now committed (streaming per canvas)."""
        kept = [row for row, status in zip(self.rows, self.status, strict=True) if status != "cancelled"]
        counts = [len(row.result.steps_per_canvas) for row in kept]
        going = [n for row, n in zip(kept, counts, strict=True) if not row.done]
        count = min(going) if going else max(counts, default=0)
        if count > self._emitted and self._emitted == 0:
            self.first_block_s = time.perf_counter() - self.started_s
        if self.on_block is not None:
            for canvas in range(self._emitted, count):
                end = (canvas + 1) * self.width
                self.on_block(canvas, [CommittedIds(row.result.generated_ids[:end]) for row in self.rows])
        self._emitted = max(self._emitted, count)
        if self.done and self.finished_s is None:
            self.finished_s = time.perf_counter()

    def release(self) -> None:
        """Free the rows' committed K/V (the cohort left the batch)."""
        for row in self.rows:
            row.cache = CanvasCache(row.cache.config, 1)

    def report(self, decode_text: Callable[[list[int]], str | None]) -> DecodeReport:
        """The :class:`DecodeReport` of this cohort: each row's committed ids cut by
        `service.engine.response.cut_response` (``max_tokens``, the first EOS, stop strings)."""
        total = (self.finished_s or time.perf_counter()) - self.started_s
        reports = []
        for row, status, options in zip(self.rows, self.status, self.row_options, strict=True):
            cut = cut_response(row.result.generated_ids, self.eos_ids, False, options.max_tokens, options.stop,
                               decode_text)
            reports.append(RowReport(
                generated_ids=cut.ids, text=cut.text,
                finish_reason="cancelled" if status == "cancelled" else cut.finish_reason,
                nfe=row.result.nfe, steps_per_block=list(row.result.steps_per_canvas), reveals_per_step=[],
                tokens_per_second=len(cut.ids) / total if total > 0 else 0.0))
        return DecodeReport(rows=reports, params=self.params,
                            timings=Timings(total_s=total, first_block_s=self.first_block_s), kv=self.store.report())


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A row's generator: seeded by its request's seed, else a fresh random seed."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@dataclass
class RenoisingPass:
    """A cohort's next iteration as the plan reads it (`service.engine.protocol.PlannedPass`): ``full`` when one of
    its rows encodes (its prompt or a committed canvas) this iteration, else ``window`` (a denoising step over the
    canvas next to the committed K/V). ``seq_len``: keys its longest row attends over; width: the canvas."""

    cohort: RenoisingCohort
    rows: list[int]
    kind: Literal["full", "window"]
    seq_len: int
    canvas: int
    layers: tuple[int, int] | None = None
    hidden: Any = None

    @property
    def width(self) -> int:
        return self.canvas


class RenoisingBatch:
    """The family's running batch (`service.engine.protocol.DecodeBatch`): requests join and leave between
    iterations; each iteration is one encoder pass and one decoder pass over the rows of every cohort the plan
    names (section doc). A cohort is preempted at a canvas boundary (:meth:`preempt`: its K/V go, the runs its
    encoder passes wrote stay and are re-encoded pass for pass when it resumes). A cohort whose host step raises
    (its ``on_block``) fails alone; a forward that raises fails the iteration (the worker fails its requests).

    Args:
        model: the loaded model. eos_ids, pad_id: what ends a text and what follows its EOS in the canvas holding
        it (the model's: every cohort of the batch has them). plan: groups :meth:`step`'s passes (None: one
        forward); the batch makes its own forwards whatever the groups (``plan_bounded`` False). chunk: positions
        per piece of the sampler.
    """

    def __init__(self, model: DiffusionGemmaModel, eos_ids: tuple[int, ...], pad_id: int | None,
                 plan: Plan | None = None, chunk: int = 64) -> None:
        self.model, self.eos_ids, self.pad_id, self.plan, self.chunk = model, tuple(eos_ids), pad_id, plan, chunk
        self._eos: torch.Tensor | None = None
        self.failed: list[tuple[RenoisingCohort, BaseException]] = []
        self.forwards = 0
        self.rows = 0
        self.cohorts: list[RenoisingCohort] = []
        self._live: list[RenoisingCohort] = []

    def passes(self, cohorts: Sequence[RenoisingCohort]) -> list[RenoisingPass]:
        """One pass per cohort that still decodes; a done one finishes (:meth:`run` returns it)."""
        self.failed, self.forwards, self.rows = [], 0, 0
        self._live = list(cohorts)
        width = self.model.config.canvas_length
        out = []
        for cohort in cohorts:
            live = [i for i, row in enumerate(cohort.rows) if row in cohort.live()]
            if not live:
                continue
            rows = [cohort.rows[i] for i in live]
            encodes = any(row.pending is not None for row in rows)
            seq_len = max(row.cache.length[0] + sum(map(len, row.replay))
                          + (len(row.pending) if row.pending is not None else 0) + width for row in rows)
            out.append(RenoisingPass(cohort, live, "full" if encodes else "window", seq_len, width))
        return out

    def step(self) -> list[RenoisingCohort]:
        """One iteration of :attr:`cohorts` (callers without a running set of their own)."""
        passes = self.passes(self.cohorts)
        return self.run(self.plan(passes) if self.plan is not None else [passes] if passes else [])

    def run(self, forwards: list[list[RenoisingPass]]) -> list[RenoisingCohort]:
        """The iteration :meth:`passes` started, for the cohorts the plan named (a pass left out waits); returns
        the cohorts that finished (they have left)."""
        named = [p.cohort for group in forwards for p in group]
        rows = [row for cohort in named for row in cohort.live()]
        if rows:
            if self._eos is None:
                self._eos = eos_tensor(self.eos_ids, self.model.embed.weight.device)
            forwards_run, row_forwards = iterate(self.model, rows, self._eos, self.pad_id, self.chunk)
            self.forwards += forwards_run
            self.rows += row_forwards
        finished = after_iteration(self._live, self.failed, self.leave)
        self._live = []
        return finished

    def join(self, cohort: RenoisingCohort) -> None:
        """Add ``cohort`` to :attr:`cohorts` (for :meth:`step`)."""
        self.cohorts.append(cohort)

    def leave(self, cohort: RenoisingCohort) -> None:
        """Let ``cohort`` go now: its rows' committed K/V are freed."""
        if cohort in self.cohorts:
            self.cohorts.remove(cohort)
        cohort.release()

    def preemptible(self, cohort: RenoisingCohort) -> bool:
        """Whether :meth:`preempt` may take ``cohort`` out now: every live row is at a canvas boundary (its next
        pass encodes: its prompt, or the canvas it just committed; no canvas, self-conditioning input or
        stopping history in flight, and its generator has drawn nothing of the next canvas), and no row's
        committed K/V are held packed by a quantized store (its accounting counts each write: a replay would
        count them twice)."""
        live = cohort.live()
        return bool(live) and all(row.pending is not None and row.canvas is None and row.cache.packed is None
                                  for row in live)

    def preempt(self, cohort: RenoisingCohort) -> dict[int, list[torch.Tensor]]:
        """Take ``cohort`` out between iterations and let its rows' committed K/V go; returns, per live row, the
        runs its encoder passes had written (what :meth:`resume` gives back to re-encode). Everything else (its
        committed ids, counts, generator, place in its canvases, streamed canvases) stays on it.

        Raises:
            ValueError: not :meth:`preemptible`.
        """
        if not self.preemptible(cohort):
            raise ValueError("a renoising cohort is preempted only at a canvas boundary (every live row's next "
                             "pass encodes) and with its committed K/V unquantized")
        if cohort in self.cohorts:
            self.cohorts.remove(cohort)
        runs = {}
        for i, row in enumerate(cohort.rows):
            if row in cohort.live():
                runs[i] = row.encoded + row.replay  # (preempted again before its replay ran: the same runs)
            row.encoded, row.replay = [], []
        cohort.release()
        return runs

    def resume(self, cohort: RenoisingCohort, call: dict[int, list[torch.Tensor]]) -> None:
        """Give a preempted cohort back the runs :meth:`preempt` returned: its next iteration re-encodes them, one
        pass per run (`replay_rows`), before the pass it was about to make."""
        for i, runs in call.items():
            cohort.rows[i].replay = list(runs)


class RenoisingDecoder:
    """The `service.engine.protocol.FamilyDecoder` of DiffusionGemma.

    Args: model, spec: the loaded model and its spec (its checkpoint directory's ``generation_config.json`` gives
    the renoising defaults; the text ends at any of ``spec.eos_ids``, pad ``spec.pad_id`` after it).
    """

    capabilities = CAPABILITIES
    settings = SETTINGS

    def __init__(self, model: DiffusionGemmaModel, spec) -> None:
        self.model, self.spec, self.family = model, spec, spec.arch
        #: Not read: no CUDA graphs and no prefix cache across requests for this family yet.
        self.later_steps = None
        self.prefix_cache = None
        self.directory = checkpoint_directory(spec)

    def batch(self, plan: Plan | None = None) -> RenoisingBatch:
        return RenoisingBatch(self.model, self.spec.eos_ids, self.spec.pad_id, plan)

    def cohort(self, prompts: list[list[int]], params: DecodeParams, rows: list[RowOptions], kv_store: Any,
               on_block: OnBlock | None, cancelled: Cancelled | None) -> RenoisingCohort:
        """One request's rows (validated already).

        Raises:
            EngineInputError: a renoising value the reference refuses (naming the field).
        """
        settings = settings_for(params, self.directory)
        return RenoisingCohort(self.model, prompts, [settings] * len(prompts), rows, self.spec.eos_ids, params,
                               on_block, cancelled, kv_store)

    def report(self, cohort: RenoisingCohort, decode_text: Callable[[list[int]], str | None]) -> DecodeReport:
        return cohort.report(decode_text)

    def cache_cost(self, prompt_len: int, params: DecodeParams, store_bytes: int, quantized: bool) -> CacheCost:
        """A request's rows hold their own caches (`service.engine.models.diffusion_gemma.CanvasCache`): its
        store's bytes, counted by layer kind in `service.runtime.memory.MemoryModel.cost`."""
        return CacheCost(store_bytes)
