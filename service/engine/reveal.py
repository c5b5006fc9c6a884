"""Reveal rules: how each model family turns a forward call's logits into revealed tokens.

Every model class carries its rule (``DiffusionLM.reveal_rule``, checked when the class is defined), and the decode
loop calls it; it never asks which architecture it runs. A rule says:

* which settings it refuses (:meth:`RevealRule.check`, before any work);
* the per-step reveal counts of a block under a fixed schedule (:meth:`RevealRule.block_plan`);
* what a call reveals at step 0 of a block (the block-initial pass) and at later steps (:meth:`RevealRule.reveal`);
* whether the settings ask for the family's whole-response algorithm instead of the block loop
  (:meth:`RevealRule.uses_canvas`) and, if so, each call's reveal there (:meth:`RevealRule.canvas_reveal`).

Rules of NVlabs/Fast-dLLM commit 24cc59e (golden SPEC 3.1, 3.5, 3.6); the token and confidence functions are in
`service.engine.sampling`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from service.engine.errors import EngineInputError
from service.engine.params import EDITING_FIELDS, DecodeParams, RowOptions
from service.engine.sampling import (
    _ENTROPY_EPS,
    DREAM_EPS,
    _choosable,
    _gumbel_denominator,
    dream_fixed_count,
    dream_threshold_reveals,
    dream_tokens_and_confidence,
    llada_fixed_schedule,
    llada_tokens_and_confidence,
    select_reveals,
)


@dataclass
class Canvas:
    """Per-row state of a whole-response (canvas) schedule: calls made, calls allowed, the base quota per call and
    what earlier calls rejected (reference ``left_tokens_last_step``)."""

    steps: int
    quota: int
    step: int = 0
    carried: int = 0


class RevealRule:
    """The block-wise reveal rule shared by the families; subclasses say where they differ.

    ``reveal`` arguments: ``logits`` ``[N, V]`` of the row's N masked candidates of the active block (ascending
    columns); ``step`` the call's index in the block (0 = block-initial pass); ``plan`` the row's
    :meth:`block_plan` (None under a threshold); ``temperature`` and ``generator`` the row's sampling; ``banned``
    the int64 ids never chosen (`service.engine.sampling`).
    Returns (int64 indices into the candidates ``[n]``, int64 tokens of those indices ``[n]``).
    """

    #: The ``remasking`` values the family decodes (the published schema states them).
    remasking: tuple[str, ...] = ("low_confidence", "random")
    #: The ``dream_schedule`` values the family takes (the published schema states them): Dream's no-cache
    #: schedules are Dream's; another family takes only the default, which asks it for nothing.
    dream_schedules: tuple[str, ...] = ("origin",)
    #: The family decodes LLaDA2.1's token editing (`EDITING_FIELDS`); the others refuse those settings by name.
    edits_tokens: bool = False

    def check(self, params: DecodeParams) -> None:
        """Refuse settings the family cannot decode (EngineInputError with what is legal). Here: a
        ``dream_schedule`` other than the family's (a Dream setting sent to another family was silently ignored),
        and token editing's settings on a family that does not edit (each was silently ignored as well); a family
        that refuses more calls this first."""
        if params.dream_schedule not in self.dream_schedules:
            raise EngineInputError(
                f"dream_schedule {params.dream_schedule!r} is a Dream setting (its schedule with cache mode none) "
                f"and the served model is not Dream; legal here: {', '.join(map(repr, self.dream_schedules))} "
                "(the default), or leave it unset", "dream_schedule")
        given = [name for name in EDITING_FIELDS if getattr(params, name) is not None]
        if given and not self.edits_tokens:
            raise EngineInputError(
                f"{given[0]} is a setting of LLaDA2.1's token editing (block-causal LLaDA2 models), and this "
                "model's family does not edit tokens; leave it unset", given[0])

    def check_request(self, spec: Any, params: DecodeParams, rows: list[RowOptions]) -> None:
        """Refuse what a request asks of the model ``spec`` describes that the family cannot decode, beyond
        :meth:`check` (EngineInputError naming the field): per-row options, settings read against the checkpoint.
        Here: nothing; a family whose sampling is its own (DiffusionGemma's renoising) refuses what it does not
        define."""

    def check_defaults(self, directory: Any, config: Any, values: dict[str, Any], given: Any) -> None:
        """Refuse the server's default decoding settings read against the checkpoint, at ``serve`` start (a
        request naming none of them would be refused for a field its client never sent).

        Args:
            directory: the checkpoint's directory (`pathlib.Path`). config: its parsed ``config.json`` (the
                family's config class). values: the server's decoding settings (`DecodeSettings` fields).
            given: the names among them the operator set (flag or environment), the others being built-in.

        Raises:
            EngineInputError: naming the field. Here: nothing (a static rule, `protocol.SettingRule`, says it all
                for the masked families).
        """

    def block_plan(self, masked: int, params: DecodeParams) -> list[int] | None:
        """Reveal counts of each step of a block with ``masked`` masks, or None when counts are not fixed."""
        return None

    def uses_canvas(self, params: DecodeParams) -> bool:
        """True when the settings ask for the family's whole-response algorithm (no blocks)."""
        return False

    def reveal(
        self, step: int, logits: torch.Tensor, params: DecodeParams, plan: list[int] | None, temperature: float,
        generator: torch.Generator | None, banned: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def row_plan(self, step: int, masked: int, params: DecodeParams, plan: list[int] | None,
                 canvas: Canvas | None) -> tuple[int | None, float | None, bool]:
        """How many of a row's candidates the batched reveal may take at this call (host only): ``(count,
        fraction, first_only)`` of :class:`RevealBatch`; ``masked`` is the row's masked columns in its window
        before the call. This default: the fixed plan's count at ``step``, else every candidate."""
        return (plan[step] if plan is not None else None), None, False

    def choose_batch(self, logits: torch.Tensor, batch: RevealBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and confidences of every column of every row of ``batch``: int64 ``[R, W]`` and ``[R, W]``
        (the family's dtype); ``logits`` ``[R, W, V]`` after the batch's ``allowed``."""
        raise NotImplementedError

    def start_canvas(self, params: DecodeParams) -> Canvas:
        raise NotImplementedError(f"{type(self).__name__} has no whole-response schedule")

    def canvas_reveal(
        self, canvas: Canvas, logits: torch.Tensor, params: DecodeParams, temperature: float,
        generator: torch.Generator | None, banned: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} has no whole-response schedule")


_FRACTIONS: dict[tuple[int, int], float | None] = {}


def _dream_fraction(step: int, steps: int) -> float | None:
    """Dream's fixed-schedule share ``1 - ts[step + 1] / ts[step]`` (float32, `dream_fixed_count`) as a float,
    or None at the last step (every candidate); made once per (step, steps)."""
    if step >= steps - 1:
        return None
    if (step, steps) not in _FRACTIONS:
        ts = torch.linspace(1, DREAM_EPS, steps + 1)
        _FRACTIONS[(step, steps)] = float(1 - ts[step + 1] / ts[step])
    return _FRACTIONS[(step, steps)]


def steps_per_block(params: DecodeParams) -> int:
    """Forward calls per block of a fixed schedule (``steps`` is the total over all blocks)."""
    return params.steps // (params.gen_length // params.block_length)


class LLaDARule(RevealRule):
    """LLaDA (`llada/generate.py`): every call, the block-initial pass included, reveals by the same rule: the
    fixed schedule's count (even split, remainder first) or the threshold rule among the block's masks; tokens and
    confidences in float64; ``random`` remasking draws confidences from the row's generator."""

    def block_plan(self, masked: int, params: DecodeParams) -> list[int] | None:
        if params.threshold is not None:
            return None
        return llada_fixed_schedule(masked, steps_per_block(params))

    def choose_batch(self, logits, batch):
        """``llada_tokens_and_confidence`` over every row: greedy rows take the argmax of the logits; a sampling
        row draws its Gumbel noise ``[width, V]`` from its own generator; confidences are the float64 softmax
        probability of the token, or (``random`` remasking) ``[width]`` uniform draws after the noise."""
        tokens = _choosable(logits, batch.banned).argmax(dim=-1)
        for r, temperature in enumerate(batch.temperature):
            if temperature > 0:
                w = batch.width[r]
                row = logits[r, :w].to(torch.float64).exp() / _gumbel_denominator(
                    (w, logits.shape[-1]), temperature, batch.generator[r], logits.device)
                tokens[r, :w] = _choosable(row, batch.banned).argmax(dim=-1)
        confidence = torch.softmax(logits.to(torch.float64), dim=-1).gather(-1, tokens[..., None])[..., 0]
        for r, random in enumerate(batch.random_remasking):
            if random:  # drawn after the row's noise, from the same generator
                w = batch.width[r]
                confidence[r, :w] = torch.rand(w, dtype=torch.float64, generator=batch.generator[r],
                                               device=logits.device)
        return tokens, confidence

    def reveal(self, step, logits, params, plan, temperature, generator, banned=None):
        tokens, confidence = llada_tokens_and_confidence(logits, temperature, params.remasking, generator, banned)
        count = plan[step] if plan is not None else logits.shape[0]
        chosen = select_reveals(confidence, min(count, logits.shape[0]), params.threshold)
        return chosen, tokens[chosen]


class DreamRule(RevealRule):
    """Dream (`dream/model/generation_utils*.py`): the block-initial pass reveals exactly the block's first column
    (SPEC 3.6 step 1); later calls reveal by threshold (max-probability confidence) or by the fixed schedule's
    timestep truncation (negative-entropy confidence), in the logits dtype. With cache mode ``none`` and
    ``dream_schedule="origin"`` it runs its own whole-response algorithm (SPEC 3.5)."""

    remasking = ("low_confidence",)
    dream_schedules = ("origin", "block")

    def check(self, params: DecodeParams) -> None:
        super().check(params)
        if params.remasking not in self.remasking:
            raise EngineInputError("remasking 'random' is LLaDA's; Dream supports only 'low_confidence'", "remasking")
        num_blocks = params.gen_length // params.block_length
        if not self.uses_canvas(params) and params.steps is not None and params.steps // num_blocks < 2:
            raise EngineInputError(
                f"Dream's fixed schedule in block mode needs at least 2 steps per block (the block-initial pass "
                f"reveals only the block's first token); got {params.steps // num_blocks}: use steps >= "
                f"{2 * num_blocks}", "steps"
            )

    def uses_canvas(self, params: DecodeParams) -> bool:
        return params.cache_mode == "none" and params.dream_schedule == "origin"

    def row_plan(self, step, masked, params, plan, canvas):
        if canvas is not None:
            if params.threshold is not None:
                return canvas.quota + canvas.carried, None, False
            return None, _dream_fraction(canvas.step, canvas.steps), False
        if step == 0:
            return None, None, True
        if params.threshold is None:
            return None, _dream_fraction(step, steps_per_block(params)), False
        return None, None, False

    def choose_batch(self, logits, batch):
        """``dream_tokens_and_confidence`` over every row, in the logits dtype: a sampling row's logits divided
        by its temperature and its Gumbel noise ``[width, V]`` drawn from its own generator; confidence is the
        token's probability, or the negative entropy for rows of a fixed schedule."""
        scaled = logits
        if any(t > 0 for t in batch.temperature):
            scaled = logits.clone()
            for r, temperature in enumerate(batch.temperature):
                if temperature > 0:
                    scaled[r] = logits[r] / temperature
        probs = torch.softmax(scaled, dim=-1)
        tokens = _choosable(probs, batch.banned).argmax(dim=-1)
        for r, temperature in enumerate(batch.temperature):
            if temperature > 0:
                w = batch.width[r]
                gumbel = -torch.log(_gumbel_denominator((w, logits.shape[-1]), 1.0, batch.generator[r],
                                                        logits.device))
                noisy = torch.log_softmax(scaled[r, :w].to(torch.float64), dim=-1) + gumbel
                tokens[r, :w] = _choosable(noisy, batch.banned).argmax(dim=-1)
        confidence = probs.gather(-1, tokens[..., None])[..., 0]
        if any(batch.neg_entropy):
            entropy = (probs * torch.log(probs + _ENTROPY_EPS)).sum(dim=-1)
            rows = torch.tensor(batch.neg_entropy, dtype=torch.bool, device=logits.device)
            confidence = torch.where(rows[:, None], entropy, confidence)
        return tokens, confidence

    def reveal(self, step, logits, params, plan, temperature, generator, banned=None):
        if step == 0:
            tokens, _ = dream_tokens_and_confidence(logits[:1], temperature, generator, False, banned)
            return torch.zeros(1, dtype=torch.long, device=tokens.device), tokens
        fixed = params.threshold is None  # fixed schedule: negative-entropy confidence (SPEC 3.6)
        tokens, confidence = dream_tokens_and_confidence(logits, temperature, generator, fixed, banned)
        count = logits.shape[0]
        if fixed:
            count = dream_fixed_count(count, step, steps_per_block(params))
        chosen = select_reveals(confidence, count, params.threshold)
        return chosen, tokens[chosen]

    def start_canvas(self, params: DecodeParams) -> Canvas:
        """Threshold: ``gen_length / block_length`` calls (the reference eval scripts' choice), a quota of
        ``block_length`` per call; fixed schedule: ``steps`` calls."""
        total = params.gen_length // params.block_length if params.threshold is not None else params.steps
        return Canvas(steps=total, quota=params.gen_length // total)

    def canvas_reveal(self, canvas, logits, params, temperature, generator, banned=None):
        """One call over every mask of the response; advances ``canvas`` (a rejection at the last call extends
        the loop by one call with a zero base quota, as the reference does)."""
        if params.threshold is not None:
            tokens, confidence = dream_tokens_and_confidence(logits, temperature, generator, False, banned)
            chosen, rejected = dream_threshold_reveals(confidence, canvas.quota + canvas.carried, params.threshold)
            canvas.carried = rejected
            if rejected and canvas.step == canvas.steps - 1:
                canvas.quota, canvas.steps = 0, canvas.steps + 1
        else:
            tokens, confidence = dream_tokens_and_confidence(logits, temperature, generator, True, banned)
            count = dream_fixed_count(logits.shape[0], canvas.step, canvas.steps)
            chosen = select_reveals(confidence, count, None)
        canvas.step += 1
        return chosen, tokens[chosen]


# ---- the batched reveal: every row of an iteration's forward in one call ------------------------------------------


@dataclass
class RevealBatch:
    """The rows of one forward, for :meth:`RevealRule.reveal_batch` (R rows, W columns, V vocabulary).

    Tensors (on the logits' device):
        logits: ``[R, W, V]`` model dtype, position-aligned logits of each row's window: the active block's
            columns (block mode) or the response's (whole-response schedule), right-padded to W.
        tokens: int64 ``[R, W]``, the tokens at those columns now (the mask id where still masked; padding
            columns hold anything).
        eos: int64 ids that end a response; banned: int64 ids never chosen (`service.engine.sampling`), or None.
        allowed: optional per-row constraint, bool ``[R, W, V]`` or ``[R, 1, V]`` (True = the token may be
            chosen at that column). It acts as a logits processor: disallowed tokens get ``-inf`` logits before
            the choice, the confidence and the log-probabilities (each column must allow at least one token; a
            row without a constraint allows everything).

    Host lists (one entry per row; no host read of device data is needed to build them):
        width: the row's window columns (<= W); step: the call's index in the block (0 = block-initial pass),
        -1 for a whole-response call; count: the most tokens the row may reveal at this call (LLaDA's fixed
        schedule, Dream's whole-response threshold quota), None for all candidates; fraction: Dream's fixed
        schedule, reveal ``int(n x fraction)`` (float32) of the row's n masked candidates, None otherwise;
        first_only: reveal exactly the first masked column (Dream's block-initial pass); threshold: None for a
        fixed count; temperature, generator: the row's sampling (generator None when greedy and not random
        remasking); random_remasking: LLaDA's ``remasking="random"``; neg_entropy: Dream's fixed-schedule
        confidence; ignore_eos.

    Options:
        columns: None (``logits`` cover every window column), or int64 ``[R, M]``: ``logits`` are ``[R, M, V]``,
            column j of row r being window column ``columns[r, j]``; each row's listed columns come first,
            ascending, and must include every masked column of its window; padded entries are W. A row listed
            with every column of its window decides exactly as with all logits (its sampling draws are as wide
            as its window); a greedy row may list only its masked columns, the only ones a reveal reads (the
            LM head and the vocabulary softmax then run nowhere else). Not with ``allowed`` or ``logprobs``
            (ValueError).
        logprobs: None, or k >= 0: also return each column's chosen token's log-probability and its k most
            likely alternatives (:class:`RevealResult`), from this call's logits (no other forward).
        logprob_logits: None, or ``[R, W, V]``: the logits the log-probabilities are read from when ``logits``
            no longer are the model's (a grammar chain keeps only its chosen token's logit in place,
            `service.engine.batch`), so a constrained row reports the model's distribution, as vLLM's raw
            logprobs do, not 0.0 for its token and ``-inf`` (no JSON number) for every alternative.
    """

    logits: torch.Tensor
    tokens: torch.Tensor
    mask_id: int
    eos: torch.Tensor
    banned: torch.Tensor | None
    width: list[int]
    step: list[int]
    count: list[int | None]
    fraction: list[float | None]
    first_only: list[bool]
    threshold: list[float | None]
    temperature: list[float]
    generator: list[torch.Generator | None]
    random_remasking: list[bool]
    neg_entropy: list[bool]
    ignore_eos: list[bool]
    allowed: torch.Tensor | None = None
    logprobs: int | None = None
    logprob_logits: torch.Tensor | None = None
    columns: torch.Tensor | None = None


@dataclass
class RevealResult:
    """What :meth:`RevealRule.reveal_batch` decided, per row (tensors on the logits' device).

    Attributes:
        tokens: int64 ``[R, W]``, the window after the call (revealed columns hold their tokens).
        revealed: bool ``[R, W]``, the columns this call revealed.
        counts: int64 ``[R]``, tokens revealed; masks_left: int64 ``[R]``, masked columns left in the window.
        stop: bool ``[R]``, the row's response now has an EOS with every position before it revealed (never with
            ``ignore_eos``).
        token_logprobs: float32 ``[R, W]``, log-probability of the chosen token at each column (only with
            ``logprobs``; meaningful where ``revealed``); top_ids int64 / top_logprobs float32 ``[R, W, k]``, the
            k most likely tokens and their log-probabilities (only with ``logprobs`` = k > 0).
    """

    tokens: torch.Tensor
    revealed: torch.Tensor
    counts: torch.Tensor
    masks_left: torch.Tensor
    stop: torch.Tensor
    token_logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def _rows_tensor(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _choose_at(rule: RevealRule, logits: torch.Tensor, batch: RevealBatch, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`RevealRule.choose_batch` on the listed columns only (``batch.columns``), placed back at their window
    columns: int64 tokens and confidences ``[R, w]`` (columns not listed: token 0, confidence ``-inf``; no
    reveal reads them). Each column's token and confidence depend on its own logits only, so the listed ones are
    those of the whole window."""
    if batch.allowed is not None or batch.logprobs is not None:
        raise ValueError("RevealBatch.columns cannot be combined with allowed or logprobs")
    # A sampling row lists its whole window, so its draws (``width`` wide) are those of the full logits.
    chosen_c, confidence_c = rule.choose_batch(logits, batch)
    r = logits.shape[0]
    chosen = chosen_c.new_zeros(r, w + 1).scatter_(1, batch.columns, chosen_c)
    confidence = confidence_c.new_full((r, w + 1), float("-inf")).scatter_(1, batch.columns, confidence_c)
    return chosen[:, :w], confidence[:, :w]


def reveal_batch(rule: RevealRule, batch: RevealBatch) -> RevealResult:
    """One call's reveals for every row of a forward, as tensor operations over all rows (no host read).

    The family's rule gives tokens and confidences (:meth:`RevealRule.choose_batch`); then, per row, of its n
    masked candidates the ``k`` most confident are considered (k = n, or ``count``, or ``int(n x fraction)``),
    the first always revealed and each other one iff its confidence is not below the threshold (every one of
    them under a fixed count), or exactly the first candidate (``first_only``). Each row decides exactly as
    the per-row rule does alone (`service.engine.sampling.select_reveals`): its columns, its settings, its
    generator; nothing of another row enters.
    """
    logits, tokens = batch.logits, batch.tokens
    if batch.allowed is not None:
        logits = logits.masked_fill(~batch.allowed, float("-inf"))
    device = tokens.device
    w = tokens.shape[1]
    cols = torch.arange(w, device=device)
    valid = cols[None, :] < _rows_tensor(batch.width, torch.long, device)[:, None]
    masked = tokens == batch.mask_id
    candidates = masked & valid
    if batch.columns is None:
        chosen, confidence = rule.choose_batch(logits, batch)
    else:
        chosen, confidence = _choose_at(rule, logits, batch, w)
    n = candidates.sum(-1)
    count = _rows_tensor([-1 if c is None else c for c in batch.count], torch.long, device)
    k = torch.where(count >= 0, torch.minimum(count, n), n)
    if any(f is not None for f in batch.fraction):
        fraction = _rows_tensor([-1.0 if f is None else f for f in batch.fraction], torch.float32, device)
        k = torch.where(fraction >= 0, (n.to(torch.float32) * fraction).to(torch.long), k)
    confidence = confidence.masked_fill(~candidates, float("-inf"))
    threshold = _rows_tensor([float("-inf") if t is None else t for t in batch.threshold], confidence.dtype, device)
    ordered, order = confidence.topk(w, dim=-1)
    keep = (cols[None, :] < k[:, None]) & ((cols[None, :] == 0) | ~(ordered < threshold[:, None]))
    revealed = torch.zeros_like(candidates).scatter(1, order, keep) & candidates
    if any(batch.first_only):
        first = candidates & (candidates.cumsum(-1) == 1)
        revealed = torch.where(_rows_tensor(batch.first_only, torch.bool, device)[:, None], first, revealed)
    new = torch.where(revealed, chosen, tokens)
    still = (new == batch.mask_id) & valid
    is_eos = torch.isin(new, batch.eos) & valid
    first_eos = torch.where(is_eos.any(-1), is_eos.to(torch.int8).argmax(-1), w)
    stop = (is_eos.any(-1) & ~(still & (cols[None, :] < first_eos[:, None])).any(-1)
            & ~_rows_tensor(batch.ignore_eos, torch.bool, device))
    result = RevealResult(new, revealed, revealed.sum(-1), still.sum(-1), stop)
    if batch.logprobs is not None:
        source = logits
        if batch.logprob_logits is not None:
            source = batch.logprob_logits
            if batch.allowed is not None:
                source = source.masked_fill(~batch.allowed, float("-inf"))
        logp = torch.log_softmax(source.to(torch.float32), dim=-1)
        result.token_logprobs = logp.gather(-1, chosen[..., None])[..., 0]
        if batch.logprobs > 0:
            result.top_logprobs, result.top_ids = logp.topk(batch.logprobs, dim=-1)
    return result
