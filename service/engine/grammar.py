"""Structured output: grammars that bind the reveal (issue 26).

A request may ask that its response follow a JSON schema, any JSON object, a regular expression or one of a list
of strings. The token-level constraint comes from llguidance (chosen on measured compile and mask speed, its
resource limits and its token-mask API: `benchmarks/grammar_engines.py`, docs/benchmarks.md):

* :class:`GrammarSpec` says what a request asks (kind, canonical source, the request field it came from);
* :class:`GrammarCompiler` turns it into a :class:`CompiledGrammar`, bounded before it compiles (the source's bytes
  and its positions: the characters it spells out with repetitions multiplied out, `service.engine.grammar_size`,
  so a grammar that would take seconds and hundreds of MB never reaches a compile thread; a tool call's grammar
  counts each argument schema it embeds, :attr:`GrammarSpec.parts`), in time (a wall-clock limit on a compile
  thread, counted from when the thread takes it up, off the event loop; small grammars compile in a lane of their
  own, so large ones, however slow, never delay them: :data:`SMALL_POSITIONS`; large ones wait in a queue of at
  most :data:`LARGE_LANE_QUEUE`) and in work and
  memory (llguidance's parser limits: lexer fuel, lexer states, grammar size; a grammar the engine fails on at text
  every response starts with is refused while compiling, issue 45), cached by the spec's hash in an LRU
  bounded in entries and in bytes (each entry's resident memory growth while it compiled); a source it cannot
  compile is an :class:`~service.engine.errors.EngineInputError` naming the request field and the limit (HTTP 400);
* the tokenizer is read for text with special tokens off (:class:`_TextVocabulary`): a value that spells a special
  token is written with text tokens;
* :class:`GrammarState` is one row's matcher (a copy of the compiled grammar), advanced token by token;
* :func:`constrained_reveal` decides the chains (below) of all constrained rows of one forward together, across
  requests; the running batch (`service.engine.batch.RunningBatch`) then hands each chain to the batched reveal
  (`service.engine.reveal.reveal_batch`) as exactly those columns, so constrained and unconstrained rows share
  the forward, the reveal and the iteration's one host read.

**The constrained reveal.** A diffusion LM reveals masked positions out of order; a grammar says which tokens may
follow a prefix. A constrained row therefore commits its active block left to right: at each call it takes the
leftmost masked position and the positions after it, in order, while they are accepted:

* the token of a position is chosen among the tokens the grammar allows after the tokens before it (argmax of
  the logits there, or a Gumbel-max draw from them at temperature > 0, with the row's generator);
* its confidence is that token's probability **under the constraint** (softmax over the allowed tokens only);
* the first position is always accepted (every call reveals at least one token); a later one when the grammar
  forces it (exactly one token allowed: punctuation, a schema's keys, a fixed separator), or, under a threshold,
  when its confidence reaches the threshold, or, under a fixed schedule, while the step's count is not reached.

So the forced parts of a format cost no forward calls, and where the model is confident under the constraint
several positions are revealed in one call, as unconstrained threshold decoding does; the chain stops at the
first position that is neither. After the grammar's accepting end only EOS is allowed (the model's EOS ids: its
EOS and end of turn), and a row that revealed it stops as any row does.

DINGO (2025) instead runs a dynamic programme over the regular expression's automaton across all of a block's
masked positions and commits the most probable valid block in one call. That needs a finite automaton (no JSON
nesting beyond a bound) and commits positions the model was not confident about; the chain here needs only the
next-token masks that any context-free grammar gives, keeps the confidence rule of threshold decoding, and pays
one mask per revealed position. Where the model is confident (the digit-ledger's ``copy``/``next``) it reveals
as many positions per call as unconstrained decoding; where it is not (``sum``), both reveal about one.

Departures from the family's own reveal, for constrained rows only: one rule for LLaDA and Dream (the chain
above, confidences in float64), and the positions revealed are contiguous from the left, never scattered; a
fixed schedule's count is the family's (LLaDA's even split, Dream's timestep share, 1 at Dream's block-initial
pass), at least one.

**Every constrained response closes within its positions (issue 45).** A diffusion LM decodes a canvas of known
length, so a row knows how many positions are left (its *budget*: ``min(gen_length, max_tokens + 1)`` response
positions, the last for the EOS that `service.engine.response.cut_response` still reads as ``stop``). Each
:class:`GrammarState` holds a *closing path*: tokens the grammar accepts from where it is to its end, EOS
included, that fit in what is left. A token the model chooses is kept when a closing path from after it still
fits (the old path, checked with llguidance's ``validate_tokens``, one cheap call; else a new one found by
:meth:`GrammarCompiler.closing_path`); otherwise the path's next token is revealed instead. So the path always
fits, and the response always ends complete and valid, EOS included, within ``max_tokens``. A request whose
grammar's closing path from the start does not fit is refused before decoding (:meth:`CompiledGrammar.fits`).

Why a closing path and not a length-bounded grammar: llguidance has no "shortest completion" query, and
intersecting the grammar with a length bound (``max_tokens`` on its rules) needs a new compile per remaining
length. The path is a witness: a real token sequence the matcher accepted, so keeping one that fits is exact
(never a cut response), and it costs nothing while the model follows it (forced tokens, closing punctuation) and one
``validate_tokens`` call while the old path still closes after the model's token (string and number content). A new
path is searched only after a structural choice (a key, a value's start), by a greedy walk over the grammar's own
masks: llguidance's forced tokens (``compute_ff_tokens``) where it forces any, else the allowed token ranked
closest to an end (closing quotes and brackets, the longest first; then ``0``; then punctuation that ends a
lexeme; then letters and digits; opening brackets last; a token used in the walk already ranks lower, so a loop
such as ``a+b`` still ends). The walk is an upper bound on the shortest completion (it may take a few tokens more
than the shortest, e.g. ``""`` for a free value where ``0`` is one byte shorter), so a refusal may come a few
positions early; it never lets a response be cut. A grammar whose walk does not end within
:data:`CLOSE_SEARCH_TOKENS` (a regex the ranking cannot steer) is decoded as before, unbounded.

**A grammar that fails mid-decode fails its row alone.** The checks before decoding (`service.engine.schema_values`,
the first-token check) cannot prove every grammar completable: llguidance may still reach its work limit deep in a
response (a branch that is only entered after some tokens and can never end, e.g. ``[12345, {"a": {"a": ...``
forced forever, "Too many items"), or allow no token at a position. :func:`constrained_reveal` then gives that
row a :class:`GrammarViolation` naming the request field (its ``error``) and stops its chain there, while every
other row's chain goes on as it would alone; the running batch fails that request only (HTTP 400,
``structured_output_failed``) rather than end it invalid.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Literal

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from service.engine.errors import EngineInputError, GrammarLaneFull
from service.engine.grammar_size import first_row_items, grammar_positions
from service.engine.params import response_length
from service.engine.schema_values import has_finite_value

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]

#: JSON output as OpenAI and vLLM write it (``{"a": 1, "b": [2, 3]}``): fixed separators and no free whitespace,
#: so the separators are forced tokens (revealed without a forward of their own) and a model cannot pad forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: Largest grammar source accepted, in bytes of its canonical text (a schema's JSON, a regex, the choices' JSON).
MAX_SOURCE_BYTES = 256 * 1024
#: Most positions a grammar may spell out (`service.engine.grammar_size`: ~350 bytes and ~4 us of compile each, so
#: at most ~6 MB, and well under 0.1 s for a regex; ``\d{1,5000}`` is 5,000, ``a{1000}{1000}`` a million).
MAX_GRAMMAR_POSITIONS = 16_384
#: Compiled grammars kept per compiler (an LRU; each holds llguidance's parser tables, ~kilobytes to a few MB)...
CACHE_SIZE = 256
#: ...and the most bytes they may hold together (each entry counted as the resident memory its compile added).
CACHE_BYTES = 256 << 20
#: Seconds a compile may take before the request is refused (a 200-property schema takes ~20 ms on one core; a schema
#: under the size limits can still take seconds: 2,500 optional properties ~3 s, `benchmarks/hostile_grammars.py`).
COMPILE_TIMEOUT_S = 5.0
#: Grammars of at most this many positions and :data:`SMALL_SOURCE_BYTES` compile in the small lane, on
#: :data:`SMALL_LANE_THREADS` threads of their own (milliseconds each); larger ones in the large lane, one thread,
#: where a slow compile (llguidance's compile cannot be stopped; it runs on past the time limit, bounded by the size
#: limits and its fuel) delays only other large grammars. llguidance releases the GIL while it compiles.
SMALL_POSITIONS = 1024
SMALL_SOURCE_BYTES = 4096
SMALL_LANE_THREADS = 4
#: Large compiles that may wait for the large lane (besides the one compiling); one more is refused at once (HTTP
#: 429, `service.engine.errors.GrammarLaneFull`). :data:`COMPILE_TIMEOUT_S` counts from a compile's start, never
#: its wait (issue 45, N3: after 20 large schemas a 0.12 s one was refused as "longer than 5 s to compile"), so the
#: wait is bounded here instead: at most this many compiles ahead, each bounded by the size limits and llguidance's
#: fuel.
LARGE_LANE_QUEUE = 4
#: Longest closing path searched for a grammar's start (module doc): one mask per token, at compile time.
CLOSE_SEARCH_TOKENS = 4096
#: llguidance's bounds on one grammar's work and memory (its defaults are 1M initial lexer fuel ~20 ms, 250k lexer
#: states ~0.5 GB, grammar size 500k): tighter here, so a hostile schema fails fast and small.
PARSER_LIMITS = {"initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000, "step_max_items": 50_000,
                 "max_lexer_states": 50_000, "max_grammar_size": 200_000}


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asks its response to follow.

    Attributes:
        kind: ``json_schema``, ``json_object`` (any JSON object), ``regex`` (the whole response matches it, Rust
            regex syntax), ``choice`` (exactly one of the strings) or ``lark`` (llguidance's Lark grammar, as
            `service.engine.tool_format.call_grammar` writes it for tool calls).
        source: the canonical text (a schema or the choices as compact JSON, the regex as given). A schema keeps
            its properties' order: the grammar writes an object's keys in that order, as OpenAI's structured
            outputs and vLLM do, so two schemas that differ only in that order are different grammars.
        field: the request field it came from, named by a refusal (e.g. ``response_format.json_schema.schema``).
        parts: the specs a ``lark`` grammar embeds (a tool call's argument schemas, each naming its
            ``tools.{i}.function.parameters``): held to the same size limit as when sent on their own (issue 45,
            N4), and the one over it is named. Not part of the key: the source already holds them.
    """

    kind: GrammarKind
    source: str
    field: str
    parts: tuple[GrammarSpec, ...] = field(default=(), compare=False)

    @property
    def key(self) -> str:
        """Hex SHA-256 of kind and source: the cache key (the field does not change the grammar)."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, field: str) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), field)

    @classmethod
    def json_object(cls, field: str) -> GrammarSpec:
        return cls("json_object", '{"type":"object"}', field)

    @classmethod
    def regex(cls, pattern: str, field: str) -> GrammarSpec:
        return cls("regex", pattern, field)

    @classmethod
    def choice(cls, choices: Sequence[str], field: str) -> GrammarSpec:
        return cls("choice", json.dumps(list(choices)), field)

    @classmethod
    def lark(cls, grammar: str, field: str, parts: Sequence[GrammarSpec] = ()) -> GrammarSpec:
        return cls("lark", grammar, field, tuple(parts))

    def grammar(self) -> str:
        """llguidance's grammar text for this spec (not yet checked: :class:`GrammarCompiler` does)."""
        if self.kind in ("json_schema", "json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        choices = json.loads(self.source)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


class CompiledGrammar:
    """A compiled grammar, shared by every request that asks for the same spec; :meth:`start` gives a row its own
    state. Hashable by identity (rows carry it in `service.engine.params.RowOptions`)."""

    def __init__(self, spec: GrammarSpec, matcher: llguidance.LLMatcher, compiler: GrammarCompiler,
                 nbytes: int = 0, start_path: list[int] | None = None) -> None:
        self.spec, self._matcher, self.compiler = spec, matcher, compiler
        self.nbytes = nbytes  # resident bytes its compile added (an estimate of what it holds; 0 when unknown)
        # A closing path from the start (module doc), EOS included; None: none found within CLOSE_SEARCH_TOKENS.
        self.start_path = start_path

    @property
    def min_tokens(self) -> int | None:
        """Response positions the grammar's closing path from the start takes, its EOS included (an upper bound
        on the shortest complete response; None when no path was found: the grammar is decoded unbounded)."""
        return None if self.start_path is None else len(self.start_path)

    def fits(self, max_tokens: int, block_length: int) -> None:
        """Refuse, before decoding, a request whose response cannot close in its positions (module doc).

        Args:
            max_tokens: the request's ``max_tokens`` (tokens, >= 1); block_length: its block length (its decode
                window is ``max_tokens`` rounded up to whole blocks: `service.engine.params.response_length`).

        Raises:
            EngineInputError: naming ``max_tokens``, with the least that fits: the closing path from the start
                needs more positions than :func:`budget` gives.
        """
        need = self.min_tokens
        if need is None or self._room(max_tokens, block_length) >= need:
            return
        least = max(1, need - 1)
        while self._room(least, block_length) < need:
            least += 1
        raise EngineInputError(
            f"max_tokens {max_tokens} cannot hold a complete response to {self.spec.field}: the shortest one found "
            f"is {need - 1} tokens and its end (EOS) one position more; raise max_tokens to at least {least}",
            "max_tokens")

    @staticmethod
    def _room(max_tokens: int, block_length: int) -> int:
        return budget(max_tokens, response_length(max_tokens, block_length))

    def start(self, max_tokens: int | None = None, gen_length: int | None = None) -> GrammarState:
        """A fresh state at the start of the response (its failures name :attr:`spec`'s field), bound to close in
        the :func:`budget` of ``max_tokens`` and ``gen_length`` (both None: unbounded). A budget the start's path
        does not fit (a caller that skipped :meth:`fits`) leaves the row unbounded, as before issue 45."""
        state = GrammarState(self._matcher.deep_copy(), self.compiler, self.spec.field)
        positions = budget(max_tokens, gen_length)
        if positions is not None and self.start_path is not None and len(self.start_path) <= positions:
            state.positions, state.path = positions, list(self.start_path)
        return state

    def for_field(self, field: str) -> CompiledGrammar:
        """The same grammar (shared parser tables) as asked by another request field (the cache ignores the
        field; a failure mid-decode names the field of the request that decodes it)."""
        if field == self.spec.field:
            return self
        return CompiledGrammar(GrammarSpec(self.spec.kind, self.spec.source, field), self._matcher, self.compiler,
                               self.nbytes, self.start_path)

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.spec.kind}, {self.spec.key[:12]})"


class GrammarState:
    """One row's position in its grammar: the tokens consumed so far decide the next mask. ``field`` is the request
    field the grammar came from (named by a :class:`GrammarViolation`)."""

    def __init__(self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler, field: str | None = None) -> None:
        self.matcher, self.compiler, self.field = matcher, compiler, field
        self.ended = False  # an EOS was consumed: only EOS follows
        self.consumed = 0  # tokens the matcher took (what :meth:`restore` rolls back): the next response position
        # The positions the response must close in and a closing path that fits (module doc); None: unbounded.
        self.positions: int | None = None
        self.path: list[int] | None = None

    def consume(self, token: int) -> None:
        """Advance by one revealed token (any of the model's EOS ids counts as the grammar's EOS).

        Raises:
            GrammarViolation: the grammar does not take ``token`` here: llguidance failed while consuming it (its
                work limit: computing the tokens it forces next can exceed its items limit) or refused it.
        """
        if token in self.compiler.eos_ids:
            if self.ended:
                return  # padding after the end
            token, self.ended = self.compiler.grammar_eos, True
        if self.matcher.consume_token(token):
            self.consumed += 1
        else:
            raise self.violation(f"the grammar engine failed at token {token}: "
                                 f"{_first_line(self.matcher.get_error() or 'token refused')}")

    def consume_closing(self, token: int) -> int:
        """Advance by one revealed token while keeping a closing path that fits (module doc): ``token`` when a
        complete response still fits after it, else the closing path's next token. Unbounded (no path): as
        :meth:`consume`.

        Returns: the token consumed (what the position reveals).

        Raises:
            GrammarViolation: as :meth:`consume`.
        """
        eos = self.compiler.eos_ids
        if self.path is None or self.ended or not self.path:
            self.consume(token)
            return token
        if token == self.path[0] or (token in eos and self.path[0] in eos):
            self.consume(token)
            self.path = self.path[1:]
            return token
        room = self.positions - self.consumed - 1  # positions after this one
        self.consume(token)
        if token in eos:
            self.path = []
            return token
        if len(self.path) <= room:
            self.compiler.closing_checks += 1
            if self.matcher.validate_tokens(self.path) == len(self.path):
                return token  # the old path still closes (string and number content)
        found = self.compiler.closing_path(self.matcher, room)
        if found is not None:
            self.path = found
            return token
        # No complete response fits after the model's token: undo it and take the path's next one instead.
        self.matcher.rollback(1)
        self.consumed -= 1
        forced, self.path = self.path[0], self.path[1:]
        self.consume(forced)
        return forced

    def mark(self) -> tuple[int, bool, list[int] | None]:
        """The position now, for :meth:`restore`."""
        return self.consumed, self.ended, self.path

    def restore(self, mark: tuple[int, bool, list[int] | None]) -> None:
        """Go back to ``mark`` (a reveal that raised is undone before its passes run again alone: llguidance's
        rollback of the tokens consumed since)."""
        consumed, ended, path = mark
        if self.consumed > consumed:
            self.matcher.rollback(self.consumed - consumed)
        self.consumed, self.ended, self.path = consumed, ended, path

    def violation(self, detail: str) -> GrammarViolation:
        """The :class:`GrammarViolation` of this row failing mid-decode, ``detail`` saying how."""
        where = self.field or "the grammar"
        return GrammarViolation(f"the response could not satisfy {where}: it passed the checks made before decoding, "
                                f"but failed mid-decode ({detail}); simplify it (e.g. drop a branch that can never "
                                "end, or deep nesting)", self.field)

    @property
    def accepting(self) -> bool:
        """True when the tokens so far are a complete response (EOS is allowed now)."""
        return self.matcher.is_accepting()


class GrammarViolation(RuntimeError):
    """A row's grammar allows no token, or failed on one taken from its own mask (module doc): the request fails
    alone. ``field`` names the request field of the grammar (None when unknown); the API answers HTTP 400
    ``structured_output_failed`` with it as ``param``."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class GrammarCompiler:
    """Compiles :class:`GrammarSpec`\\ s for one tokenizer, bounded and cached (module docstring).

    Args:
        tokenizer: the model's transformers fast tokenizer.
        vocab_size: the logit width (ids at or beyond the tokenizer's size are never allowed).
        eos_ids: the model's EOS ids (`service.engine.spec.ModelSpec.eos_ids`); the first one the tokenizer knows
            is the grammar's EOS.
        cache_size: compiled grammars kept (LRU); cache_bytes: the most bytes they may hold together;
        timeout_s: seconds one compile may take; max_positions: the most positions a grammar may spell out.
        threads: threads of llguidance's executor that fills the masks of many rows at once.

    Building the tokenizer's token trie takes ~1 s for a 128k vocabulary: it is done on first use, in the compile
    thread (never on the event loop), and kept.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int], cache_size: int = CACHE_SIZE,
                 timeout_s: float = COMPILE_TIMEOUT_S, threads: int | None = None, cache_bytes: int = CACHE_BYTES,
                 max_positions: int = MAX_GRAMMAR_POSITIONS) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, tuple(eos_ids)
        self.cache_size, self.cache_bytes, self.timeout_s = cache_size, cache_bytes, timeout_s
        self.max_positions = max_positions
        self.compiles_started = 0  # compiles handed to the compile thread (refusals before it are not counted)
        self._large_waiting = 0  # large compiles handed to the large lane and not yet taken up (LARGE_LANE_QUEUE)
        self.grammar_eos = self.eos_ids[0] if self.eos_ids else tokenizer.eos_token_id
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._small_pool = ThreadPoolExecutor(max_workers=SMALL_LANE_THREADS, thread_name_prefix="grammar-compile-small")
        self._tokenizer_lock = threading.Lock()  # the two lanes build the trie once
        self.threads = threads or max(1, min(4, (os.cpu_count() or 1) // 2))
        self._executor: llguidance.LLExecutor | None = None
        self.limits = llguidance.LLParserLimits(**PARSER_LIMITS, verbose_errors=False)
        self._words = (vocab_size + 31) // 32
        self._rank: np.ndarray | None = None  # the closing walk's token ranks (built on first use)
        # What keeping responses closable costs (`benchmarks/structured_cost.py`): closing walks, the masks they
        # computed, and checks of an old closing path after a model's token (llguidance's validate_tokens).
        self.closing_walks = self.closing_masks = self.closing_checks = 0

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer: a transformers fast tokenizer is read whole (its byte-level
        vocabulary, special tokens); any other tokenizer through the text of each id (ids that decode to nothing
        count as special, never allowed)."""
        with self._tokenizer_lock:
            return self._built_tokenizer()

    def _built_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            if isinstance(self.tokenizer, PreTrainedTokenizerFast):
                self._ll_tokenizer = llguidance.LLTokenizer(_TextVocabulary(self.tokenizer, self.vocab_size,
                                                                            self.grammar_eos),
                                                            n_vocab=self.vocab_size)
            else:
                self._ll_tokenizer = llguidance.LLTokenizer(_DecodedVocabulary(self.tokenizer, self.vocab_size,
                                                                               self.grammar_eos),
                                                            n_vocab=self.vocab_size)
        return self._ll_tokenizer

    @property
    def executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=self.threads)
        return self._executor

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec``, from the cache or compiled in the compile thread within
        ``timeout_s`` (blocks the caller; call it off the event loop).

        Raises:
            EngineInputError: naming ``spec.field`` and the limit: the source is too large, spells out more than
                ``max_positions`` (both before compiling; a part over it names the part's field), is invalid (the
                engine's message), over the parser's limits, took longer than ``timeout_s`` from its start,
                allows no first token, fails in the engine at text every response starts with, or is a JSON
                schema that no finite value satisfies.
            GrammarLaneFull: a large grammar while :data:`LARGE_LANE_QUEUE` large ones wait (nothing queued).
        """
        if len(spec.source.encode()) > MAX_SOURCE_BYTES:
            raise EngineInputError(f"{spec.field} is {len(spec.source.encode()):,} bytes, over the "
                                   f"{MAX_SOURCE_BYTES:,} bytes a grammar may have", spec.field)
        with self._lock:
            found = self._cache.get(spec.key)
            if found is not None:
                self._cache.move_to_end(spec.key)
                return found.for_field(spec.field)
        positions = grammar_positions(spec.kind, spec.source, self.max_positions)
        for part in spec.parts:  # a tool's argument schema counts as when sent alone, and is named
            positions += grammar_positions(part.kind, part.source, self.max_positions)
            if positions > self.max_positions:
                raise self._too_large(part)
        if positions > self.max_positions:
            raise self._too_large(spec)
        self._check_rows(spec)
        small = positions <= SMALL_POSITIONS and len(spec.source.encode()) <= SMALL_SOURCE_BYTES
        with self._lock:
            if not small and self._large_waiting >= LARGE_LANE_QUEUE:
                raise GrammarLaneFull(f"{spec.field} is a large grammar and {self._large_waiting} large grammars "
                                      "are waiting to compile (the most this server queues); retry shortly",
                                      spec.field, max(1, round(self.timeout_s)))
            self.compiles_started += 1
            self._large_waiting += 0 if small else 1
        begun: list[float] = []  # when the compile thread took it up (its time limit counts from there)
        ready = threading.Event()

        def job() -> CompiledGrammar:
            begun.append(time.monotonic())
            if not small:
                with self._lock:
                    self._large_waiting -= 1
            ready.set()
            return self._measured_compile(spec)

        future = (self._small_pool if small else self._pool).submit(job)
        ready.wait()  # bounded: at most LARGE_LANE_QUEUE compiles ahead (a small one: milliseconds)
        try:
            compiled = future.result(timeout=max(0.0, self.timeout_s - (time.monotonic() - begun[0])))
        except FutureTimeout:
            # The compile thread finishes on its own (the size limit and llguidance's fuel bound it; a small grammar's
            # lane never waits for it); this request is refused now, and the late result is not cached.
            raise EngineInputError(f"{spec.field} took longer than the {self.timeout_s:g} s compile time limit; "
                                   "simplify it", spec.field) from None
        if compiled.nbytes <= self.cache_bytes:
            with self._lock:
                self._cache[spec.key] = compiled
                self._cache.move_to_end(spec.key)
                while len(self._cache) > self.cache_size or self.cached_bytes() > self.cache_bytes:
                    self._cache.popitem(last=False)
        return compiled

    def _check_rows(self, spec: GrammarSpec) -> None:
        """Refuse, before it takes a compile lane, a JSON schema the engine is known to fail on at its first token
        (issue 45, N3): a plain object of more optional properties than llguidance's Earley row holds
        (`service.engine.grammar_size.first_row_items`; 499 without ``additionalProperties: false``). The compile
        would refuse it too, with the same reason (:meth:`_compile`'s walk), after its place in the lane.

        Raises:
            EngineInputError: naming ``spec.field``, the properties and the engine's row limit.
        """
        if spec.kind != "json_schema":
            return
        found = first_row_items(spec.source)
        limit = self.limits.max_items_in_row
        if found is not None and found[0] > limit:
            raise EngineInputError(
                f"{spec.field} is more than the grammar engine can decode: its {found[1]:,} optional properties "
                f"open {found[0]:,} items at the first token, where the engine's row holds {limit:,} (checked "
                f"before compiling); {_advice('items')}", spec.field)

    def _too_large(self, spec: GrammarSpec) -> EngineInputError:
        return EngineInputError(f"{spec.field} spells out more than {self.max_positions:,} positions (characters "
                                "with repetitions multiplied out: the grammar size limit, checked before "
                                "compiling); use smaller repetition counts or shorter literals", spec.field)

    def _measured_compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """:meth:`_compile`, with the resident memory it added as the result's ``nbytes`` (other threads' allocations
        in the meantime, a small grammar's compile among them, blur it, which the cache's byte bound tolerates: it is
        a ceiling on the order of hundreds of MB)."""
        before = _resident_bytes()
        compiled = self._compile(spec)
        compiled.nbytes = max(0, _resident_bytes() - before)
        return compiled

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        if spec.kind == "json_schema" and not has_finite_value(json.loads(spec.source)):
            # llguidance compiles these and allows their first token; decoding then fails at the parser's work
            # limit, deep in the response (`service.engine.schema_values`).
            raise EngineInputError(f"{spec.field} allows no response: no finite JSON value satisfies it (a "
                                   "required property or item that can only hold the schema it is in, such as "
                                   '{"$ref": "#"})', spec.field)
        try:
            grammar = spec.grammar()
        except (ValueError, TypeError) as exc:
            raise EngineInputError(f"{spec.field} cannot be compiled: {exc}", spec.field) from None
        try:
            ll_tokenizer = self.ll_tokenizer
        except ValueError as exc:  # llguidance cannot read this tokenizer (e.g. a WordPiece decoder)
            raise EngineInputError(f"{spec.field} cannot be honoured: this model's tokenizer cannot drive the "
                                   f"grammar engine, so its output cannot be constrained ({exc})", spec.field) from None
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise EngineInputError(f"{spec.field} cannot be compiled: {_first_line(matcher.get_error())}",
                                   spec.field)
        if not self.allowed([GrammarState(matcher.deep_copy(), self)]).any():
            # llguidance compiles a schema whose only value is infinitely deep ({"$ref": "#"}); no response
            # can follow it, and decoding it would fail at the first reveal.
            raise EngineInputError(f"{spec.field} allows no response: its grammar has no first token (a schema "
                                   "that only refers to itself, or an empty language)", spec.field)
        path, error = self._walk(matcher, CLOSE_SEARCH_TOKENS)
        if error is not None:
            # The engine failed on text every response starts with: decoding would fail there too (issue 45, N2:
            # 800 optional properties fail at the first token, "Current row has 3207 items; max is 2000": every
            # optional property is an open alternative at once).
            raise EngineInputError(
                f"{spec.field} is more than the grammar engine can decode: it fails at {error}; {_advice(error)}",
                spec.field)
        return CompiledGrammar(spec, matcher, self, start_path=path)

    def closing_path(self, matcher: llguidance.LLMatcher, limit: int) -> list[int] | None:
        """:meth:`_walk`'s path (None where it found none, or the grammar engine failed on the way)."""
        return self._walk(matcher, limit)[0]

    def _walk(self, matcher: llguidance.LLMatcher, limit: int) -> tuple[list[int] | None, str | None]:
        """A closing path from ``matcher``'s state (module doc): the tokens of a complete response's rest, its
        EOS (the grammar's) last, at most ``limit`` of them; None when the greedy walk finds none that short.
        The walk runs on a copy of ``matcher`` (a walk that reaches llguidance's work limit leaves it errored), so
        ``matcher`` is left as it was. Returns (the path or None, llguidance's error where it failed on the way
        while every token so far was forced: every response fails there; where it failed after a choice, other
        responses may not, and the error is None).

        Cost: one mask (llguidance's ``compute_bitmask``, a host numpy argmin over the vocabulary) per token the
        walk chooses; forced runs cost one ``compute_ff_tokens`` call each.
        """
        rank = self._close_rank()
        self.closing_walks += 1
        matcher = matcher.deep_copy()
        path: list[int] = []
        used: dict[int, int] = {}
        chose = False  # a token was chosen among several: a failure from here on is not every response's
        while len(path) < limit:
            if matcher.is_accepting():
                return [*path, self.grammar_eos], None
            forced = self._text_tokens(matcher.compute_ff_tokens() or [])[: limit - len(path)]
            if forced:
                taken = matcher.try_consume_tokens(forced)
                path.extend(forced[:taken])
                if taken == len(forced):
                    continue
            if matcher.is_error():
                return None, None if chose else _failed(path, matcher)
            allowed = self._mask(matcher)
            self.closing_masks += 1
            allowed[list(self.eos_ids)] = False  # not accepting: EOS cannot close here
            if not allowed.any():
                return None, _failed(path, matcher) if matcher.is_error() and not chose else None
            scores = np.where(allowed, rank, np.iinfo(np.int32).max)
            for token, times in used.items():  # a walk that loops (``a+b``) tries another token
                if allowed[token] and rank[token] >= _REPEATABLE:
                    scores[token] += 500 * times
            token = int(scores.argmin())
            chose = chose or int(allowed.sum()) > 1
            if not matcher.consume_token(token):
                return None, None if chose else _failed(path, matcher)
            path.append(token)
            used[token] = used.get(token, 0) + 1
        return None, None

    def _text_tokens(self, forced: list[int]) -> list[int]:
        """``forced`` up to its first special token: llguidance tokenizes forced text with the model's tokenizer,
        which reads text that spells a special token (``<|eot_id|>`` in an enum) as that token, one the grammar
        never takes (a value is text, issue 45 N6); the walk spells that text through the mask instead."""
        ll = self.ll_tokenizer
        for i, token in enumerate(forced):
            if ll.is_special_token(token):
                return forced[:i]
        return forced

    def _mask(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        """bool ``[vocab_size]``: the tokens ``matcher`` allows next (its raw mask, EOS as llguidance gives it)."""
        bitmask = torch.empty((1, self._words), dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        return np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[0, : self.vocab_size
                                                                                       ].astype(bool)

    def _close_rank(self) -> np.ndarray:
        """int32 ``[vocab_size]``: each token's rank for the closing walk, lower first (module doc), from its bytes;
        built once per compiler."""
        if self._rank is None:
            ll = self.ll_tokenizer
            rank = np.full(self.vocab_size, 9_999, dtype=np.int32)
            for i in range(min(self.vocab_size, ll.vocab_size)):
                if ll.is_special_token(i):
                    continue
                text = ll.decode_bytes([i])
                rank[i] = _token_rank(text)
            self._rank = rank
        return self._rank

    def cached(self) -> int:
        """Compiled grammars in the cache."""
        return len(self._cache)

    def cached_bytes(self) -> int:
        """Bytes the cached grammars hold (their compiles' resident growth; an estimate)."""
        return sum(c.nbytes for c in self._cache.values())

    def allowed(self, states: Sequence[GrammarState]) -> torch.Tensor:
        """bool ``[len(states), vocab_size]`` (CPU): the tokens each state allows next, its EOS widened to every
        EOS id of the model. The masks are filled together (llguidance's executor, in parallel threads) and
        unpacked on the host (numpy: a few microseconds; a handful of torch calls cost more at this size)."""
        bitmask = torch.empty((len(states), self._words), dtype=torch.int32)  # every word is written
        if len(states) == 1:
            llguidance.torch.fill_next_token_bitmask(states[0].matcher, bitmask, 0)
        else:
            llguidance.torch.fill_next_token_bitmask_par(
                self.executor, [(s.matcher, i) for i, s in enumerate(states)], bitmask)
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        allowed = allowed.astype(bool)
        for i, state in enumerate(states):
            # EOS only where the response is complete (llguidance also offers it where its tokenizer has no token
            # to go on with, which would end an invalid response with "stop"); after the end, only EOS (padding
            # the rest of the block); then every EOS id of the model.
            if state.ended:
                allowed[i] = False
                eos = True
            else:
                eos = bool(allowed[i, self.grammar_eos]) and state.matcher.is_accepting()
            allowed[i, list(self.eos_ids)] = eos
        return torch.from_numpy(allowed)


class _TextVocabulary(llguidance.TokenizerWrapper):
    """A transformers fast tokenizer as llguidance reads it (each id's exact bytes, its special tokens), except
    that text is tokenized with special tokens off: text that spells one (``<|eot_id|>`` in an enum, a const, a
    choice) is written with text tokens, never as the control token (issue 45, N6). Read through
    ``llguidance.hf.from_tokenizer`` directly, llguidance's forced-text tokenization turned that text into the
    special token, its mask then allowed only that token while its matcher refused it (an EOS id: no first token,
    a 400; another: the mask and the matcher disagreed)."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, vocab_size: int, eos: int) -> None:
        base = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        known = min(vocab_size, base.vocab_size)
        self.eos_token_id, self.bos_token_id = eos, None
        self.special_token_ids = [i for i in range(vocab_size) if i >= known or base.is_special_token(i)]
        self.tokens = [base.decode_bytes([i]) if i < known else b"" for i in range(vocab_size)]
        self.tokens = [t or f"<|special_{i}|>".encode() for i, t in enumerate(self.tokens)]
        self._backend = copy.copy(tokenizer.backend_tokenizer)
        self._backend.no_padding()
        self._backend.no_truncation()
        self._backend.encode_special_tokens = True  # text is text: never split into special tokens
        self.is_tokenizer_wrapper = True
        self._accepts_bytes = False

    def __call__(self, text: str) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=False).ids)


class _DecodedVocabulary(llguidance.TokenizerWrapper):
    """A tokenizer without a vocabulary file, as llguidance reads one: each id's bytes from its decoded text."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: int) -> None:
        texts = [tokenizer.decode([i]) for i in range(vocab_size)]
        self.eos_token_id, self.bos_token_id = eos, None
        self.special_token_ids = [i for i, t in enumerate(texts) if not t]
        self.tokens = [t.encode() if t else f"<|special_{i}|>".encode() for i, t in enumerate(texts)]
        self._tokenizer = tokenizer
        self.is_tokenizer_wrapper = True
        self._accepts_bytes = False

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])


def _failed(path: list[int], matcher: llguidance.LLMatcher) -> str:
    """Where and how a closing walk failed: after how many tokens, llguidance's error on one line."""
    return f"token {len(path) + 1} of a response ({_first_line(matcher.get_error() or 'token refused')})"


def _advice(error: str) -> str:
    """What to change in a grammar the engine fails on (`GrammarCompiler._compile`), from llguidance's error."""
    if "items" in error:  # its Earley row limit: alternatives open at one point
        return ("too many alternatives are open at one point (each optional property of an object is one until it "
                "is written): make fewer properties optional (required, with a type that admits null) or split the "
                "schema")
    return "simplify it"


def budget(max_tokens: int | None, gen_length: int | None) -> int | None:
    """Response positions a constrained response must close in, its EOS included (module doc): ``max_tokens``
    tokens and one more for the EOS, within the ``gen_length`` positions decoded; None when neither is given."""
    bounds = [b for b in (None if max_tokens is None else max_tokens + 1, gen_length) if b is not None]
    return min(bounds) if bounds else None


_CLOSERS = frozenset(b'"}]')
_OPENERS = frozenset(b"{[-")
#: Ranks below this (closing quotes and brackets) repeat in a walk without a penalty: ``}}]`` closes three levels.
_REPEATABLE = 256


def _token_rank(text: bytes) -> int:
    """A token's rank in the closing walk (module doc), lower first, from its bytes after any leading spaces (JSON
    writes ``": "`` before a value, so a value's first token often carries one): closing quotes and brackets (the
    longest first), one punctuation byte (``,`` ends a number), ``0``, other digits, letters and digits (the longest
    first), opening brackets and ``-``, other tokens, whitespace; a token with no bytes last."""
    if not text:
        return 9_999
    core = text.lstrip(b" ")
    longest_first = 255 - min(len(core), 255)
    if not core or any(chr(b).isspace() for b in core):
        return 6_000 + longest_first
    if all(b in _CLOSERS for b in core):
        return longest_first
    if len(core) == 1 and core[0] < 128 and not core.isalnum() and core[0] not in _OPENERS:
        return 900
    if core == b"0":
        return 1_000
    if len(core) == 1 and core.isdigit():
        return 1_100
    if core.isalnum():
        return 3_000 + longest_first
    if len(core) == 1 and core[0] in _OPENERS:
        return 4_000
    return 5_000 + longest_first


def _resident_bytes() -> int:
    """This process's resident memory in bytes (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _first_line(text: str, limit: int = 300) -> str:
    """The engine's error on one line, at most ``limit`` characters."""
    # llguidance ends its messages with a "<non-verbose/>" marker line when verbose errors are off.
    flat = " ".join(part.strip() for part in text.strip().splitlines()
                    if part.strip() and part.strip() != "<non-verbose/>") or "invalid grammar"
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


@dataclass
class ConstrainedRow:
    """One constrained row's part of a reveal.

    Attributes:
        state: the row's grammar state (advanced by the reveal); logits: ``[N, V]`` of its N masked candidates,
            ascending and contiguous from its leftmost masked position.
        count: positions a fixed schedule reveals this call (at least 1), or None under a threshold.
        threshold: the confidence threshold (None under a fixed schedule).
        temperature, generator: the row's sampling.
        start: the window column of the first candidate (where the caller needs it).
        chosen, tokens: what the reveal chose (indices into the candidates, their tokens).
        error: set when the row's grammar failed at this call (module doc); its chain stops there.
    """

    state: GrammarState
    logits: torch.Tensor
    count: int | None
    threshold: float | None
    temperature: float = 0.0
    generator: torch.Generator | None = None
    start: int = 0
    chosen: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    error: GrammarViolation | None = None


def constrained_reveal(rows: Sequence[ConstrainedRow], banned: torch.Tensor | None = None) -> None:
    """Reveal the chains of every constrained row of one call (module docstring), filling ``chosen`` and
    ``tokens`` and advancing each row's grammar state.

    Round k looks at the k-th candidate of every row whose chain is still open: one mask fill for all of them
    (:meth:`GrammarCompiler.allowed`), one batched choice and confidence, one host read. Each row's choice reads
    only its own logits, mask and generator, so a row decides as it would alone.

    Args:
        rows: the constrained rows (all of one model; each with at least one candidate).
        banned: int64 ids never chosen (the mask id, ids the tokenizer cannot decode), or None.

    A row whose grammar allows no token at its position, or fails on the token chosen there, gets a
    :class:`GrammarViolation` in its ``error`` and its chain ends; the other rows go on (nothing is raised for
    one row's grammar).
    """
    open_rows = [r for r in rows if r.logits.shape[0] > 0]
    k = 0
    while open_rows:
        compiler = open_rows[0].state.compiler
        allowed = compiler.allowed([r.state for r in open_rows])
        if banned is not None and banned.numel():
            allowed[:, banned.to(allowed.device)] = False
        logits = torch.stack([r.logits[k] for r in open_rows]).to(torch.float64)
        allowed = allowed.to(logits.device)
        scores = logits.masked_fill(~allowed, float("-inf"))
        log_probs = torch.log_softmax(scores, dim=-1)
        tokens = scores.argmax(dim=-1)
        for j, r in enumerate(open_rows):
            if r.temperature > 0:
                noise = torch.rand(scores.shape[1], dtype=torch.float64, generator=r.generator, device=scores.device)
                gumbel = -torch.log(-torch.log(noise.clamp_min(1e-300)))
                tokens[j] = (log_probs[j] / r.temperature + gumbel).argmax()
        confidence = log_probs.gather(-1, tokens[:, None])[:, 0].exp()
        counts = allowed.sum(dim=-1)
        token_list, confidence_list, count_list = tokens.tolist(), confidence.tolist(), counts.tolist()
        still_open = []
        for j, r in enumerate(open_rows):
            if count_list[j] == 0:
                error = _first_line(r.state.matcher.get_error() or "no token can follow the response so far")
                r.error = r.state.violation(f"the grammar allows no token here: {error}")
                continue
            forced = count_list[j] == 1
            if r.count is not None:
                accept = k == 0 or forced or k < r.count
            else:
                accept = k == 0 or forced or confidence_list[j] >= (r.threshold or 0.0)
            if not accept:
                continue
            try:  # the model's token, or the closing path's where no complete response fits after it
                token = r.state.consume_closing(token_list[j])
            except GrammarViolation as exc:
                r.error = exc
                continue
            r.chosen.append(k)
            r.tokens.append(token)
            if k + 1 < r.logits.shape[0]:
                still_open.append(r)
        open_rows = still_open
        k += 1


__all__ = ["CompiledGrammar", "ConstrainedRow", "GrammarCompiler", "GrammarSpec", "GrammarState",
           "GrammarViolation", "budget", "constrained_reveal"]
