"""The scheduler, as data and pure functions (issue 21): which waiting requests join the running batch, by their
memory (admission by a budget instead of by a count, issue #14), and how an iteration's passes are grouped into
forwards. The loop that applies them is `service.runtime.loop`; what a request costs is measured by
`service.runtime.memory`.

The scheduler admits a request while ``what the running rows and it hold together (:func:`kv_held`) + the largest
forward's transient`` fits the budget (:func:`plan_admission`). Forwards are bounded by a token budget
(``max_batched_tokens``, :func:`plan_forwards`): the activation memory of a forward at that budget is measured
once at start-up (`service.runtime.memory.MemoryModel.measure_forward`) and reserved off the budget; a request
whose own block-initial pass is larger runs it alone and reserves its own transient. Its work
(:func:`work_tokens`) is held against a ceiling at submission by the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

from service.engine.batch import Plan
from service.engine.decode import Pass
from service.engine.forward_cost import LayerStages
from service.engine.params import DecodeParams


@dataclass(frozen=True)
class Cost:
    """Memory of one request: ``kv`` bytes held at its longest on its own, ``transient`` bytes of its largest
    forward; ``slot_bytes`` bytes per column of what its rows hold in caches that the batch's rows share, each
    slot of ``slot_columns`` columns at least (0, 0: none; `service.engine.protocol.CacheCost`, as its family
    counts it: LLaDA2's `service.engine.block_causal_batch.BlockCausalDecoder.cache_cost`)."""

    kv: int
    transient: int
    slot_bytes: int = 0
    slot_columns: int = 0


def kv_held(costs: list[Cost]) -> int:
    """Bytes requests of ``costs`` hold together between forwards: their own ``kv``, and their shared caches'
    slots, every slot as wide as the widest one needs (``sum(slot_bytes) x max(slot_columns)``; a shared cache's
    slots all have its longest row's columns)."""
    return sum(c.kv for c in costs) + sum(c.slot_bytes for c in costs) * max((c.slot_columns for c in costs),
                                                                          default=0)


def fits(running: list[Cost], cost: Cost, budget: int, reserve: int = 0) -> bool:
    """Whether a request of ``cost`` fits beside ``running``: what they hold together (:func:`kv_held`) plus the
    largest of the forward ``reserve`` and the requests' own transients within ``budget`` (bytes).

    The largest, not their sum: an iteration's forwards run one after another and each frees its activations
    before the next (what is held across them, the hidden states between the pieces of a split pass, is counted
    in the request's ``kv``, `service.runtime.loop.Worker._cost`), and every family's forwards are the plan's
    (`Capabilities.plan_bounded`, issue 42): a merged forward holds at most ``max_batched_tokens`` tokens (the
    ``reserve``), a wider pass runs in a forward alone (its own transient). Before issue 42 LLaDA2 ran all its
    rows in one forward, whose transient was the sum of theirs."""
    transient = max([reserve, cost.transient, *(c.transient for c in running)])
    return kv_held([*running, cost]) + transient <= budget


def plan_admission(waiting: list[tuple[Cost, float | None]], running: list[Cost], budget: int, now: float,
                   reserve: int = 0, max_rows: int | None = None, backfill_s: float | None = None,
                   ) -> tuple[list[int], int | None]:
    """Which waiting requests join the running batch now (a pure function of costs and times; the scheduler
    applies it, `service.runtime.loop`).

    Args:
        waiting: per waiting request in queue order, its cost and when it was first blocked at the head of the
            queue (seconds on the clock of ``now``; None if never).
        running: the costs of the running requests; budget, reserve: bytes (see :func:`fits`).
        max_rows: most requests running at once (None: no cap).
        backfill_s: how long a blocked head lets smaller requests that fit pass it (None: never).

    Returns:
        (indices into ``waiting`` of the requests that join, in order; the index of the request blocked at the
        head for memory, or None). First come, first served: each joins while it fits (a request alone always
        does); the first that does not is the head; while it has waited less than ``backfill_s``, later requests
        smaller than it (KV + transient) that fit join too, else nobody passes it.
    """
    chosen: list[int] = []
    held = list(running)
    head, head_size = None, None
    for i, (cost, blocked_at) in enumerate(waiting):
        if max_rows is not None and len(held) >= max_rows:
            break
        size = kv_held([cost]) + cost.transient
        if (not held or fits(held, cost, budget, reserve)) and (head_size is None or size < head_size):
            chosen.append(i)
            held.append(cost)
            continue
        if head is not None:
            continue  # backfill: this one does not fit now, or is no smaller than the head
        head = i
        waited = 0.0 if blocked_at is None else now - blocked_at
        if backfill_s is None or waited >= backfill_s:
            break  # memory is reserved for the head: nobody passes it
        head_size = size
    return chosen, head


def work_tokens(prompt_len: int, params: DecodeParams) -> int:
    """An upper bound on the work of one row, in token-forwards: forward calls x tokens per call.

    Calls: ``steps`` under a fixed schedule; under a threshold at most ``gen_length`` (every call reveals at least
    one token, `service.engine.sampling.select_reveals`; LLaDA2.1's ``min_transfer`` >= 1 likewise), plus a given
    ``max_post_steps`` per block. Tokens per call: at most the whole sequence
    (``prompt_len + gen_length``; cached calls take fewer), and at least :data:`FORWARD_FLOOR_TOKENS` (a call's
    fixed cost). The ceiling it is held against is the setting
    ``max_request_work`` (issue 13: "a request's memory and work are estimated before admission").
    """
    calls = params.steps if params.steps is not None else params.gen_length
    # LLaDA2.1's token editing may run max_post_steps more forwards after each block's last mask (given by the
    # request or the server: a client may ask for many; the family's default, 16, is not counted).
    calls += (params.gen_length // params.block_length) * (params.max_post_steps or 0)
    # DiffusionGemma's renoising: at most max_denoising_steps decoder passes per canvas, and its block is the canvas
    # (`service.api.planning` sets block_length to canvas_length), so the blocks count the canvases; unset (the
    # checkpoint's, 48 by default) the gen_length calls above bound it (a canvas of 256 takes at most 48 passes).
    calls = max(calls, -(-params.gen_length // params.block_length) * (params.max_denoising_steps or 0))
    return calls * max(prompt_len + params.gen_length, FORWARD_FLOOR_TOKENS)


#: The least one forward call is charged in :func:`work_tokens`, in token-forwards: a call over fewer tokens still
#: reads every weight once and pays the loop's per-call overhead (the launch, the reveal, the host sync), so its cost
#: stops falling with its tokens. Without it a short response priced its renoising or editing passes by their few
#: tokens: max_tokens 16 with ``max_denoising_steps`` 1,000,000 was 19 million token-forwards, under the default
#: ceiling, and ran for minutes. 256 is about where a forward turns from weight-bound to compute-bound on a GPU; a
#: response that fills a 4,096-token context is not affected (its calls hold more tokens than this).
FORWARD_FLOOR_TOKENS = 256


#: The default work ceiling of one request (``max_request_work`` empty), in full-context responses: the work of a
#: response that fills the model's context, twice (issue 36).
DEFAULT_WORK_CONTEXTS = 2


def default_max_work(context_tokens: int) -> int:
    """The work ceiling of one request (all its choices) when ``max_request_work`` is empty, in token-forwards:
    ``DEFAULT_WORK_CONTEXTS x context_tokens**2`` (a threshold-decoded response filling the context costs at most
    ``context_tokens`` calls of ``context_tokens`` tokens). At a 4,096-token context: 33,554,432, which admits one
    or two whole-context responses but not n 8 of max_tokens 4,032, and a likelihood of a ~500-token prompt at
    mc_num 128 (or ~1,900 tokens at mc_num 8) but not one of 2,200 tokens at 128."""
    return DEFAULT_WORK_CONTEXTS * context_tokens * context_tokens


# ---- the plan of an iteration's forwards ----------------------------------------------------------------------
#: Input tokens one forward may hold at its padded shape when no budget is set (DLLM_MAX_BATCHED_TOKENS):
#: 32 requests of a 456-token sequence in one block-initial forward, 512 rows of a 32-token window.
DEFAULT_MAX_BATCHED_TOKENS = 16384
#: A forward's padded tokens may exceed its real tokens by at most this fraction (:func:`plan_forwards`).
PADDING_SLACK = 0.25


def forward_tokens(group: list[Pass]) -> int:
    """Input tokens of the forward that holds ``group``, at its padded shape (rows x widest input)."""
    return sum(len(p.rows) for p in group) * max(p.width for p in group)


def split_by_layers(passes: list[Pass], split_tokens: int, num_layers: int) -> list[Pass]:
    """The head-of-line rule's second half (issue 34): a full pass of more than ``split_tokens`` input tokens
    (:func:`forward_tokens`, its rows x its width) runs its layers over several iterations, at most
    ``split_tokens`` tokens' worth of work in each: ``k = min(num_layers, ceil(tokens / split_tokens))`` pieces of
    ``ceil(num_layers / k)`` consecutive layers. This iteration runs the next piece (``Pass.layers``); the running
    batch keeps the hidden states it reaches and makes the rest of the layers the cohort's next call
    (`service.engine.batch.RunningBatch`). A short request that arrives while a long request's block-initial pass
    runs then waits for one piece of it, not for all of it, and every later iteration of the short request pays for
    one piece at most. Each layer runs the same operations on the same inputs as in the whole pass, so no token
    changes (`service.engine.models.transformer.DiffusionLM.forward`, ``layers``). ``split_tokens`` 0: no split.

    Args:
        passes: the iteration's passes; a pass whose ``layers`` is set is the rest of a split pass.
        split_tokens: the most tokens' worth of work of one piece (``DLLM_LAYER_SPLIT_TOKENS``); num_layers: the
            model's decoder layers.

    Returns:
        The passes, a split one replaced by its piece of this iteration (``layers=(a, b)``; its hidden states
        as they were), the others as they were.
    """
    if split_tokens <= 0:
        return passes
    out = []
    for p in passes:
        tokens = len(p.rows) * p.width
        if p.kind != "full" or tokens <= split_tokens:
            out.append(p)
            continue
        pieces = min(num_layers, -(-tokens // split_tokens))
        per_piece = -(-num_layers // pieces)
        start = p.layers[0] if p.layers is not None else 0
        out.append(replace(p, layers=(start, min(start + per_piece, num_layers))))
    return out


def plan_forwards(passes: list[Pass], max_tokens: int, padding_slack: float = PADDING_SLACK, split_tokens: int = 0,
                  num_layers: int = 0) -> list[list[Pass]]:
    """Group one iteration's passes into forwards: window passes, then full passes, each sorted by width and
    packed in order while the forward's padded tokens (:func:`forward_tokens`) stay within ``max_tokens`` and
    within ``1 + padding_slack`` times its real tokens (padded columns are arithmetic thrown away: block-initial
    passes of very different lengths go into different forwards); a pass alone always runs. Window and full
    passes never share a forward (their keys come from different places), so an iteration with both kinds makes
    at least two forwards. With ``split_tokens`` a wide full pass runs one piece of its layers
    (:func:`split_by_layers`); only passes through the same layers share a forward."""
    passes = split_by_layers(passes, split_tokens, num_layers)
    groups: list[list[Pass]] = []
    for kind, layers in sorted({(p.kind, p.layers or (0, 0)) for p in passes}, key=lambda k: (k[0] != "window", k[1])):
        current: list[Pass] = []
        for p in sorted((p for p in passes if p.kind == kind and (p.layers or (0, 0)) == layers),
                        key=lambda p: (p.width, p.seq_len)):
            merged = [*current, p]
            padded = forward_tokens(merged)
            if current and (padded > max_tokens
                            or padded > (1 + padding_slack) * sum(len(q.rows) * q.width for q in merged)):
                groups.append(current)
                current = []
            current.append(p)
        if current:
            groups.append(current)
    return groups


def forward_plan(max_tokens: int = DEFAULT_MAX_BATCHED_TOKENS, padding_slack: float = PADDING_SLACK,
                 split_tokens: int = 0, num_layers: int = 0) -> Plan:
    """:func:`plan_forwards` at a token budget (and a layer split, :func:`split_by_layers`), as the plan of a
    running batch (`service.engine.Engine.batch`).

    Raises:
        ValueError: ``max_tokens`` < 1, ``split_tokens`` < 0, or a split without ``num_layers``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_batched_tokens must be >= 1, got {max_tokens}")
    if split_tokens < 0 or (split_tokens and num_layers < 1):
        raise ValueError(f"layer_split_tokens must be >= 0 with the model's layer count, got {split_tokens}, "
                         f"{num_layers} layers")
    return partial(plan_forwards, max_tokens=max_tokens, padding_slack=padding_slack, split_tokens=split_tokens,
                   num_layers=num_layers)


# ---- head-of-line: a request's first pass runs in an iteration of its own (issue 34) ---------------------------
@dataclass(frozen=True)
class Hold:
    """What :func:`first_passes_first` carries from one iteration to the next: the cohorts whose passes were
    planned before (``seen``) and those it held in the last iteration (``held``)."""

    seen: frozenset = frozenset()
    held: frozenset = frozenset()


def first_passes_first(passes: list[Pass], hold: Hold) -> tuple[list[Pass], Hold]:
    """The head-of-line rule: which of an iteration's passes run now (the rest wait for the next iteration; a pass
    is a pure function of its cohort's state, so waiting changes no token).

    In an iteration where a request makes its first pass (its cohort just joined), the passes of the requests
    already running wait, except those that waited in the last iteration: a request that arrives beside a long
    one pays for its own first pass only, not for the long one's pass of that iteration, and a running request
    waits at most one iteration in a row (a stream of arrivals slows it, never stops it).

    Args:
        passes: the iteration's passes (`service.engine.batch.RunningBatch.passes`).
        hold: the state the previous iteration returned (``Hold()`` at first).

    Returns:
        (the passes that run now, in their order; the state for the next iteration).
    """
    first = {p.cohort for p in passes if p.cohort not in hold.seen}
    held = set()
    if first:
        held = {p.cohort for p in passes if p.cohort not in first and p.cohort not in hold.held}
    present = frozenset(p.cohort for p in passes)  # a cohort that left is forgotten
    return [p for p in passes if p.cohort not in held], Hold(present, frozenset(held))


# ---- likelihood work in the plan (issue 45 items 7-8) -----------------------------------------------------------
@dataclass(frozen=True)
class TaskTurn:
    """A likelihood task's next call as the head-of-line rule sees it (:func:`first_passes_first` reads only
    ``cohort``): its cohort is the task's `service.engine.likelihood.PromptLikelihood`."""

    cohort: object


#: Query columns of a piece smaller than a layer come in stretches of this many (a row's last stretch up to 2x
#: less one): a kernel's arithmetic per row can depend on how many rows it is handed (a matrix product of 1-3 rows
#: on the CPU takes another path), and stretches of 32 or more keep the values those of the whole layer's.
CHUNK_COLUMNS = 32


def likelihood_piece(rows: int, width: int, at: int, split_tokens: int, num_layers: int,
                     stages: LayerStages) -> tuple[int, int] | None:
    """The units ``(at, b)`` (`service.engine.forward_cost.likelihood_work`) the next piece of a likelihood forward
    of ``rows`` rows of ``width`` columns runs, from unit ``at`` on: within ``split_tokens`` tokens' worth of work
    (more only when its smallest piece is); None when the forward is not split (``split_tokens`` 0, or all of it
    within ``split_tokens`` from its start).

    As many whole layers as fit when one does (the layer split of decoding passes, held per piece: the equal
    pieces of :func:`split_by_layers` can reach twice ``split_tokens``); else, where ``stages.sublayer``, a piece
    smaller than a layer (issue 45 item 8: one layer of one 2,200-token row was 13.6x a short request's
    arithmetic on the embedded model). In a bidirectional layer every query needs every column's K/V, so a
    layer's projections come first, whole rows at a time (one at the least), then the rest of its query columns:
    whole rows where one fits, else a stretch of one row in :data:`CHUNK_COLUMNS` (ending at a multiple of it,
    or at the row's end when less than that would be left). A piece never runs past its layer's end. The pieces
    depend only on the forward's size and these bounds, never on what runs beside it."""
    tokens = rows * width
    per_layer = 2 * tokens
    layer_work = tokens * (stages.project + stages.rest)
    if split_tokens <= 0 or (at == 0 and layer_work * num_layers <= split_tokens):
        return None
    layer, offset = divmod(at, per_layer)
    if offset == 0 and (layer_work <= split_tokens or not stages.sublayer):
        whole = max(1, int(split_tokens // layer_work))
        return at, min(layer + whole, num_layers) * per_layer
    end, budget = at, float(split_tokens)
    if offset < tokens:  # the layer's projections, whole rows
        take = min(rows - offset // width, max(1, int(budget // (width * stages.project))))
        end, budget = end + take * width, budget - take * width * stages.project
        if end - layer * per_layer < tokens or budget < CHUNK_COLUMNS * stages.rest:
            return at, end
    row, column = divmod(end - layer * per_layer - tokens, width)
    columns = int(budget // stages.rest)
    if column == 0 and columns >= width:  # whole rows of queries
        return at, end + min(rows - row, columns // width) * width
    stop = column + max(CHUNK_COLUMNS, columns // CHUNK_COLUMNS * CHUNK_COLUMNS)
    if width - stop < CHUNK_COLUMNS:
        stop = width
    return at, end + stop - column


def likelihood_rows(seq_len: int, max_tokens: int, split_tokens: int, num_layers: int) -> int:
    """Rows of one likelihood forward over a ``seq_len``-token prompt (at least 1): as many as ``max_tokens`` holds,
    and with a layer split (``split_tokens`` > 0) no more than ``split_tokens x num_layers`` tokens (a layer of
    them about ``split_tokens`` tokens' worth, its attention left out); its pieces (:func:`likelihood_piece`) are
    then layers or parts of a layer within ``split_tokens``. The same number every forward of the task, whatever runs beside it: the
    values do not depend on the traffic (`service.engine.likelihood.PromptLikelihood.next_call`)."""
    tokens = min(max_tokens, split_tokens * num_layers) if split_tokens > 0 else max_tokens
    return max(1, tokens // seq_len)


def take_turns(works: list[float], allowance: float) -> list[int]:
    """Which likelihood tasks run their next call in this iteration: ``works`` their calls' tokens' worth of work
    (`service.engine.forward_cost.likelihood_work`) in turn order (the one that ran longest ago first); taken in that order while their sum
    stays within ``allowance`` (``layer_split_tokens`` with a split, else what the decoding forwards left of
    ``max_batched_tokens``), the first with work always (a task with no call left, work 0, takes its turn to
    finish), so every task advances and an iteration holds about one piece of likelihood work whatever the
    number of tasks. Returns indices into ``works``."""
    chosen, total = [], 0.0
    for i, work in enumerate(works):
        if total > 0 and total + work > allowance:
            continue
        chosen.append(i)
        total += work
    return chosen
