"""Block-diffusion decoding of a cohort, one forward call at a time: no cache, prefix cache and dual cache
(Fast-dLLM semantics).

Reference: NVlabs/Fast-dLLM commit 24cc59e, `llada/generate.py` (``generate``, ``generate_with_prefix_cache``,
``generate_with_dual_cache``) and `dream/model/generation_utils_block.py` / `generation_utils.py`; golden SPEC
section 3; paper "Preliminary". A **cohort** is the rows of one `generate` call (or one server request): they share
one :class:`DecodeParams` and one KV store, are left-padded together (``[left padding][prompt][response]``) and
move from block to block together. The response is ``gen_length`` masks cut into blocks decoded left to right.

Per block (block mode):

1. **Block-initial pass**: a full forward over the whole sequence (nfe + 1). In cached modes every layer writes its
   reused columns to the KV store (``store.write``). The model family's reveal rule
   (`service.engine.reveal`) reveals among the block's masks (Dream: exactly the block's first column).
2. Until the block has no mask: one forward (nfe + 1) -- full (``none``), block + suffix with the reused prefix
   (``prefix``), or block only with reused prefix and suffix (``dual``) -- then reveal among the block's masks.

When the reveal rule asks for its whole-response algorithm (Dream, ``cache_mode="none"``,
``dream_schedule="origin"``), every call is a full forward over the response's masks (:class:`Canvas`).

A cohort never runs a forward itself: :meth:`Cohort.next_pass` says what its next call needs (a :class:`Pass`) and
:meth:`Cohort.apply` takes that call's logits, so `service.engine.batch` can put the passes of many cohorts, at
different blocks and steps, into one forward.

Departures from the reference (tokens never differ from it in fp32; NFE only lower):

* No forward is made for a block that is already full: the reference's cached loops always make one more call
  after the block-initial pass, which reveals nothing when that pass filled the block (LLaDA threshold 0.0,
  golden ``llada_p17_g64_thr0.0_{prefix,dual}``: reference NFE 4, here 2), and crash with an IndexError when
  ``steps == number of blocks``; here both work and take one call per block.
* Batches: each row decodes exactly as it would alone (per-row schedule, confidence, NFE, RNG); the reference
  supports batch 1 only. A row whose block is full sits out the rest of that block's steps.
* EOS: unless ``ignore_eos``, a row stops as soon as every position up to its first EOS is revealed (the reference
  always decodes every block); its tokens up to that EOS are the same as with ``ignore_eos``.
* Dream's fixed (entropy) schedule needs >= 2 steps per block in block mode (the reference leaves 31 of 32
  masks in every block with 1 step per block; rejected at the engine boundary).
* Temperature > 0: see `service.engine.sampling` (per-row seeded noise).
* The mask id, and ids the tokenizer cannot decode, are never chosen (`service.engine.sampling`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from service.engine.cache_hooks import BlockInitialWrite, ReuseRead
from service.engine.grammar import ConstrainedRow, GrammarState
from service.engine.kv_store import KVStore, Segments
from service.engine.models import DiffusionLM
from service.engine.models.layers import KVHook
from service.engine.params import DecodeParams, RowOptions
from service.engine.report import TokenLogprob
from service.engine.response import cut_response
from service.engine.reveal import Canvas
from service.engine.spec import ModelSpec

OnBlock = Callable[[int, list[list[int]]], None]
Cancelled = Callable[[], list[bool]]


@dataclass
class RowState:
    """Decoding state and accounting of one row (what the row would have alone).

    Attributes:
        pad: left-padding columns of the row.
        temperature: sampling temperature; generator: the row's RNG (None when greedy and not random remasking).
        nfe: forward calls the row took part in; reveals: tokens revealed at each of them;
        steps_per_block: forward calls per block the row worked on.
        status: ``running``, ``stop`` (stopped at EOS), ``cancelled``.
        plan: the fixed schedule's reveal counts of the current block (None under a threshold).
        canvas: the whole-response schedule's state (None in block mode).
        grammar: the row's grammar state when its response is constrained (`service.engine.grammar`), else None.
    """

    pad: int
    temperature: float
    generator: torch.Generator | None
    nfe: int = 0
    reveals: list[int] = field(default_factory=list)
    steps_per_block: list[int] = field(default_factory=list)
    status: Literal["running", "stop", "cancelled"] = "running"
    plan: list[int] | None = None
    canvas: Canvas | None = None
    grammar: GrammarState | None = None


@dataclass
class Pass:
    """One cohort's part of a forward call, described on the host (building it reads nothing from the device).

    Attributes:
        cohort: who asked; rows: its row indices in the call (ascending).
        kind: ``full`` (the input is every column of the sequence) or ``window`` (the input is the active block, or
            block + suffix, next to reused K/V read from the store).
        input_ids, positions: int64 ``[n, L]``; input_start: the sequence column of input column 0.
        pads: left-padding columns of each row; seq_len: T, the keys each row attends over (its sequence).
        hook: the cohort's KV hook of this call (block-initial write, or the protocol read of a store that is not
            gathered in sequence order), or None.
        reveal_start, reveal_width: the sequence columns ``[reveal_start, reveal_start + reveal_width)`` whose
            logits the reveal needs (the active block, or the response of a whole-response call).
        step: the call's index within the block (0 = block-initial pass); -1 for a whole-response call.
        count, fraction, first_only: per row, the reveal's plan (`service.engine.reveal.RevealBatch`).
        segments, selection, reused_positions: a window pass's block layout, its rows among the block-initial
            pass's rows (int64, None = all) and the RoPE positions of the reused columns (pre-RoPE stores only).
        layers, hidden: a full pass split by layers (`service.runtime.scheduler.split_by_layers`): the decoder
            layers ``(a, b)`` this forward runs (None: all) and the hidden states ``[n, width, C]`` after layer
            ``a - 1`` that the previous piece left (None when ``a`` is 0). The running batch sets them; the
            cohort never does (its call is the whole pass).
    """

    cohort: Cohort
    rows: list[int]
    kind: Literal["full", "window"]
    input_ids: torch.Tensor
    positions: torch.Tensor
    input_start: int
    pads: list[int]
    seq_len: int
    hook: KVHook | None
    reveal_start: int
    reveal_width: int
    step: int
    count: list[int | None]
    fraction: list[float | None]
    first_only: list[bool]
    segments: Segments | None = None
    selection: torch.Tensor | None = None
    reused_positions: torch.Tensor | None = None
    layers: tuple[int, int] | None = None
    hidden: torch.Tensor | None = None

    @property
    def width(self) -> int:
        """Input columns of the pass."""
        return self.input_ids.shape[1]

    @property
    def logits_offset(self) -> int:
        """The input column of the reveal's first column."""
        return self.reveal_start - self.input_start


class Cohort:
    """The rows of one request (or `generate` call) with one :class:`DecodeParams` and one KV store.

    Args:
        model: the network (its class carries the reveal rule); spec: its :class:`ModelSpec`.
        prompts: token ids per row (validated by the engine: non-empty, in vocabulary, no mask id).
        params: the cohort's settings; rows: per-row options (same length as prompts).
        store: holds the reused K/V of cached modes (unused with ``cache_mode="none"``).
        on_block: called as ``on_block(block_index, ids)`` each time a further block is committed for every row
            still decoding; ``ids`` are, per row, the response ids committed so far (cut after the first EOS unless
            ``ignore_eos``).
        cancelled: polled after every forward call; rows it marks True stop decoding.

    The cohort keeps on the host what its next call needs (each row's masked columns left in its window, its
    status, the response tokens read back after each call), so :meth:`next_pass` never reads the device; the
    running batch reveals for all rows at once and hands each cohort its rows' results (:meth:`absorb`).

    Attributes:
        done: no further call is needed; started_s, finished_s: ``perf_counter`` at the first call and when done;
        first_block_s: seconds from the first call to the first block committed by every row.
        allowed: optional constraint on the tokens a row may choose, ``allowed(row, call) -> bool [W, V] or [1,
            V] tensor or None`` (True = allowed), asked at every call (`service.engine.reveal.RevealBatch`).
        logprobs: None, or k >= 0: record each revealed token's log-probability and k alternatives
            (:attr:`token_logprobs`, one list per row of ``(column, token, logprob, [(id, logprob)...])``).
    """

    def __init__(
        self, model: DiffusionLM, spec: ModelSpec, prompts: list[list[int]], params: DecodeParams,
        rows: list[RowOptions], store: KVStore, on_block: OnBlock | None = None, cancelled: Cancelled | None = None,
    ) -> None:
        self.model, self.spec, self.params, self.store, self.row_options = model, spec, params, store, rows
        self.rule = type(model).reveal_rule
        self.on_block, self.cancelled = on_block, cancelled
        device = model.embed.weight.device
        longest = max(len(p) for p in prompts)
        self.response_start = longest
        self.seq_len = longest + params.gen_length
        pads = [longest - len(p) for p in prompts]
        host = [[spec.pad_id] * pad + list(p) + [spec.mask_id] * params.gen_length for p, pad in zip(prompts, pads)]
        self.x = torch.tensor(host, dtype=torch.long, device=device)
        self.pads = pads
        self.positions = (torch.arange(self.seq_len, device=device)[None, :]
                          - torch.tensor(pads, device=device)[:, None]).clamp(min=0)
        self.eos = torch.tensor(spec.eos_ids, device=device)
        self.banned = torch.tensor(spec.banned_ids, dtype=torch.long, device=device)
        self.rows = [
            RowState(pad=pad, temperature=o.temperature, generator=_row_generator(o, params, device),
                     grammar=o.grammar.start() if o.grammar is not None else None)
            for pad, o in zip(pads, rows)
        ]
        #: Per row, the response as last read back (the mask id where not revealed yet).
        self.response = [[spec.mask_id] * params.gen_length for _ in prompts]
        self.num_blocks = params.gen_length // params.block_length
        self.canvas = self.rule.uses_canvas(params)
        self._masks_left = [params.gen_length if self.canvas else params.block_length for _ in prompts]
        if self.canvas:
            for state in self.rows:
                state.canvas = self.rule.start_canvas(params)
                state.steps_per_block.append(0)  # the whole response is one canvas
        self.block, self.step = 0, 0
        self._live: list[int] = []
        self._segments: Segments | None = None
        self._reused_positions: torch.Tensor | None = None
        self._selections: dict[tuple[int, ...], torch.Tensor] = {}
        self._emitted_blocks = 0
        self.done = False
        self.started_s = self.finished_s = 0.0
        self.first_block_s = 0.0
        self.allowed: Callable[[int, Pass], torch.Tensor | None] | None = None
        # Rows that ask for log-probabilities (RowOptions.logprobs) set it: the most alternatives any row wants.
        wanted = [o.logprobs for o in rows if o.logprobs is not None]
        self.logprobs: int | None = max(wanted) if wanted else None
        self.token_logprobs: list[list[tuple]] = [[] for _ in prompts]

    # ------------------------------------------------------------------------------------------------- calls

    def next_pass(self) -> Pass | None:
        """What the cohort's next forward call needs, or None once it is done (then ``done`` is True)."""
        if self.done:
            return None
        if not self.started_s:
            self.started_s = time.perf_counter()
        found = self._canvas_pass() if self.canvas else self._block_pass()
        if found is None:
            self.done = True
            self.finished_s = time.perf_counter()
        return found

    def _canvas_pass(self) -> Pass | None:
        start, end = self.response_start, self.seq_len
        # A constrained row reveals left to right and may need more calls than the schedule's: it goes on while
        # it has masks (each call reveals at least one).
        stepping = [
            r for r in self._running()
            if (self.rows[r].canvas.step < self.rows[r].canvas.steps or self.rows[r].grammar is not None)
            and self._masks_left[r]
        ]
        return self._full_pass(stepping, start, end, None, -1) if stepping else None

    def _block_pass(self) -> Pass | None:
        """The block loop of all three cache modes (module doc, steps 1-2)."""
        mode = self.params.cache_mode
        while True:
            start = self.response_start + self.block * self.params.block_length
            end = start + self.params.block_length
            if self.step == 0:
                live = self._running()
                if self.block >= self.num_blocks or not live:
                    return None
                self._live = live
                hook = None
                for r in live:
                    state = self.rows[r]
                    state.steps_per_block.append(0)
                    # A block is all masks before its first call (blocks are decoded left to right).
                    self._masks_left[r] = self.params.block_length
                    state.plan = self.rule.block_plan(self.params.block_length, self.params)
                if mode != "none":
                    self._segments = Segments(
                        pad_lengths=tuple(self.rows[r].pad for r in live), block_start=start, block_end=end,
                        seq_len=self.seq_len, cache_mode=mode,
                    )
                    self._reused_positions = None
                    hook = BlockInitialWrite(self.store, self._segments, self._key_mask(live))
                return self._full_pass(live, start, end, hook, 0)
            stepping = [r for r in self._running() if r in self._live and self._masks_left[r]]
            if stepping:
                if mode == "none":
                    return self._full_pass(stepping, start, end, None, self.step)
                return self._window_pass(stepping)
            self.block, self.step = self.block + 1, 0

    def _select(self, tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``tensor[rows]``: a view when the rows are all of the cohort's (one request: one row)."""
        if len(rows) == tensor.shape[0]:
            return tensor
        return tensor[rows]

    def _key_mask(self, rows: list[int]) -> torch.Tensor | None:
        """bool ``[n, T]`` (True = real token) over all columns, or None when none of ``rows`` is padded."""
        pads = [self.pads[r] for r in rows]
        if not any(pads):
            return None
        return torch.arange(self.seq_len, device=self.x.device)[None, :] >= torch.tensor(pads, device=self.x.device)[:, None]

    def _plan(self, rows: list[int], step: int) -> tuple[list, list, list]:
        plans = [self.rule.row_plan(step, self._masks_left[r], self.params, self.rows[r].plan, self.rows[r].canvas)
                 for r in rows]
        return [p[0] for p in plans], [p[1] for p in plans], [p[2] for p in plans]

    def _full_pass(self, rows: list[int], start: int, end: int, hook: KVHook | None, step: int) -> Pass:
        """Every column of ``rows``; the reveal's columns [start, end)."""
        count, fraction, first_only = self._plan(rows, step)
        return Pass(
            self, rows, "full", self._select(self.x, rows), self._select(self.positions, rows), 0,
            [self.pads[r] for r in rows], self.seq_len, hook, start, end - start, step, count, fraction, first_only,
        )

    def _window_pass(self, rows: list[int]) -> Pass:
        """Window with reused K/V: prefix mode computes [s, T), dual mode [s, e); the reveal's columns [s, e)."""
        segments = self._segments
        start, end = segments.block_start, segments.block_end
        window_end = self.seq_len if segments.cache_mode == "prefix" else end
        selection = None
        if rows != self._live:
            key = tuple(self._live.index(r) for r in rows)
            if key not in self._selections:
                self._selections[key] = torch.tensor(key, device=self.x.device)
            selection = self._selections[key]
        reused_positions = None
        if self.store.pre_rope_keys:
            # Made once per block and set of rows, so a store that keeps tables per positions sees the same tensor.
            if self._reused_positions is None or self._reused_positions[0] != rows:
                columns = segments.reused_columns.to(self.x.device)
                self._reused_positions = (rows, self._select(self.positions, rows)[:, columns])
            reused_positions = self._reused_positions[1]
        hook = None
        if not self.store.sequence_ordered:
            hook = ReuseRead(self.store, segments, selection, self.model.rope, reused_positions)
        count, fraction, first_only = self._plan(rows, self.step)
        return Pass(
            self, rows, "window", self._select(self.x, rows)[:, start:window_end],
            self._select(self.positions, rows)[:, start:window_end], start, [self.pads[r] for r in rows],
            self.seq_len, hook, start, end - start, self.step, count, fraction, first_only, segments, selection,
            reused_positions,
        )

    # -------------------------------------------------------------------------------------------------- reveals

    def reveal_rows(self, call: Pass) -> dict:
        """The host lists of :class:`~service.engine.reveal.RevealBatch` for the call's rows."""
        params, states = self.params, [self.rows[r] for r in call.rows]
        return {
            "width": [call.reveal_width] * len(call.rows), "step": [call.step] * len(call.rows),
            "count": call.count, "fraction": call.fraction, "first_only": call.first_only,
            "threshold": [params.threshold] * len(call.rows), "temperature": [s.temperature for s in states],
            "generator": [s.generator for s in states],
            "random_remasking": [params.remasking == "random"] * len(call.rows),
            "neg_entropy": [params.threshold is None] * len(call.rows),
            "ignore_eos": [params.ignore_eos] * len(call.rows),
        }

    def reveal_columns(self, call: Pass) -> list[list[int]]:
        """Per row of the call, the window columns (0-based, ascending) whose logits its reveal reads, from the
        host's copy of the window (no device read): a greedy row's masked columns (a reveal only ever takes a
        masked column, and a greedy choice at one column reads only that column's logits); every column for a row
        that samples or remasks at random (its draws are as wide as its window), and for a grammar-constrained
        row (its chain reads from its leftmost mask on)."""
        offset = call.reveal_start - self.response_start
        every = list(range(call.reveal_width))
        out = []
        for r in call.rows:
            state = self.rows[r]
            if state.temperature > 0 or self.params.remasking == "random" or state.grammar is not None:
                out.append(every)
                continue
            window = self.response[r][offset: offset + call.reveal_width]
            masked = [j for j, token in enumerate(window) if token == self.spec.mask_id]
            out.append(masked or every)
        return out

    def write(self, call: Pass, window: torch.Tensor) -> None:
        """Put the call's revealed window ``[n, W >= reveal_width]`` (int64) into the cohort's tokens."""
        end = call.reveal_start + call.reveal_width
        if len(call.rows) == self.x.shape[0]:
            self.x[:, call.reveal_start:end] = window[:, : call.reveal_width]
        else:
            self.x[call.rows, call.reveal_start:end] = window[:, : call.reveal_width]

    def constrained_row(self, call: Pass, j: int, logits: torch.Tensor) -> ConstrainedRow:
        """The ``j``-th row of ``call`` as a grammar-constrained row of the batched reveal
        (`service.engine.grammar`): its candidates from its leftmost masked column on (``logits``: ``[W, V]`` of
        the call's window), and under a fixed schedule the count its family's plan gives (at least 1; Dream's
        block-initial pass: 1), else its threshold. Host only (the window's tokens as last read back)."""
        r, params = call.rows[j], self.params
        state = self.rows[r]
        offset = call.reveal_start - self.response_start
        window = self.response[r][offset: offset + call.reveal_width]
        start = window.index(self.spec.mask_id)
        masked = call.reveal_width - start
        count = None
        if params.threshold is None:
            if call.first_only[j]:
                count = 1
            elif call.fraction[j] is not None:
                count = int(masked * call.fraction[j])
            elif call.count[j] is not None:
                count = call.count[j]
            else:
                count = masked
            count = max(1, count)
        return ConstrainedRow(state.grammar, logits[start:call.reveal_width], count, params.threshold,
                              state.temperature, state.generator, start=start)

    def absorb(self, call: Pass, counts: list[int], masks_left: list[int], stops: list[bool],
               window: list[list[int]], logprobs: list | None = None) -> None:
        """Take a call's results, read back once for the whole iteration: per row the tokens revealed, the
        masks left in its window, whether it reached EOS, the window's tokens (and, when asked, its log-probs);
        then count the call, poll cancellation and commit blocks."""
        offset = call.reveal_start - self.response_start
        for j, r in enumerate(call.rows):
            state = self.rows[r]
            self.response[r][offset: offset + call.reveal_width] = window[j][: call.reveal_width]
            self._masks_left[r] = masks_left[j]
            if state.canvas is not None:
                if self.params.threshold is not None and state.grammar is None:
                    state.canvas.carried = (call.count[j] or 0) - counts[j]
                    if state.canvas.carried and state.canvas.step == state.canvas.steps - 1:
                        state.canvas.quota, state.canvas.steps = 0, state.canvas.steps + 1
                state.canvas.step += 1
            if logprobs is not None:
                self.token_logprobs[r].extend(logprobs[j])
            state.nfe += 1
            state.reveals.append(counts[j])
            state.steps_per_block[-1] += 1
            if stops[j]:
                state.status = "stop"
        if not self.canvas:
            self.step += 1
        if self.cancelled is not None:
            for r, flag in enumerate(self.cancelled()):
                if flag and self.rows[r].status == "running":
                    self.rows[r].status = "cancelled"
        self._emit_blocks()

    # ------------------------------------------------------------------------------------------------ bookkeeping

    def _running(self) -> list[int]:
        return [r for r, state in enumerate(self.rows) if state.status == "running"]

    def response_ids(self, row: int, committed_only: bool = False) -> list[int]:
        """The row's response ids: cut after the first EOS unless ``ignore_eos``, and before the first mask."""
        response = self.response[row]
        if self.spec.mask_id in response:
            cut = response.index(self.spec.mask_id)
            if committed_only:
                cut -= cut % self.params.block_length
            response = response[:cut]
        return cut_response(response, self.spec.eos_ids, self.params.ignore_eos).ids

    def response_logprobs(self, row: int, count: int) -> list[TokenLogprob] | None:
        """The log-probabilities of the row's first ``count`` response tokens as the step that revealed each gave
        them (:attr:`token_logprobs`), with the row's own number of alternatives; None when the row did not ask
        (`RowOptions.logprobs`)."""
        k = self.row_options[row].logprobs
        if k is None:
            return None
        by_position = {column - self.response_start: (token, value, top)
                       for column, token, value, top in self.token_logprobs[row]}
        return [TokenLogprob(token=by_position[i][0], logprob=by_position[i][1], top=list(by_position[i][2])[:k])
                for i in range(count)]

    def _committed(self, row: int) -> CommittedIds:
        """The row's committed ids for ``on_block``, with their log-probabilities when it asked for them."""
        ids = CommittedIds(self.response_ids(row, committed_only=True))
        ids.logprobs = self.response_logprobs(row, len(ids))
        return ids

    def _committed_blocks(self, row: int) -> int:
        """Leading blocks of the row with no mask left (all of them once the row stopped at EOS)."""
        if self.rows[row].status == "stop":
            return self.num_blocks
        response = self.response[row]
        first = response.index(self.spec.mask_id) if self.spec.mask_id in response else self.params.gen_length
        return first // self.params.block_length

    def _emit_blocks(self) -> None:
        """Call ``on_block`` for each block newly committed by every row that was not cancelled."""
        rows = [r for r, s in enumerate(self.rows) if s.status != "cancelled"]
        committed = min((self._committed_blocks(r) for r in rows), default=self.num_blocks)
        if committed > self._emitted_blocks and self._emitted_blocks == 0:
            self.first_block_s = time.perf_counter() - self.started_s
        if self.on_block is not None:
            for block in range(self._emitted_blocks, committed):
                self.on_block(block, [self._committed(r) for r in range(len(self.rows))])
        self._emitted_blocks = max(self._emitted_blocks, committed)


class CommittedIds(list):
    """A row's committed response ids as ``on_block`` gets them; ``logprobs`` holds their log-probabilities when
    the row asked for them (else None)."""

    logprobs: list[TokenLogprob] | None = None


def _row_generator(options: RowOptions, params: DecodeParams, device: torch.device) -> torch.Generator | None:
    """The row's RNG, seeded from its request (a fresh random seed when none is given); None when greedy."""
    if options.temperature == 0 and params.remasking != "random":
        return None
    generator = torch.Generator(device=device)
    if options.seed is None:
        generator.seed()
    else:
        generator.manual_seed(options.seed)
    return generator
