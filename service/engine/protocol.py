"""The engine as the runtime sees it, typed: one running-batch protocol that every model family's batch
implements, the family's decoder declaration, and the engine interface the worker and the HTTP layer use
(issue 42; STYLE.md habit 15).

The runtime (`service.runtime.loop.Worker`) drives every family the same way, one iteration at a time:

1. ``batch.passes(cohorts)``: the running set (the caller keeps it, oldest first) names each cohort's next call,
   a :class:`PlannedPass` the plan can read;
2. the plan (`service.runtime.scheduler`: head-of-line rule, layer split, token budget) groups the passes into
   forwards, ``list[list[PlannedPass]]``; a pass it leaves out waits for the next iteration;
3. ``batch.run(forwards)``: runs them, returns the cohorts that finished; ``batch.failed`` the ones that failed
   alone (both have left the batch);
4. between iterations: ``leave`` (cancelled), ``preemptible`` / ``preempt`` / ``resume`` (preemption by
   recompute, `service.runtime.preemption`).

A family's decoder (:class:`FamilyDecoder`) owns its batch, its cohorts and their reports, says how it serves
every decoding setting (:class:`SettingRule`, one per `service.engine.params.DecodeSettings` field) and declares
its :class:`Capabilities`; `service.engine.Engine` and the runtime ask it and name no family.

This module imports no family and no torch code (it sits at the bottom of `service.engine`): a family module
implements it, the runtime reads it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:  # annotations only: importing them here would close a circle through the families
    from service.engine.kv_store import KVStore
    from service.engine.params import DecodeParams, RowOptions
    from service.engine.report import DecodeReport
    from service.engine.spec import ModelSpec

#: A request's decoding state in a batch (`service.engine.decode.Cohort`,
#: `service.engine.block_causal_batch.BlockCausalCohort`): opaque to the runtime, which keys its running map by it
#: and hands it back to the batch and to :meth:`FamilyDecoder.report`.
Cohort = Hashable

#: ``on_block(block_index, ids_per_row)`` after each block every live row of a cohort committed (streaming).
OnBlock = Callable[[int, list[list[int]]], None]
#: Per-row cancellation flags, polled after each iteration.
Cancelled = Callable[[], list[bool]]


class PlannedPass(Protocol):
    """One cohort's next call, as the plan reads it (`service.runtime.scheduler`). Built on the host; reading it
    reads nothing from the device. Implementations are dataclasses: the layer split makes a piece of a pass with
    ``dataclasses.replace(p, layers=(a, b))``.

    Attributes:
        cohort: who asked. rows: its row indices in the call.
        kind: ``full`` (every column of the sequence is input: a block-initial pass, which may be split by layers
            and is a block boundary) or ``window`` (a later step over the active block next to reused K/V).
        seq_len: keys each row attends over (tokens). width: input columns per row (tokens).
        layers: the decoder layers ``(a, b)`` this forward runs (None: all): set by the plan's layer split only.
        hidden: hidden states a previous piece of a split pass left (None when the pass starts at layer 0).
    """

    cohort: Cohort
    rows: Sequence[int]
    kind: Literal["full", "window"]
    seq_len: int
    layers: tuple[int, int] | None
    hidden: Any

    @property
    def width(self) -> int: ...


#: An iteration's plan: its passes grouped into forwards.
Plan = Callable[[list[PlannedPass]], list[list[PlannedPass]]]


class DecodeBatch(Protocol):
    """The running batch of one family (`service.engine.batch.RunningBatch`,
    `service.engine.block_causal_batch.BlockCausalBatch`): the protocol the runtime drives (module doc).

    Attributes:
        failed: ``(cohort, exception)`` of the cohorts that failed alone in the last iteration (they have left).
        forwards: forward calls of the last iteration; rows: row-forwards of the last iteration (rows summed over
            its forwards; ``dllm_row_forwards_total``).
        cohorts: the running set :meth:`join` keeps for a caller without one of its own (:meth:`step`:
            `Engine.generate`, tests, benchmarks); empty in the server, whose worker keeps the running set.
    """

    failed: list[tuple[Cohort, BaseException]]
    forwards: int
    rows: int
    cohorts: list[Cohort]

    def passes(self, cohorts: Sequence[Cohort]) -> list[PlannedPass]:
        """Start an iteration of ``cohorts`` (the caller's running set, oldest first): the next call of each. A
        cohort with no call left finishes (:meth:`run` returns it); one that raises goes into ``failed``."""
        ...

    def run(self, forwards: list[list[PlannedPass]]) -> list[Cohort]:
        """Run the iteration :meth:`passes` started as planned (each group one forward; a pass left out waits).
        Returns the cohorts that finished (they have left). Never raises for one cohort's fault."""
        ...

    def step(self) -> list[Cohort]:
        """One iteration of ``cohorts`` under the batch's own plan (callers without a running set)."""
        ...

    def join(self, cohort: Cohort) -> None:
        """Add ``cohort`` to ``cohorts`` (for :meth:`step`)."""
        ...

    def leave(self, cohort: Cohort) -> None:
        """Let ``cohort`` go now (finished, failed, cancelled): its next call dropped, its K/V freed."""
        ...

    def preemptible(self, cohort: Cohort) -> bool:
        """Whether :meth:`preempt` may take ``cohort`` out now: it is at a block boundary (its next call rebuilds
        whatever K/V it holds, so every token it revealed is final). False always where the family cannot be
        preempted (:attr:`Capabilities.preemption`)."""
        ...

    def preempt(self, cohort: Cohort) -> Any:
        """Take ``cohort`` out between iterations and free its K/V; return what :meth:`resume` needs to resume it
        token for token (its next call). Raises ValueError when not :meth:`preemptible`."""
        ...

    def resume(self, cohort: Cohort, call: Any) -> None:
        """Give a preempted cohort back what :meth:`preempt` returned: the next iteration naming it runs that
        call, as it would have without the preemption."""
        ...


def after_iteration(live: Sequence[Any], failed: list[tuple[Any, BaseException]],
                    leave: Callable[[Any], None]) -> list[Any]:
    """The end of a running batch's iteration, every family's: each cohort of ``live`` (its ``poll_cancelled``,
    ``emit_blocks``, ``done``) polls its cancellations and streams what it committed; one already in ``failed``, or
    whose callback raises (it is added to ``failed``), fails alone; each leaves (``leave``) when it is done or
    failed. Returns the cohorts that finished."""
    finished = []
    for cohort in live:
        if any(cohort is f for f, _ in failed):
            leave(cohort)
            continue
        try:
            cohort.poll_cancelled()
            cohort.emit_blocks()
        except Exception as exc:  # noqa: BLE001 -- a callback of this request failed: it fails alone
            failed.append((cohort, exc))
            leave(cohort)
            continue
        if cohort.done:
            leave(cohort)
            finished.append(cohort)
    return finished


@dataclass(frozen=True)
class Capabilities:
    """What a family's decoder can do, as the runtime and the API ask it (never by the family's name).

    Attributes:
        likelihood: the ELBO likelihood (``logprobs`` with ``echo``, lm-eval's loglikelihood) is served.
        layer_split: a block-initial pass may run its layers over several iterations
            (`service.runtime.scheduler.split_by_layers`).
        preemption: a running request may be preempted by recompute at a block boundary.
        plan_bounded: its forwards are the plan's groups (bounded by ``max_batched_tokens``); False: the batch
            makes its own forwards whatever the plan.
        cache_kind: how its K/V cache lives: ``reuse`` (the bidirectional families: a block-initial pass rewrites
            each layer's reused K/V, later steps read it) or ``committed`` (block-causal: committed blocks' K/V
            are appended once and never change).
        mask_kind: its attention mask (``bidirectional`` or ``block_causal``), as error messages name it.
        served: the server decodes it; False: in this version only ``dllm-kvq generate`` does, and ``serve``
            refuses the checkpoint at start in one line (`service.commands.serve.check_model_settings`).
        prefix_cache: why its decoder reads no cross-request prefix cache (`service.engine.prefix_cache`), or
            empty: its batches read and fill one. ``serve --prefix-cache-bytes`` on such a family warns once with
            this reason and keeps none (`service.main.make_worker`), rather than publish a capacity nothing fills.
        unconstrained: why its decoder cannot constrain a response to a grammar (structured output, tool calls),
            or empty: it can. The API refuses such a request first, naming the field the client sent
            (`service.api.planning`), before it compiles the grammar or sizes the response to it.
    """

    likelihood: bool
    layer_split: bool
    preemption: bool
    plan_bounded: bool
    cache_kind: Literal["reuse", "committed"]
    mask_kind: str = "bidirectional"
    served: bool = True
    prefix_cache: str = ""
    unconstrained: str = ""


@dataclass(frozen=True)
class CacheCost:
    """What one row of a request holds in its family's K/V cache, as admission counts it
    (`service.runtime.scheduler.Cost`; a family's :meth:`FamilyDecoder.cache_cost`).

    Attributes:
        kv: bytes the row holds on its own (its store's: the reused K/V, or packed committed blocks).
        slot_bytes: bytes per column of what the row holds in caches its batch's rows share (0: none), and
        slot_columns: the columns a shared cache holding the row has at least. A shared cache's slots all have
            its longest row's columns, so the rows of a batch hold ``sum(slot_bytes) x max(slot_columns)``
            together (`service.runtime.scheduler.kv_held`).
    """

    kv: int
    slot_bytes: int = 0
    slot_columns: int = 0


@dataclass(frozen=True)
class SettingRule:
    """How a family serves one decoding setting (a `service.engine.params.DecodeSettings` field).

    Attributes:
        how: how the family honours it, in a few words (docs, the settings walk's failure messages).
        serves: the values it serves (None: every legal value); another value is refused with a 400 naming the
            field (:func:`check_settings`), and at ``serve`` start when it is the server's default.
        why: why the other values are refused (the refusal's reason).
    """

    how: str
    serves: tuple[Any, ...] | None = None
    why: str = ""

    def refuses(self, value: Any) -> bool:
        """Whether ``value`` is outside what the family serves."""
        return self.serves is not None and value not in self.serves


def honoured(how: str) -> SettingRule:
    """A setting served at every legal value."""
    return SettingRule(how)


def only(values: tuple[Any, ...], why: str, how: str = "") -> SettingRule:
    """A setting served only at ``values`` (the built-in default among them, so a request that does not name it
    is served); any other value is refused with ``why``."""
    return SettingRule(how or f"only {', '.join(map(repr, values))}", values, why)


def refused_all(names: Sequence[str], why: str) -> dict[str, SettingRule]:
    """Rules for settings another family owns (each unset only): ``{name: only((None,), why)}``."""
    return {name: only((None,), why) for name in names}


class SettingRefused(Exception):
    """Raised by :func:`check_settings`: ``field`` has a value the family does not serve (the engine maps it to
    `service.engine.errors.EngineInputError`, HTTP 400 naming the field; ``serve`` to its start-up refusal)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check_settings(family: str, rules: Mapping[str, SettingRule], values: Mapping[str, Any]) -> None:
    """Refuse a setting the family does not serve.

    Args:
        family: the family's name (the message names it). rules: its :attr:`FamilyDecoder.settings`.
        values: setting name -> value (a request's resolved `DecodeParams`, or the server's defaults).

    Raises:
        SettingRefused: the first field (in ``rules`` order) whose value the family does not serve; a field with
            no rule at all (a setting added to `DecodeSettings` that the family never declared).
    """
    for name, value in values.items():
        rule = rules.get(name)
        if rule is None:
            raise SettingRefused(f"{name} is not declared by the {family} decoder (every decoding setting must be "
                                 "honoured or refused by each family)", name)
        if rule.refuses(value):
            serves = rule.serves or ()
            served = "leave it unset" if serves == (None,) else f"it serves {', '.join(map(_shown, serves))}"
            raise SettingRefused(f"{name} {_shown(value)} is not served by {family} models ({rule.why}); {served}",
                                 name)


def _shown(value: Any) -> str:
    """A setting's value as a JSON client wrote it (``true``, ``null``, ``"block"``): the refusal is read by
    HTTP clients and by ``serve`` users, neither of whom writes Python's ``True`` or ``None``."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


class FamilyDecoder(Protocol):
    """A family's decoding, declared in one object (as `service.quant.plugin.QuantMethod` declares a quantization
    method): its batch, its cohorts, their reports, how it serves each setting and what it can do. Made once per
    loaded model (`service.engine.Engine`).

    Attributes:
        family: the family's name (``llada``, ``dream``, ``llada2`` ...).
        capabilities: :class:`Capabilities`.
        settings: one :class:`SettingRule` per `DecodeSettings` field (tests/engine/test_family_settings.py walks
            every field for every family, so a new field cannot be dropped in silence).
        later_steps: the later steps' forward runner its batches made from now on use (`service.engine.graphs`:
            CUDA graphs per bucket of rows and key length); None, plain eager forwards. A family whose batches have
            no graphed step keeps it and never reads it (LLaDA2 today).
    """

    family: str
    capabilities: Capabilities
    settings: Mapping[str, SettingRule]
    later_steps: Any
    #: The prefix cache across requests its batches read and fill (`service.engine.prefix_cache`; set through
    #: `service.engine.Engine.prefix_cache`); a family whose prompt K/V depend on what follows never reads it.
    prefix_cache: Any

    def batch(self, plan: Plan) -> DecodeBatch:
        """An empty running batch; ``plan`` groups :meth:`DecodeBatch.step`'s passes into forwards."""
        ...

    def cohort(self, prompts: list[list[int]], params: DecodeParams, rows: list[RowOptions],
               kv_store: KVStore | None, on_block: OnBlock | None, cancelled: Cancelled | None) -> Cohort:
        """One request's decoding state (validated already), ready to join a batch."""
        ...

    def report(self, cohort: Cohort, decode_text: Callable[[list[int]], str | None]) -> DecodeReport:
        """The report of a finished (or abandoned) cohort."""
        ...

    def cache_cost(self, prompt_len: int, params: DecodeParams, store_bytes: int, quantized: bool) -> CacheCost:
        """What one row of a request of a ``prompt_len``-token prompt decoded with ``params`` holds in the K/V
        cache at its most (bytes; `service.runtime.memory` measures the rest): ``store_bytes`` is what its K/V
        store holds by the store's own count (``seq_len + 1`` columns at its measured bytes per token),
        ``quantized`` whether that store quantizes (not full precision)."""
        ...


class EngineLike(Protocol):
    """What the worker and the HTTP layer need of `service.engine.Engine` (a fake engine in HTTP-shape tests,
    tests/support/fake_engine.py, has the same)."""

    spec: ModelSpec
    #: The prefix cache across requests (`service.engine.prefix_cache`; `service.main` sets it, the family's decoder
    #: reads it: only a block-causal family uses it).
    prefix_cache: Any

    @property
    def capabilities(self) -> Capabilities:
        """The loaded family's :class:`Capabilities`."""
        ...

    def decode_text(self, ids: list[int]) -> str | None: ...

    def batch(self) -> DecodeBatch:
        """An empty running batch (the worker plans each iteration itself: :meth:`DecodeBatch.passes`, then
        :meth:`DecodeBatch.run`)."""
        ...

    def cohort(
        self,
        prompts: list[list[int]],
        params: DecodeParams,
        rows: list[RowOptions] | None = None,
        kv_store: KVStore | None = None,
        on_block: OnBlock | None = None,
        cancelled: Cancelled | None = None,
        validated: bool = False,
    ) -> Cohort: ...

    def report(self, cohort: Cohort) -> DecodeReport: ...

    def cache_cost(self, prompt_len: int, params: DecodeParams, store_bytes: int, quantized: bool) -> CacheCost:
        """One row's K/V memory as its family counts it (:meth:`FamilyDecoder.cache_cost`)."""
        ...

    # A prompt's per-token likelihood (`service.engine.likelihood.PromptLikelihood`: ``seq_len``,
    # ``next_call(max_rows, max_bytes)``, ``step(layers=...)``, ``scores()``).
    def likelihood(self, ids: list[int], mc_num: int, mc_batch_size: int, seed: int, top_k: int = 0,
                   cancelled: Callable[[], bool] | None = None) -> Any: ...
