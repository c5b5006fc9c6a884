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

import torch

from service.engine.errors import EngineInputError
from service.engine.params import DecodeParams
from service.engine.sampling import (
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

    def check(self, params: DecodeParams) -> None:
        """Refuse settings the family cannot decode (EngineInputError with what is legal)."""

    def block_plan(self, masked: int, params: DecodeParams) -> list[int] | None:
        """Reveal counts of each step of a block with ``masked`` masks, or None when counts are not fixed."""
        return None

    def uses_canvas(self, params: DecodeParams) -> bool:
        """True when the settings ask for the family's whole-response algorithm (no blocks)."""
        return False

    def constrained_count(self, step: int, masked: int, params: DecodeParams, plan: list[int] | None) -> int | None:
        """Positions a grammar-constrained row reveals at ``step`` of a block with ``masked`` masks left under a
        fixed schedule (at least 1; forced tokens come on top, `service.engine.grammar`), or None under a
        threshold."""
        if params.threshold is not None:
            return None
        return max(1, plan[step] if plan is not None and step < len(plan) else 1)

    def reveal(
        self, step: int, logits: torch.Tensor, params: DecodeParams, plan: list[int] | None, temperature: float,
        generator: torch.Generator | None, banned: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def start_canvas(self, params: DecodeParams) -> Canvas:
        raise NotImplementedError(f"{type(self).__name__} has no whole-response schedule")

    def canvas_reveal(
        self, canvas: Canvas, logits: torch.Tensor, params: DecodeParams, temperature: float,
        generator: torch.Generator | None, banned: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} has no whole-response schedule")


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

    def check(self, params: DecodeParams) -> None:
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

    def constrained_count(self, step, masked, params, plan):
        if params.threshold is not None:
            return None
        return max(1, dream_fixed_count(masked, step, steps_per_block(params)))

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
