"""Log-likelihood of a continuation under a masked diffusion model: the LLaDA authors' Monte-Carlo estimate.

A diffusion LM has no left-to-right factorisation, so ``log p(continuation | context)`` is estimated by the
model's ELBO (LLaDA paper, Eq. 6; ``ML-GSAI/LLaDA`` ``eval_llada.py``, ``get_loglikelihood``). Each Monte-Carlo
sample draws a mask count ``l`` in ``1..L`` (``L`` = continuation tokens), masks ``l`` continuation positions
uniformly at random (the context is never masked), runs one full forward pass and adds the cross-entropy of
the masked positions weighted by ``L / l``. The estimate is minus the mean over ``mc_num`` samples. As in the
reference, the ``l`` of the samples in one forward batch are stratified: ``l_j = ((k + j * L / b) - 1) mod L + 1``
for a random start ``k`` (lower variance than independent draws).

Departures from the reference, on purpose:
- Randomness comes from a ``torch.Generator`` seeded by ``seed`` and the request's tokens, so a request's
  estimate does not depend on which other requests are scored with it, on the batch size or on the order.
- ``is_greedy`` (``greedy_check``) reveals the masked continuation one most-confident token per forward pass, as
  the reference's ``suffix_greedy_prediction``; it costs ``L`` forward passes and is off by default, as the
  reference recommends.
- A single forward pass has no reused K/V, so cache mode and KV quantization do not apply to likelihoods.

**Per-token values of a whole prompt** (:class:`PromptLikelihood`, the server's ``echo`` + ``logprobs``,
issue 25): a client such as lm-eval's ``local-completions`` sends context and continuation as one token list
and sums the returned values from its own split ``c`` on (``token_logprobs[c:]``); the server does not know
``c``. So it estimates ``E_c`` = this module's ELBO of ``x[c:]`` given ``x[:c]`` for **every** split ``c`` in
``1..T-1`` (the same draws as :func:`mc_loglikelihood`: seeded by the split's own context and continuation) and
returns ``v_i = E_i - E_{i+1}`` (``E_T = 0``) for token ``i``: whatever the split, ``sum(v[c:]) = E_c``, the
in-process value, up to float rounding. A ``v_i`` is an ELBO increment, not a conditional log-probability of one
token (it may even be positive). Its ``top`` alternatives are the model's log-probabilities at position ``i``
when ``x[:i]`` is given and ``x[i:]`` is masked (the first reveal step of that position). Cost: ``T - 1``
estimates of ``mc_num`` samples of ``T`` tokens, plus ``T - 1`` rows for the alternatives.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from service.engine.forward_cost import ForwardCost, likelihood_work
from service.engine.report import TokenLogprob

#: ``logits_fn(ids)``: ids ``[B, T]`` int64 -> logits ``[B, T, V]`` float where ``logits[:, i]`` scores the token
#: at position ``i`` (the engine aligns Dream's shifted logits).
LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def request_generator(seed: int, context: list[int], continuation: list[int]) -> torch.Generator:
    """A CPU generator seeded by ``seed`` and the request's tokens (order- and batch-independent)."""
    digest = hashlib.sha256(repr((seed, list(context), list(continuation))).encode()).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return gen


def _masked_batch(seq: torch.Tensor, prompt_len: int, mask_id: int, gen: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One stratified noising of ``b`` copies of ``seq`` ``[b, T]``: (noisy ``[b, T]``, mask ratio ``[b]``)."""
    b, total = seq.shape
    target_len = total - prompt_len
    k = int(torch.randint(1, target_len + 1, (), generator=gen))
    counts = torch.round(torch.linspace(float(k), k + (b - 1) * (target_len / b), steps=b)).long()
    counts = ((counts - 1) % target_len) + 1                                   # [b], each in 1..L
    is_mask = torch.zeros(b, total, dtype=torch.bool)
    for i in range(b):
        chosen = torch.randperm(target_len, generator=gen)[: int(counts[i])]
        is_mask[i, prompt_len + chosen] = True
    noisy = torch.where(is_mask, torch.full_like(seq, mask_id), seq)
    return noisy, counts.to(torch.float64) / target_len


def _check(continuation: list[int], mc_num: int, mc_batch_size: int) -> None:
    if not continuation:
        raise ValueError("continuation must contain at least one token")
    if mc_batch_size < 1 or mc_num < 1 or mc_num % mc_batch_size:
        raise ValueError(f"mc_num ({mc_num}) must be a positive multiple of mc_batch_size ({mc_batch_size})")


def noisings(context: list[int], continuation: list[int], mask_id: int, mc_num: int, mc_batch_size: int,
             seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The ``mc_num / mc_batch_size`` forward batches of the estimate: (clean ``[b, T]``, noisy ``[b, T]`` int64,
    mask ratio ``[b]`` float64), drawn from `request_generator` (module docstring)."""
    gen = request_generator(seed, context, continuation)
    seq = torch.tensor([list(context) + list(continuation)], dtype=torch.long).repeat(mc_batch_size, 1)
    for _ in range(mc_num // mc_batch_size):
        noisy, ratio = _masked_batch(seq, len(context), mask_id, gen)
        yield seq, noisy, ratio


def batch_loss(logits: torch.Tensor, seq: torch.Tensor, noisy: torch.Tensor, ratio: torch.Tensor, mask_id: int
               ) -> float:
    """One batch's term of the estimate: the weighted cross-entropy of the masked positions per sample.

    Args:
        logits: ``[b, T', V]`` logits of the last ``T'`` columns (every masked column among them).
        seq, noisy, ratio: a batch of :func:`noisings`.
    """
    start = seq.shape[1] - logits.shape[1]
    masked = noisy[:, start:] == mask_id
    ce = F.cross_entropy(logits.float().cpu()[masked], seq[:, start:][masked], reduction="none").double()
    weights = ratio.unsqueeze(1).expand_as(masked)[masked]
    return float((ce / weights).sum()) / seq.shape[0]


@torch.no_grad()
def mc_loglikelihood(logits_fn: LogitsFn, context: list[int], continuation: list[int], *, mask_id: int,
                     mc_num: int = 128, mc_batch_size: int = 32, seed: int = 1234,
                     device: torch.device | str = "cpu") -> float:
    """Monte-Carlo ELBO estimate of ``log p(continuation | context)`` in nats (module docstring).

    Args:
        logits_fn: full forward without cache (see `LogitsFn`).
        context, continuation: token ids; ``continuation`` must be non-empty.
        mask_id: the model's ``<mask>`` id.
        mc_num: Monte-Carlo samples (the reference's default 128); must be a multiple of ``mc_batch_size``.
        mc_batch_size: samples per forward pass.
        seed: base seed (see `request_generator`).

    Raises:
        ValueError: empty continuation, or ``mc_num`` not a positive multiple of ``mc_batch_size``.
    """
    _check(continuation, mc_num, mc_batch_size)
    losses = [batch_loss(logits_fn(noisy.to(device)), seq, noisy, ratio, mask_id)
              for seq, noisy, ratio in noisings(context, continuation, mask_id, mc_num, mc_batch_size, seed)]
    return -sum(losses) / len(losses)


@torch.no_grad()
def greedy_check(logits_fn: LogitsFn, context: list[int], continuation: list[int], *, mask_id: int,
                 device: torch.device | str = "cpu") -> bool:
    """Whether confidence-ordered greedy unmasking (one token per forward) reproduces ``continuation``."""
    seq = torch.tensor([list(context) + [mask_id] * len(continuation)], dtype=torch.long)
    for _ in range(len(continuation)):
        masked = seq[0] == mask_id
        logits = logits_fn(seq.to(device)).float().cpu()[0, masked]               # [m, V]
        probs = torch.softmax(logits, dim=-1)
        conf, tokens = probs.max(dim=-1)
        best = int(conf.argmax())
        positions = masked.nonzero().squeeze(1)
        seq[0, positions[best]] = tokens[best]
    return seq[0, len(context):].tolist() == list(continuation)


@dataclass(frozen=True)
class Call:
    """A likelihood's next model call (:meth:`PromptLikelihood.next_call`): ``rows`` rows of the prompt, from
    layer ``start`` on (0: a new forward; more: the rest of a forward split by layers), at unit ``at`` of the
    forward's work (`service.engine.forward_cost.likelihood_work`: ``2 x rows x T`` units a layer; 0: a new
    forward)."""

    rows: int
    start: int
    at: int = 0


@dataclass(eq=False)
class _Batch:
    """A batch of the work: ids ``[b, T]``, what to do with its logits, the rows given to forwards so far and
    the hidden states ``[n, T, C]`` of those through every layer (a batch cut over several forwards)."""

    ids: torch.Tensor
    use: Callable[[torch.Tensor], None]
    taken: int = 0
    hidden: list = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.ids.shape[0]


@dataclass(eq=False)
class _Flight:
    """A forward in flight: its input ``[rows, T]``, its rows as (batch, first row, count), the units of its work
    done (``at``, `service.engine.forward_cost.likelihood_work`) and the hidden states ``[rows, T, C]`` it reached
    (in a layer begun: its input, its query columns done updated in place), and in a layer begun its q
    ``[rows, H, T, D]``, k, v ``[rows, H_kv, T, D]`` (``qkv``)."""

    ids: torch.Tensor
    parts: list
    at: int = 0
    hidden: torch.Tensor | None = None
    qkv: tuple | None = None

    @property
    def columns(self) -> int:
        return self.ids.shape[0] * self.ids.shape[1]

    @property
    def start(self) -> int:
        """The first layer not yet run to its end."""
        return self.at // (2 * self.columns)


class PromptLikelihood:
    """The per-token values of one prompt (module docstring), computed a few batches per :meth:`step`, so that a
    server's worker interleaves them with its decoding iterations (under its memory admission and its token
    budget per iteration) and can stop them.

    Its work is a list of batches, each ``b`` rows of the whole prompt (a split's Monte-Carlo draws, or ``b``
    splits' alternatives); a :meth:`step` packs as many consecutive batches as its ``max_rows`` and ``max_bytes``
    allow into one forward (the splits of the prompt as rows of one forward, issue 34). The layers run once over
    all its rows; the LM head runs one batch at a time (the model's ``head=False``, then ``head_logits``), so
    the forward holds the logits of one batch, not of every row (:meth:`bytes`), and each batch's logits are
    the product the one-batch forward makes. The draws are made in the same order and each row's logits are its
    own, so the values are those of :func:`mc_loglikelihood` (the in-process model's own call, ``model(ids)``)
    up to float rounding of a larger matrix product (within 1e-6, `tests/engine/test_likelihood_rows.py`). It
    reuses no K/V, so it holds no store.

    In the server (issue 45 items 7-8) a forward is planned as decoding passes are: the worker asks for the next
    call (:meth:`next_call`: its rows, fixed by the task's bounds, `service.runtime.scheduler.likelihood_rows`) and
    runs a piece of it per iteration (``step(units=...)``, `service.runtime.scheduler.likelihood_piece`: whole
    layers, or parts of a layer: a row's projections, stretches of query columns), so an iteration holds about
    ``layer_split_tokens`` tokens' worth of likelihood work; the hidden states (and a layer's q/k/v) between
    pieces are held on the task (and counted with its memory, `service.runtime.loop.Worker._cost`). The values
    are those of the same forwards run whole, bit for bit (:meth:`step`).

    Args:
        model: the network; mask_id: its mask id; ids: the prompt's token ids (none the mask id).
        mc_num, mc_batch_size, seed: as :func:`mc_loglikelihood` (``mc_num`` a multiple of ``mc_batch_size``).
        top_k: alternatives per token (0: none).
        cancelled: polled before each model call; True ends the work (``cancelled`` becomes True).

    Raises:
        ValueError: an empty prompt, or ``mc_num`` not a multiple of ``mc_batch_size``.
    """

    def __init__(self, model, mask_id: int, ids: list[int], mc_num: int, mc_batch_size: int, seed: int,
                 top_k: int = 0, cancelled: Callable[[], bool] | None = None) -> None:
        if not ids:
            raise ValueError("the prompt must hold at least one token")
        _check([0], mc_num, mc_batch_size)
        self.model, self.mask_id, self.ids = model, mask_id, list(ids)
        self.mc_num, self.mc_batch_size, self.seed, self.top_k = mc_num, mc_batch_size, seed, top_k
        self.seq_len = len(ids)
        self._cancelled = cancelled
        self.device = model.embed.weight.device
        self._losses: dict[int, list[float]] = {c: [] for c in range(1, self.seq_len)}
        self._top: dict[int, tuple[tuple[int, float], ...]] = {}
        self._work = self._forwards()
        self._next: _Batch | None = None  # the batch the next forward takes rows of
        self._flight: _Flight | None = None  # a forward whose layers have not all run yet
        self.cost = ForwardCost.of(model)
        # A layer in two parts where the model has them (the fakes of the runtime tests run whole layers only).
        self.stages = self.cost.layer_stages(self.seq_len, model.config.num_layers,
                                             sublayer=hasattr(model, "finish_layer"))
        self.done = self.cancelled = False
        self.forwards = 0  # forwards through every layer
        self.calls = 0  # model calls (a forward split by layers is one call per piece)
        self.work = 0.0  # tokens' worth of work of every call (`likelihood_work`)
        self.last_rows = 0  # rows of the last forward

    @staticmethod
    def work_tokens(prompt_len: int, mc_num: int) -> int:
        """Token-forwards (rows x tokens over every forward) of a prompt of ``prompt_len`` tokens."""
        return (prompt_len - 1) * (mc_num + 1) * prompt_len

    def _forwards(self) -> Iterator[tuple[torch.Tensor, Callable[[torch.Tensor], None]]]:
        """Every forward's input ``[b, T]`` with what to do with its logits: each split's estimate, then the
        alternatives (``b`` splits per forward, each row with its split's tokens onward masked)."""
        for c in range(1, self.seq_len):
            for seq, noisy, ratio in noisings(self.ids[:c], self.ids[c:], self.mask_id, self.mc_num,
                                              self.mc_batch_size, self.seed):
                def loss(logits, c=c, seq=seq, noisy=noisy, ratio=ratio):
                    self._losses[c].append(batch_loss(logits, seq, noisy, ratio, self.mask_id))
                yield noisy, loss
        if self.top_k <= 0:
            return
        x = torch.tensor(self.ids, dtype=torch.long)
        for c0 in range(1, self.seq_len, self.mc_batch_size):
            splits = list(range(c0, min(c0 + self.mc_batch_size, self.seq_len)))
            rows = x.repeat(len(splits), 1)
            for j, c in enumerate(splits):
                rows[j, c:] = self.mask_id

            def top(logits, splits=splits):
                for j, c in enumerate(splits):
                    values, tokens = torch.log_softmax(logits[j, c].float(), -1).topk(self.top_k)
                    self._top[c] = tuple((int(t), float(v)) for t, v in zip(tokens.tolist(), values.tolist()))
            yield rows, top

    def _take(self) -> _Batch | None:
        """The next batch of the work, not yet given to a forward (None when none is left)."""
        if self._next is None:
            item = next(self._work, None)
            if item is None:
                return None
            self._next = _Batch(*item)
        return self._next

    def bytes(self, rows: int) -> int:
        """Transient bytes of a forward of ``rows`` rows of the prompt (`service.engine.forward_cost.ForwardCost`):
        every row's activations and K/V of one layer, and the float32 logits of one batch (``mc_batch_size`` rows
        at every column; the LM head runs one batch at a time, :meth:`step`)."""
        t = self.seq_len
        return self.cost.bytes(rows, t, t, 0) + self.cost.logits_bytes(self.mc_batch_size * t)

    def next_call(self, max_rows: int | None = None, max_bytes: int | None = None) -> Call | None:
        """The next model call: the rest of the forward in flight, or a new forward of the next rows, taken now.

        A new forward packs whole batches while its rows stay within ``max_rows`` and its transient bytes
        (:meth:`bytes`) within ``max_bytes`` (None: one batch; no byte bound); a batch larger than ``max_rows``
        alone is cut into forwards of ``max_rows`` rows (its LM head runs once all its rows are through the
        layers). The rows of a forward depend only on these bounds, never on what runs beside it. None once
        the work is done or cancelled (polled here)."""
        if self.done or self.cancelled:
            return None
        if self._cancelled is not None and self._cancelled():
            self.cancelled, self._flight = True, None
            return None
        if self._flight is not None:
            return Call(self._flight.ids.shape[0], self._flight.start, self._flight.at)
        parts: list[tuple[_Batch, int, int]] = []
        rows = 0
        while (batch := self._take()) is not None:
            left = batch.rows - batch.taken
            limit = left if max_rows is None else max_rows - rows
            whole = left <= limit and (max_bytes is None or self.bytes(rows + left) <= max_bytes)
            if parts and not whole:
                break  # batches are cut only when one alone is over the bounds
            n = left if whole else min(left, max(1, limit))
            parts.append((batch, batch.taken, n))
            batch.taken += n
            rows += n
            if batch.taken == batch.rows:
                self._next = None
            if max_rows is None or rows >= max_rows or not whole:
                break
        if not parts:
            return None
        ids = torch.cat([b.ids[a: a + n] for b, a, n in parts]) if len(parts) > 1 else \
            parts[0][0].ids[parts[0][1]: parts[0][1] + parts[0][2]]
        self._flight = _Flight(ids, parts)
        return Call(rows, 0)

    @torch.inference_mode()
    def step(self, max_rows: int | None = None, max_bytes: int | None = None,
             layers: tuple[int, int] | None = None, units: tuple[int, int] | None = None) -> bool:
        """Run the next call (:meth:`next_call` with these bounds): the units ``units`` of the forward in flight
        (`service.engine.forward_cost.likelihood_work`; `service.runtime.scheduler.likelihood_piece` chooses them),
        or its layers ``layers``, or (neither) all it has left; its hidden states ``[rows, T, C]`` are kept for
        the next call until its last layer, where the LM head runs for every batch whose rows are all through
        (``[b, T, V]``, one batch at a time).

        Whole layers run as the model's forward over those layers; a piece smaller than a layer runs the layer in
        its two parts (`service.engine.models.DiffusionLM.project_layer` over its columns, then ``finish_layer``
        over its query columns, each over whole rows or a stretch of one row), the layer's q/k/v held between
        calls. A forward run in pieces gives the values of the same forward run at once bit for bit: each part
        runs the same operations on the same values, per column (`tests/engine/test_likelihood_rows.py`).
        False once there is nothing left (or the work was cancelled): then ``done``.

        Raises:
            ValueError: ``units`` (or ``layers``) do not start where the forward in flight stopped, or split a
                layer on a model without its two parts.
        """
        call = self.next_call(max_rows, max_bytes)
        if call is None:
            self.done = True
            return False
        flight = self._flight
        num_layers = self.model.config.num_layers
        per_layer = 2 * flight.columns
        if units is None:
            units = (layers[0] * per_layer, layers[1] * per_layer) if layers is not None else \
                (flight.at, num_layers * per_layer)
        start, stop = units
        if start != flight.at:
            raise ValueError(f"the forward in flight continues at unit {flight.at}, not {start}")
        if start == 0 and stop == num_layers * per_layer:
            flight.hidden = self.model(flight.ids.to(self.device), head=False)    # [rows, T, C]
            flight.at = stop
        while flight.at < stop:
            layer, offset = divmod(flight.at, per_layer)
            if offset == 0 and stop >= (layer + 1) * per_layer:  # whole layers
                last = min(stop // per_layer, num_layers)
                flight.hidden = self.model(flight.ids.to(self.device), head=False, layers=(layer, last),
                                           hidden=flight.hidden)
                flight.at = last * per_layer
            else:
                self._part(flight, layer, offset, min(stop, (layer + 1) * per_layer) - layer * per_layer)
        self.calls += 1
        self.work += likelihood_work(flight.columns, units, self.stages)
        if stop < num_layers * per_layer:
            return True
        hidden = flight.hidden
        self._flight = None
        offset = 0
        for batch, _, n in flight.parts:
            batch.hidden.append(hidden[offset: offset + n])
            offset += n
            if sum(h.shape[0] for h in batch.hidden) == batch.rows:
                h = batch.hidden[0] if len(batch.hidden) == 1 else torch.cat(batch.hidden)
                batch.use(self.model.head_logits(h))                              # [b, T, V]
                batch.hidden = []
        self.forwards += 1
        self.last_rows = call.rows
        return True

    def _qkv(self, rows: int, t: int, x: torch.Tensor) -> tuple:
        """Empty q ``[rows, H, T, D]``, k, v ``[rows, H_kv, T, D]`` for a layer's projections, with the RoPE
        tables of its columns (`service.engine.models.DiffusionLM.rope_columns`)."""
        c = self.model.config
        q = x.new_empty(rows, c.num_heads, t, c.head_dim)
        k, v = (x.new_empty(rows, c.num_kv_heads, t, c.head_dim) for _ in range(2))
        return (q, k, v, *self.model.rope_columns(t, x.device))

    def _part(self, flight: _Flight, layer: int, offset: int, end: int) -> None:
        """Units ``offset .. end`` of ``layer`` (offsets within the layer: its ``rows x T`` columns' projections,
        then as many query columns' rest) of the forward in flight, its state updated."""
        if not self.stages.sublayer:
            raise ValueError("this model runs whole layers only")
        rows, t = flight.ids.shape
        columns = rows * t
        if flight.hidden is None:  # the forward's first piece: the embedding (layers 0..0)
            flight.hidden = self.model(flight.ids.to(self.device), head=False, layers=(0, 0))
        x = flight.hidden
        if offset < columns:  # projections of columns offset .. : every column's before any query's attention
            if flight.qkv is None:
                flight.qkv = self._qkv(rows, t, x)
            q, k, v, cos, sin = flight.qkv
            for r0, r1, c0, c1 in _blocks(offset, min(end, columns), t):
                q[r0:r1, :, c0:c1], k[r0:r1, :, c0:c1], v[r0:r1, :, c0:c1] = self.model.project_layer(
                    layer, x[r0:r1, c0:c1], cos[:, :, c0:c1], sin[:, :, c0:c1])
            offset = min(end, columns)
        if end > columns:  # the rest of query columns offset - columns .. (in place: their input is read once)
            q, k, v, _, _ = flight.qkv
            for r0, r1, c0, c1 in _blocks(offset - columns, end - columns, t):
                x[r0:r1, c0:c1] = self.model.finish_layer(layer, x[r0:r1, c0:c1], q[r0:r1, :, c0:c1], k[r0:r1],
                                                          v[r0:r1])
        flight.at = layer * 2 * columns + end
        if end == 2 * columns:
            flight.qkv = None  # the layer is done: its q/k/v are not needed again

    def scores(self) -> list[TokenLogprob]:
        """The values of tokens ``1..T-1`` (token 0 has none: nothing precedes it), once done: ``logprob`` the ELBO
        increment, ``top`` the first reveal step's alternatives (module docstring)."""
        elbo = {c: -sum(v) / len(v) for c, v in self._losses.items()}
        elbo[self.seq_len] = 0.0
        return [TokenLogprob(token=self.ids[i], logprob=elbo[i] - elbo[i + 1], top=list(self._top.get(i, ())))
                for i in range(1, self.seq_len)]


def _blocks(a: int, b: int, width: int) -> Iterator[tuple[int, int, int, int]]:
    """Columns ``a .. b`` of rows of ``width`` columns laid end to end, as blocks ``(r0, r1, c0, c1)``: whole rows
    ``r0 .. r1`` (all columns), or a stretch ``c0 .. c1`` of row ``r0`` (``r1 = r0 + 1``)."""
    while a < b:
        r, c = divmod(a, width)
        if c == 0 and b - a >= width:
            r1 = r + (b - a) // width
            yield r, r1, 0, width
            a = r1 * width
        else:
            c1 = min(width, c + b - a)
            yield r, r + 1, c, c1
            a += c1 - c


@dataclass(frozen=True)
class LikelihoodTask:
    """A job's request for the per-token values of one prompt (module docstring), run by the server's worker
    (`service.runtime.loop.Job.task`): what it costs, and its :class:`PromptLikelihood` once it joins a batch."""

    ids: tuple[int, ...]
    mc_num: int
    mc_batch_size: int
    seed: int
    top_k: int

    @property
    def work(self) -> int:
        """Token-forwards of every pass (for the server's work ceiling)."""
        return PromptLikelihood.work_tokens(len(self.ids), self.mc_num)

    def transient_bytes(self, forward_cost) -> int:
        """Bytes of its largest forward (`service.engine.forward_cost.ForwardCost.bytes`): ``mc_batch_size`` rows
        of the whole prompt with logits at every column (the in-process model's call)."""
        t = len(self.ids)
        return forward_cost.bytes(self.mc_batch_size, t, t, t)

    def cohort(self, engine, cancelled: Callable[[], bool] | None = None) -> PromptLikelihood:
        """Its work on ``engine`` (`service.engine.Engine.likelihood`)."""
        return engine.likelihood(list(self.ids), self.mc_num, self.mc_batch_size, self.seed, self.top_k, cancelled)
