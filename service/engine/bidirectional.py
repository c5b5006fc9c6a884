"""The decoder of the bidirectional families (LLaDA, Dream): block diffusion with a reused K/V cache
(`service.engine.decode.Cohort`, `service.engine.batch.RunningBatch`), declared as a
`service.engine.protocol.FamilyDecoder`.

The family's reveal rule (the model class's ``reveal_rule``, `service.engine.reveal`) says which ``remasking``
and ``dream_schedule`` values it decodes; everything else is shared by the bidirectional families.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from service.engine.batch import RunningBatch
from service.engine.decode import Cancelled, Cohort, OnBlock
from service.engine.graphs import LaterSteps
from service.engine.kv_store import FullPrecisionKVStore, KVStore
from service.engine.models import DiffusionLM
from service.engine.params import EDITING_FIELDS, RENOISING_FIELDS, DecodeParams, RowOptions
from service.engine.protocol import CacheCost, Capabilities, Plan, SettingRule, honoured, only, refused_all
from service.engine.report import DecodeReport, RowReport, Timings
from service.engine.response import cut_response
from service.engine.spec import ModelSpec

#: What a bidirectional family can do: every runtime feature (issue 42).
CAPABILITIES = Capabilities(likelihood=True, layer_split=True, preemption=True, plan_bounded=True,
                            cache_kind="reuse", mask_kind="bidirectional",
                            prefix_cache="their prompt's K/V depend on what follows it (docs/prefix-cache.md)")


def bidirectional_settings(model_class: type[DiffusionLM]) -> dict[str, SettingRule]:
    """The bidirectional families' rule for each `DecodeSettings` field; ``remasking`` and ``dream_schedule`` as
    the family's reveal rule declares them (``RevealRule.remasking``, ``RevealRule.dream_schedules``)."""
    rule = model_class.reveal_rule
    modes = tuple(model_class.cache_modes)
    return {
        "cache_mode": only(modes, "block is the append-only cache of block-causal families",
                           "none recomputes; prefix and dual reuse the K/V (Fast-dLLM)"),
        "block_length": honoured("tokens per block of the semi-autoregressive schedule"),
        "threshold": honoured("confidence threshold of parallel decoding (Fast-dLLM Sec. 3.3)"),
        "steps": honoured("fixed schedule: steps / blocks per block"),
        "remasking": only(rule.remasking, f"{model_class.arch} reveals by {' or '.join(rule.remasking)} only"),
        "ignore_eos": honoured("every block decoded; the response is not cut at an EOS"),
        "dream_schedule": only(rule.dream_schedules, "dream_schedule is a Dream setting (its schedule with cache "
                               "mode none)" if rule.dream_schedules == ("origin",) else "Dream's schedules"),
        **refused_all(EDITING_FIELDS, "a LLaDA2.1 setting: this family does not edit tokens"),
        **refused_all(RENOISING_FIELDS, "a DiffusionGemma setting: this family unmasks, it does not renoise"),
    }


class BidirectionalDecoder:
    """The `FamilyDecoder` of a bidirectional family (module doc).

    Args:
        model: the loaded network; spec: its :class:`ModelSpec`.
    """

    capabilities = CAPABILITIES
    #: Never read: a bidirectional family's prompt K/V depend on what follows the prompt, so no prefix of them can be
    #: shared across requests (`service.engine.prefix_cache`).
    prefix_cache = None

    def __init__(self, model: DiffusionLM, spec: ModelSpec) -> None:
        self.model, self.spec, self.family = model, spec, spec.arch
        self.settings = bidirectional_settings(type(model))
        self.later_steps: LaterSteps | None = None

    def batch(self, plan: Plan) -> RunningBatch:
        """An empty `RunningBatch`; ``plan`` groups its passes into forwards; its later steps run through
        :attr:`later_steps` when set (CUDA graphs), else eagerly."""
        if self.later_steps is None:
            return RunningBatch(self.model, self.spec.pad_id, plan)
        return RunningBatch(self.model, self.spec.pad_id, plan, self.later_steps, self.later_steps.pool)

    def cache_cost(self, prompt_len: int, params: DecodeParams, store_bytes: int, quantized: bool) -> CacheCost:
        """A row's K/V live in its own store (`Cohort`): what the store holds, nothing shared."""
        return CacheCost(store_bytes)

    def cohort(self, prompts: list[list[int]], params: DecodeParams, rows: list[RowOptions],
               kv_store: KVStore | None, on_block: OnBlock | None, cancelled: Cancelled | None) -> Cohort:
        """A `Cohort` with its own store (default a :class:`FullPrecisionKVStore`)."""
        store = kv_store if kv_store is not None else FullPrecisionKVStore()
        return Cohort(self.model, self.spec, prompts, params, rows, store, on_block, cancelled)

    def report(self, cohort: Cohort, decode_text: Callable[[list[int]], str | None]) -> DecodeReport:
        """The :class:`DecodeReport` of a finished (or abandoned) cohort; timings run from its first call."""
        end = cohort.finished_s or time.perf_counter()
        total = end - cohort.started_s if cohort.started_s else 0.0
        reports = [self._row_report(cohort, r, opts, total, decode_text) for r, opts in enumerate(cohort.row_options)]
        return DecodeReport(
            rows=reports,
            params=cohort.params,
            timings=Timings(total_s=total, first_block_s=cohort.first_block_s),
            kv=cohort.store.report(),
        )

    def _row_report(self, cohort: Cohort, row: int, options: RowOptions, total_s: float,
                    decode_text: Callable[[list[int]], str | None]) -> RowReport:
        state = cohort.rows[row]
        cut = cut_response(cohort.response_ids(row), self.spec.eos_ids, cohort.params.ignore_eos,
                           options.max_tokens, options.stop, decode_text)
        return RowReport(
            generated_ids=cut.ids,
            text=cut.text,
            finish_reason="cancelled" if state.status == "cancelled" else cut.finish_reason,
            nfe=state.nfe,
            steps_per_block=state.steps_per_block,
            reveals_per_step=state.reveals,
            tokens_per_second=len(cut.ids) / total_s if total_s > 0 else 0.0,
            logprobs=cohort.response_logprobs(row, len(cut.ids)),
        )
