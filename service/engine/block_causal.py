"""Block-causal decoding of LLaDA2.x: the reference ``generate`` of LLaDA2.0 and of LLaDA2.1 (token editing).

Reference: ``generate`` at the end of ``modeling_llada2_moe.py`` (2.0) and ``modeling_llada21_moe.py`` (2.1), the
HF remote code of inclusionAI/LLaDA2.0 and 2.1 (copied in ZHZisZZ/dllm ``dllm/pipelines/llada2*/models/``); the
goldens under tests/data/llada2 are its outputs. The sequence is ``[prompt][masks]`` padded to whole blocks; the
blocks are decoded in order from the one holding the prompt's tail, the active block being the window's last
``block_length`` columns. Attention is bidirectional inside a block and causal across blocks
(`service.engine.models.llada2.block_causal_mask`), so the K/V of a committed block never change.

Cache modes (:data:`BLOCK_CAUSAL_CACHE_MODES`):

* ``none``: the reference's full recompute, every forward runs the whole window ``[0, block end)``;
* ``block``: an exact append-only cache (`service.engine.models.llada2.CommittedKV`). The first forward of a block
  runs the columns not yet committed (the prompt's whole blocks, or the block that just committed) together with
  the active block and writes their K/V once; the later forwards of the block run the active block alone over the
  committed K/V. LLaDA2.1's edits change only active-block tokens, which every forward recomputes, so an edited
  block's K/V are written after its last edit. The forward count is the reference's.

Rules, per block (2.0): ``steps = min(steps, gen_length // minimal_topk)`` forwards at most, step ``i`` reveals
``schedule[i]`` positions (``block_length // steps`` each, the remainder one more in the first steps): every
masked position whose confidence (the top-1 probability) is above ``threshold`` if there are at least
``schedule[i]`` of them, else the ``schedule[i]`` most confident; decoding stops after the block that holds an EOS,
or with ``eos_early_stop`` as soon as a revealed EOS has no mask before it. 2.1 (``editing``): each forward
reveals as 2.0 with the floor ``min_transfer`` (the reference's ``num_to_transfer``) instead of a schedule, and
also replaces every revealed, non-prompt token of the active block that the model predicts as another token with
probability above ``editing_threshold``; once the block has no mask, up to ``max_post_steps`` more forwards may
edit, and the block ends at the first forward that changes nothing; ``eos_early_stop`` stops after a block when
the response so far has no mask and holds an EOS.

Rows decode in `service.engine.block_causal_batch` (one forward per iteration for every live row);
this module holds the rules of one row (:class:`Row`, the reference loop as a generator over the row's ids on the
host), the reveal of every row of a forward at once on the device (:func:`reveal_rows`: the threshold rule, the
step's count, the edits) and the iteration (:func:`step_rows`: the forward, the reveal, one host read).

Grammar-constrained rows (structured output, tool calls; `service.engine.grammar`) reveal their grammar's chain
left to right instead of the rule above, never edit, and under 2.0 step on past the block's schedule until the
block has no mask (:func:`step_rows`).

Departures: an EOS inside the prompt never ends the response (the 2.0 reference looks for it from column 0);
several EOS ids may end a response (the checkpoint's EOS and end-of-turn tokens), the reference takes one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

from service.engine.block_causal_graphs import is_later_step, later_step
from service.engine.errors import EngineInputError
from service.engine.grammar import ConstrainedRow, GrammarState, GrammarViolation, constrained_reveal
from service.engine.models.llada2 import CommittedKV, LLaDA2Model
from service.engine.report import TokenLogprob

#: The cache modes of a block-causal family.
BLOCK_CAUSAL_CACHE_MODES = ("none", "block")
BlockCausalCacheMode = Literal["none", "block"]


@dataclass(frozen=True)
class BlockCausalParams:
    """Decoding settings of a block-causal family (the reference ``generate`` arguments, by their names).

    Attributes:
        gen_length: response positions (tokens), >= 1; need not be a multiple of ``block_length``.
        block_length: tokens per block, >= 1. steps: forwards per block at most (2.0; its schedule), >= 1.
        threshold: confidence above which a masked position is revealed (probability; above 1 never).
        cache_mode: ``none`` or ``block`` (see the module doc).
        eos_early_stop: stop at a revealed EOS (2.0) / after its block (2.1) instead of after the EOS's block (2.0)
            or at the end (2.1).
        minimal_topk: 2.0 caps ``steps`` at ``gen_length // minimal_topk``, >= 1.
        editing: decode with LLaDA2.1's algorithm (token editing); False: LLaDA2.0's.
        editing_threshold: probability above which a revealed token is replaced (above 1: never).
        max_post_steps: forwards after a block's last mask that may still edit, >= 0.
        min_transfer: reveals per forward at least (2.1, the reference's ``num_to_transfer``), >= 0.
        temperature: 0 decodes greedily; above 0 samples from ``softmax(logits / temperature)``.
    """

    gen_length: int
    block_length: int = 32
    steps: int = 32
    threshold: float = 0.95
    cache_mode: BlockCausalCacheMode = "block"
    eos_early_stop: bool = False
    minimal_topk: int = 1
    editing: bool = False
    editing_threshold: float = 0.9
    max_post_steps: int = 16
    min_transfer: int = 1
    temperature: float = 0.0

    def __post_init__(self) -> None:
        """Raises EngineInputError naming the first field out of bounds."""
        for name, low in (("gen_length", 1), ("block_length", 1), ("steps", 1), ("minimal_topk", 1),
                          ("max_post_steps", 0), ("min_transfer", 0)):
            if getattr(self, name) < low:
                raise EngineInputError(f"{name} {getattr(self, name)} must be >= {low}", name)
        if self.cache_mode not in BLOCK_CAUSAL_CACHE_MODES:
            raise EngineInputError(f"cache mode {self.cache_mode!r} is not one of a block-causal model's: "
                                   f"{', '.join(BLOCK_CAUSAL_CACHE_MODES)}", "cache_mode")
        if self.temperature < 0:
            raise EngineInputError(f"temperature {self.temperature} must be >= 0", "temperature")


@dataclass
class BlockCausalResult:
    """One decoded response.

    Attributes:
        generated_ids: the response, cut after its first EOS (as the reference returns it).
        nfe: forward calls; reveals_per_call: positions written by each call (edits included).
        last_call_columns: the sequence columns the last call wrote (a check against the reference sees that
            call's writes only inside the returned ids).
        finish_reason: ``stop`` (an EOS ended it) or ``length``.
        kv_bytes: bytes of committed K/V held at the end (``block`` mode; 0 for ``none``).
    """

    generated_ids: list[int]
    nfe: int
    reveals_per_call: list[int] = field(default_factory=list)
    last_call_columns: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    kv_bytes: int = 0


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """Reveals per step of a 2.0 block: ``block_length // steps`` each, one more for the first
    ``block_length % steps`` steps (reference ``_get_num_transfer_tokens``)."""
    base, remainder = divmod(block_length, steps)
    return [base + (1 if i < remainder else 0) for i in range(steps)]


@dataclass(frozen=True)
class Call:
    """What a row asks of the next forward: its window ``[start, end)``, the first of its block's columns, and
    the reveal rule of that forward: ``count`` (the 2.0 step's reveals, or the 2.1 floor ``min_transfer``) and
    ``edit`` (2.1: revealed tokens may be replaced)."""

    start: int
    end: int
    block_start: int
    count: int = 0
    edit: bool = False


#: What a row is sent after a forward: its active block's ids after the reveal (``block_length`` ints), the offsets
#: the forward wrote, and (when the row asked for log-probabilities) one entry per written offset.
Revealed = tuple[list[int], list[int], list[TokenLogprob] | None]


class Row:
    """One request's sequence and its decode as a generator: it yields a :class:`Call` for each forward and is
    sent back its :data:`Revealed` (:func:`step_rows` computes it for every row of the forward at once). The
    sequence lives on the host (``x``, a list): the reference's loop runs over it with no device read of its own.

    ``grammar`` (a `service.engine.grammar.GrammarState`): the row's response is constrained; it reveals left to
    right by the grammar's chain (`service.engine.grammar.constrained_reveal`) and never edits. ``logprobs``:
    None, or k >= 0 alternatives per token; each written column's entry is kept (an edit replaces it)."""

    def __init__(self, prompt: list[int], params: BlockCausalParams, mask_id: int, eos_ids: Iterable[int],
                 generator: torch.Generator | None, grammar: GrammarState | None = None,
                 logprobs: int | None = None) -> None:
        if not prompt:
            raise EngineInputError("the prompt is empty; a prompt needs at least one token", "prompt")
        if mask_id in prompt:
            raise EngineInputError(f"the prompt contains the mask id {mask_id}", "prompt")
        self.params, self.block, self.mask_id, self.generator = params, params.block_length, mask_id, generator
        self.eos = frozenset(int(e) for e in eos_ids)
        self.prompt_length = len(prompt)
        self.num_blocks = -(-(len(prompt) + params.gen_length) // self.block)
        self.x: list[int] = [int(t) for t in prompt] + [mask_id] * (self.num_blocks * self.block - len(prompt))
        self.committed = 0  # columns whose K/V the cache holds for good (block mode; 0: full recompute)
        self.decoded_end = self.prompt_length // self.block * self.block  # end column of the blocks decoded
        self.nfe = 0
        self.reveals: list[int] = []
        self.last_written: list[int] = []
        self.grammar, self.logprobs = grammar, logprobs
        self.token_logprobs: dict[int, TokenLogprob] = {}  # column -> the entry of its last write

    @property
    def length(self) -> int:
        """Columns of the sequence (whole blocks)."""
        return len(self.x)

    def call(self, index: int, count: int, edit: bool) -> Call:
        """The next forward over block ``index`` (its reveal rule: ``count``, ``edit``); counts it and commits
        the columns before the block."""
        start = self.committed
        if self.params.cache_mode == "block":
            self.committed = index * self.block  # the columns before the active block are final: written once
        self.nfe += 1
        return Call(start, (index + 1) * self.block, index * self.block, count, edit)

    def wrote(self, index: int, sent: Revealed) -> list[int]:
        """Record one call's writes over block ``index`` (``sent``: :data:`Revealed`); returns the offsets."""
        block, written, entries = sent
        start = index * self.block
        self.x[start:start + self.block] = block
        self.reveals.append(len(written))
        self.last_written = [start + j for j in written]
        for j, entry in zip(written, entries or []):
            self.token_logprobs[start + j] = entry
        return written

    def response_logprobs(self, count: int) -> list[TokenLogprob] | None:
        """The entries of the response's first ``count`` tokens (None when the row did not ask)."""
        if self.logprobs is None:
            return None
        return [self.token_logprobs[self.prompt_length + i] for i in range(count)]

    def _has_eos(self, ids: list[int]) -> bool:
        return any(t in self.eos for t in ids)

    def decode(self) -> Generator[Call, Revealed, BlockCausalResult]:
        """The whole decode (module doc): yields each forward's call, returns the result."""
        params = self.params
        for index in range(self.prompt_length // self.block, self.num_blocks):
            if params.editing:
                yield from self._edit_block(index)
            else:
                early = yield from self._reveal_block(index)
                if early is not None:
                    return self._result(early, finish="stop")
            self.decoded_end = (index + 1) * self.block
            response = self.x[self.prompt_length:(index + 1) * self.block]
            if params.editing:
                if params.eos_early_stop and self.mask_id not in response and self._has_eos(response):
                    break
            elif self._has_eos(response):
                break
        return self._result(params.gen_length)

    def _reveal_block(self, index: int) -> Generator[Call, Revealed, int | None]:
        """LLaDA2.0's forwards over block ``index``; returns the response length to stop at (``eos_early_stop``)."""
        params = self.params
        steps = min(params.steps, params.gen_length // params.minimal_topk)
        start = index * self.block
        counts: Iterable[int] = transfer_schedule(self.block, steps) if steps > 0 else []
        if self.grammar is not None:  # a chain may reveal fewer than the step's count: the block still fills
            counts = itertools.chain(counts, itertools.repeat(1))
        for count in counts:
            if self.mask_id not in self.x[start:start + self.block]:
                break
            written = self.wrote(index, (yield self.call(index, count, edit=False)))
            if params.eos_early_stop and self._has_eos([self.x[start + j] for j in written]):
                response = self.x[self.prompt_length:]
                first = next(j for j, t in enumerate(response) if t in self.eos)
                if self.mask_id not in response[:first]:
                    return first + 1
        return None

    def _edit_block(self, index: int) -> Generator[Call, Revealed, None]:
        """LLaDA2.1's forwards over block ``index``: reveals with the ``min_transfer`` floor, and edits."""
        params = self.params
        start = index * self.block
        post_steps = 0
        while True:
            any_masked = self.mask_id in self.x[start:start + self.block]
            if not any_masked:
                post_steps += 1
                if post_steps > params.max_post_steps:
                    break
            edit = self.grammar is None  # a constrained response is never rewritten
            written = self.wrote(index, (yield self.call(index, params.min_transfer, edit=edit)))
            if not any_masked and not written:  # no mask: every write is an edit
                break

    def response(self, end: int | None = None) -> list[int]:
        """The response ids before column ``end`` (default: its whole window), cut after the first EOS."""
        stop = self.prompt_length + self.params.gen_length if end is None else min(
            end, self.prompt_length + self.params.gen_length)
        return self._result(max(0, stop - self.prompt_length)).generated_ids

    def _result(self, length: int, finish: str = "length") -> BlockCausalResult:
        """The response's first ``length`` positions cut after the first EOS (reference return value)."""
        response = self.x[self.prompt_length:self.prompt_length + length]
        first = next((j for j, t in enumerate(response) if t in self.eos), None)
        if first is not None:
            response, finish = response[: first + 1], "stop"
        return BlockCausalResult(generated_ids=list(response), nfe=self.nfe, reveals_per_call=self.reveals,
                                 last_call_columns=list(self.last_written), finish_reason=finish, kv_bytes=0)


def reveal_rows(logits: torch.Tensor, active: torch.Tensor, rows: list[Row], calls: list[Call]) -> torch.Tensor:
    """Every row's reveal of one forward at once, on the logits' device (the rules of the module doc).

    Args:
        logits: float32 ``[B, W, V]``, each row's active block in its first ``block_length`` columns (W: the
            widest block). active: int64 ``[B, W]``, the blocks' ids the forward saw. rows, calls: the B rows and
            their calls (``count``, ``edit``).

    Returns:
        int64 ``[B, 2, W]``: the blocks' ids after the reveal and the written flags (1/0); columns past a row's
        block are never written. Sampling rows (temperature above 0) draw from their own generators, over their
        own block's columns, as alone.
    """
    b, w, _ = logits.shape
    device = logits.device
    # A constrained row's reveal is its chain (step_rows): it draws nothing here, so its generator is the chain's.
    sampling = [i for i, r in enumerate(rows) if r.params.temperature > 0 and r.grammar is None]
    if sampling:
        temperature = torch.tensor([r.params.temperature if r.params.temperature > 0 else 1.0 for r in rows],
                                   dtype=logits.dtype, device=device)
        logits = logits / temperature[:, None, None]  # 1.0 leaves a greedy row's logits as they are
    probs = torch.softmax(logits, dim=-1)
    tokens = probs.argmax(dim=-1)  # [B, W]
    for i in sampling:
        block = rows[i].block
        tokens[i, :block] = torch.multinomial(probs[i, :block], num_samples=1, generator=rows[i].generator)[:, 0]
    confidence = probs.gather(-1, tokens[..., None])[..., 0]  # [B, W], the tokens' probabilities
    # Per-row rules, one host-to-device copy each: thresholds in the confidence's dtype, as the reference compares.
    limits = torch.tensor([[r.params.threshold, r.params.editing_threshold if c.edit else math.inf]
                           for r, c in zip(rows, calls)], dtype=confidence.dtype, device=device)
    counts = torch.tensor([[c.count, r.block, r.prompt_length - c.block_start, int(c.edit)]
                           for r, c in zip(rows, calls)], dtype=torch.long, device=device)
    columns = torch.arange(w, device=device)
    valid = columns < counts[:, 1:2]
    masked = (active == rows[0].mask_id) & valid
    scores = torch.where(masked, confidence, -torch.inf)
    high = scores > limits[:, 0:1]  # masked only: the others score -inf
    # The count most confident masked positions: rank by a stable descending sort (fewer when fewer are masked).
    order = scores.argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, columns.expand(b, w))
    top = masked & (rank < counts[:, 0:1])
    chosen = torch.where(high.sum(dim=1, keepdim=True) >= counts[:, 0:1], high, top)
    # 2.1: revealed, non-prompt columns the model predicts as another token above the editing threshold.
    editable = valid & ~masked & (columns >= counts[:, 2:3]) & counts[:, 3:4].bool()
    edits = editable & (confidence > limits[:, 1:2]) & (tokens != active)
    written = chosen | edits
    return torch.stack([torch.where(written, tokens, active), written.long()], dim=1)


@dataclass(frozen=True)
class ChecksFailed:
    """A row of :func:`step_rows` whose K/V writes' checks, put off, failed: what it would have been sent (its
    reveal over logits that may be NaN: use it only if running its forward again with the checks read at once
    finds nothing, a false alarm)."""

    revealed: Revealed | GrammarViolation


def step_rows(model: LLaDA2Model, rows: list[Row], calls: list[Call], cache: CommittedKV,
              banned: torch.Tensor | None = None,
              checks: Callable[[int], torch.Tensor | None] | None = None,
              layers: tuple[int, int] | None = None, hidden: torch.Tensor | None = None,
              later: object | None = None) -> list[Revealed | GrammarViolation | ChecksFailed] | torch.Tensor:
    """One forward for the calls of ``rows`` (each in its own cache slot; windows right-padded) and every row's
    reveal, read back in one host read: per row its :data:`Revealed` (what :meth:`Row.decode` is sent).

    ``checks(B)``, called after the forward: the verdicts of the checks its cache writes put off, bool ``[B]`` per
    row on the device (None: none put off; `service.quant.committed.CommitWriter.take_checks`); they join the
    same read, and a row whose verdict is False gets :class:`ChecksFailed` around what it would have been sent.

    A grammar-constrained row reveals its chain instead (`service.engine.grammar.constrained_reveal`, its
    candidates from the block's leftmost mask; a fixed schedule's count, else the threshold; ``banned`` ids never
    chosen): a host read per chain position, only when such a row is in the forward; a row whose grammar fails
    gets its `GrammarViolation` instead of a result. Rows that ask for log-probabilities take a second read, only
    then: each written token's log-softmax of the model's logits (before any temperature or constraint) and the
    k most likely tokens.

    ``layers``, ``hidden``: one piece of the forward split by layers (`LLaDA2Model.forward`); a piece that ends
    before the last layer returns its hidden states ``[B, W, C]`` (nothing revealed), the last one reveals.

    ``later``: a `service.engine.graphs.LaterSteps`: a later step (every window its active block, no hook on the
    cache) runs at its bucket's shapes, replayed from a CUDA graph where it captures
    (`service.engine.block_causal_graphs`); the same tokens.
    """
    device = cache.device
    width = max(c.end - c.start for c in calls)
    widest_block = max(r.block for r in rows)
    ids = torch.tensor([r.x[c.start:c.end] + [r.mask_id] * (width - (c.end - c.start)) for r, c in zip(rows, calls)],
                       dtype=torch.long, device=device)  # [B, W]
    starts = torch.tensor([c.start for c in calls], device=device)
    positions = starts[:, None] + torch.arange(width, device=device)  # padded columns lie in later blocks
    blocks = torch.tensor([r.block for r in rows], device=device)
    at = torch.tensor([c.block_start - c.start for c in calls], device=device)[:, None] + torch.arange(
        widest_block, device=device)
    at = at.clamp(max=width - 1)
    cache.columns = max(c.start for c in calls) + width
    if hidden is not None and hidden.shape[1] < width:  # a piece's rows regrouped with wider ones
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, width - hidden.shape[1]))
    if later is not None and is_later_step(calls, cache, layers):
        logits = later_step(later, model, ids, [c.start for c in calls], blocks, at, cache)
    else:
        logits = model(ids, positions=positions, block_length=blocks, cache=cache, logits_at=at, layers=layers,
                       hidden=hidden)  # [B, widest, V]
    if layers is not None and layers[1] < len(model.layers):
        return logits  # the hidden states after this piece
    chains = _chains(logits, rows, calls, banned)
    revealed = reveal_rows(logits, ids.gather(1, at), rows, calls)  # [B, 2, widest]: ids, written flags
    verdicts = checks(len(rows)) if checks is not None else None
    flat = revealed.flatten(1)
    if verdicts is not None:  # each row's verdict after its ids and flags
        flat = torch.cat([flat, verdicts.long()[:, None]], dim=1)
    read = flat.tolist()  # the iteration's one host read
    w = revealed.shape[2]
    out: list = []
    for i, (r, values) in enumerate(zip(rows, read)):
        block, written = values[:w], values[w:2 * w]
        chain = chains.get(i)
        if chain is None:
            out.append((block[: r.block], [j for j, flag in enumerate(written[: r.block]) if flag], None))
        elif chain.error is not None:
            out.append(chain.error)
        else:
            c = calls[i]
            block = r.x[c.block_start:c.block_start + r.block]
            for k, token in zip(chain.chosen, chain.tokens):
                block[chain.start + k] = token
            out.append((block, [chain.start + k for k in chain.chosen], None))
    out = _with_logprobs(logits, rows, out)
    if verdicts is not None:
        out = [o if values[2 * w] else ChecksFailed(o) for o, values in zip(out, read)]
    return out


def _chains(logits: torch.Tensor, rows: list[Row], calls: list[Call],
            banned: torch.Tensor | None) -> dict[int, ConstrainedRow]:
    """The grammar-constrained rows' chains of this forward, decided together (row index -> its chain)."""
    chains = {}
    for i, (r, c) in enumerate(zip(rows, calls)):
        if r.grammar is None:
            continue
        block = r.x[c.block_start:c.block_start + r.block]
        start = block.index(r.mask_id) if r.mask_id in block else r.block
        threshold = r.params.threshold if math.isfinite(r.params.threshold) else None
        chains[i] = ConstrainedRow(r.grammar, logits[i, start:r.block], None if threshold is not None else max(
            1, c.count), threshold, r.params.temperature, r.generator, start=start)
    if chains:
        constrained_reveal(list(chains.values()), banned)
    return chains


def _with_logprobs(logits: torch.Tensor, rows: list[Row], out: list) -> list:
    """``out`` with each written token's :class:`TokenLogprob` for the rows that asked (one host read)."""
    asked = [i for i, (r, o) in enumerate(zip(rows, out)) if r.logprobs is not None and isinstance(o, tuple)]
    if not asked:
        return out
    k = max(rows[i].logprobs for i in asked)
    w = logits.shape[1]
    tokens = torch.tensor([out[i][0] + [0] * (w - len(out[i][0])) for i in asked], device=logits.device)
    logp = torch.log_softmax(logits[asked], dim=-1)  # [A, W, V], the model's
    values = logp.gather(-1, tokens[..., None])[..., 0]
    top_values, top_ids = logp.topk(k, dim=-1)  # k = 0: empty
    # One read: the token's value, then k values, then k ids (float32 holds ids below 2**24 exactly).
    packed = torch.cat([values[..., None], top_values, top_ids.to(values.dtype)], dim=-1).tolist()
    for a, i in enumerate(asked):
        block, written, _ = out[i]
        n = rows[i].logprobs
        entries = [TokenLogprob(token=block[j], logprob=packed[a][j][0],
                                top=[(int(t), v) for t, v in zip(packed[a][j][1 + k:1 + k + n], packed[a][j][1:1 + n])])
                   for j in written]
        out[i] = (block, written, entries)
    return out
