"""Planning: an API request read against the model, its tokenizer and the server's settings, into the worker's
jobs (`Plan`); the model and tokenizer routes, which read the same way. `service.api.serving` runs the plan,
`service.api.answers` and `service.api.streaming` shape what comes back.

Rules it implements (issue #5, item 3):

* Decoding runs ``max_tokens`` rounded **up** to whole blocks, a family with a canvas to whole canvases whatever
  ``block_length`` (`service.engine.params.decode_window`); the
  response is cut once, by the engine's report (`service.engine.response.cut_response`).
* A request is admitted with one configuration snapshot: the one its ``kv_quant`` names, else the active
  configuration of its cache mode at admission.
* The engine's admission rules (prompt ids, context length, schedule, the family's limits) are checked once, here,
  where the request is made (`service.engine.engine.validate_request`, `Job.validated`).
"""

from __future__ import annotations

import ctypes
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from service.api import schemas as s
from service.api.errors import InvalidRequest, NotFound
from service.api.structured import CONSTRAINT_FIELDS
from service.api.tools import ToolRequest, conversation_calls
from service.config import Settings
from service.engine.engine import check_cache_mode, validate_request
from service.engine.errors import EngineInputError
from service.engine.grammar import CompiledGrammar, GrammarCompiler
from service.engine.likelihood import LikelihoodTask
from service.engine.models import configured_cache_mode
from service.engine.params import DecodeParams, RowOptions, decode_window
from service.engine.prompts import encode_chat, encode_prompt, encode_text, knows_tools
from service.engine.protocol import EngineLike
from service.engine.report import TokenLogprob
from service.engine.token_bound import max_bytes_per_token, min_tokens
from service.engine.tool_format import Function, generic_turns
from service.quant.config import KVQuantConfig
from service.quant.registry import method
from service.runtime.loop import Job
from service.store.active import ActiveConfigs, ConfigSnapshot
from service.store.base import AmbiguousId, ArtifactNotFound, InvalidName, StoreUnavailable, ids_matching
from service.store.config_check import ArtifactUnfit

Kind = Literal["completion", "chat", "generate"]

#: Texts longer than this (characters) are tokenized one at a time, in one thread of their own, which then hands
#: the freed memory back (glibc ``malloc_trim``). Tokenizing holds about 500 bytes per token for a moment (a 1 MB
#: prompt of 520k tokens, near the most a body may carry by default: 250 MB), and each thread's malloc arena keeps
#: what it once held: eight such requests at once took a 640 MB server to a 2.7 GB peak, one at a time in the
#: thread pool's threads still to 1.9 GB; in one thread with the trim, to a 1.0 GB peak and back to 0.77 GB.
#: Shorter texts are tokenized where they are and never wait.
LARGE_TEXT_CHARS = 64 * 1024


@dataclass
class Plan:
    """A validated request: its jobs (one per prompt and choice: choice ``k`` is prompt ``k // n``) and what
    shaping the answer needs.

    Attributes (issue 25): ``prompts`` the prompts' ids; ``logprobs`` the alternatives per returned token (None: no
    log-probabilities); ``echo`` the prompts' texts to put before each choice's text (None: no echo); ``scores``
    the jobs scoring each prompt's tokens (echo with logprobs), and ``scored`` their results once run; ``tools``
    whether the choices are read for tool calls (`service.api.tools`).
    """

    kind: Kind
    endpoint: str
    jobs: list[Job]
    stream: bool = False
    include_usage: bool = False
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    prompts: list[list[int]] = field(default_factory=list)
    n: int = 1
    logprobs: int | None = None
    echo: list[str] | None = None
    scores: list[Job] = field(default_factory=list)
    scored: list[list[TokenLogprob]] = field(default_factory=list)
    tools: bool = False
    tools_forced: bool = False  # tool_choice required or a named function: the response is calls only
    token_ids: bool = False  # each choice carries its prompt's and its own ids (``return_token_ids``)

    @property
    def all_jobs(self) -> list[Job]:
        """Every job to admit and wait for: the choices', then the scores'."""
        return [*self.jobs, *self.scores]


class Planner:
    """Turns API requests into jobs (see the module docstring)."""

    def __init__(self, engine: EngineLike, active: ActiveConfigs, settings: Settings, model_name: str) -> None:
        self.engine = engine
        self.active = active
        self.settings = settings
        self.spec = engine.spec
        self.model_name = model_name
        self._large_texts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize-large")
        self._bytes_per_token = max_bytes_per_token(getattr(engine, "tokenizer", None))
        tokenizer = getattr(engine, "tokenizer", None)
        # Structured output (`service.engine.grammar`): the tokenizer's trie is built on the first grammar request.
        self._grammars = None if tokenizer is None else GrammarCompiler(tokenizer, self.spec.vocab_size,
                                                                        self.spec.eos_ids)

    def _check_fits(self, texts: list[str]) -> None:
        """Refuse, before tokenizing, a text prompt that provably cannot fit the context
        (`service.engine.token_bound`; no bound for this tokenizer: nothing is refused here)."""
        for i, text in enumerate(texts):
            least = min_tokens(text, self._bytes_per_token)
            if least > self.spec.max_length:
                which = "prompt" if len(texts) == 1 else f"prompt {i}"
                raise InvalidRequest(
                    f"{which} is {len(text):,} characters: at least {least:,} tokens for this tokenizer (a token "
                    f"stands for at most {self._bytes_per_token} bytes of text), over the model's context of "
                    f"{self.spec.max_length} tokens", param="prompt")

    def _tokenize(self, chars: int, encode: Callable[..., list[int]], *args: Any) -> list[int]:
        """``encode(*args)`` of a text of ``chars`` characters: a large one (`LARGE_TEXT_CHARS`) in the one thread
        for large texts, after those before it."""
        if chars <= LARGE_TEXT_CHARS:
            return encode(*args)
        return self._large_texts.submit(_trimmed, encode, *args).result()

    # ---- models and tokenizer ----------------------------------------------------------------------------------------
    def models(self) -> s.ModelList:
        """``/v1/models``: the one served model."""
        # root: the public name, never the checkpoint's path (a host detail, issue 22).
        return s.ModelList(data=[s.ModelCard(id=self.model_name, max_model_len=self.spec.max_length,
                                             root=self.model_name)])

    def model(self, name: str) -> s.ModelCard:
        """``/v1/models/{name}``: the served model's card under its public name.

        Raises:
            NotFound: ``name`` is neither the served name nor the checkpoint's id.
        """
        self._check_model(name)
        return self.models().data[0]

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.spec.model_id):
            raise NotFound(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model")

    def _tokenizer(self, needed_for: str, param: str | None):
        """The engine's tokenizer for ``needed_for`` (what the request asked of it).

        Raises:
            InvalidRequest (400, ``param``): the checkpoint has none.
        """
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            raise InvalidRequest(f"{self.model_name} has no tokenizer, so it cannot {needed_for}", param=param)
        return tok

    def _chat_ids(self, messages: list[s.ChatMessage], add_generation_prompt: bool = True,
                  functions: tuple[Function, ...] = ()) -> list[int]:
        """The prompt of chat ``messages`` offering ``functions`` (the request's ``tools``): the one rendering of
        ``/v1/chat/completions`` and ``/tokenize``."""
        turns = [{"role": m.role, "content": m.text} for m in messages]
        declared = None
        if functions or any(m.tool_calls or m.role == "tool" for m in messages):
            turns, declared = self._tool_turns(messages, turns, functions)
        return self._tokenize(sum(len(t["content"] or "") for t in turns), encode_chat, self.engine.tokenizer,
                              turns, self.model_name, add_generation_prompt, "messages",
                              self.settings.allow_special_tokens_in_content, declared)

    def _tool_turns(self, messages: list[s.ChatMessage], turns: list[dict[str, Any]],
                    functions: tuple[Function, ...]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """A conversation with tools, calls or results as turns for the chat template, and the tools to hand it:
        OpenAI's shapes for a template that knows tools, else the generic format with no tools to hand
        (`service.engine.tool_format`)."""
        for i, (m, turn) in enumerate(zip(messages, turns, strict=True)):
            if m.tool_calls:
                turn["tool_calls"] = conversation_calls(m.tool_calls, f"messages.{i}.tool_calls")
            if m.role == "tool":
                turn["tool_call_id"] = m.tool_call_id
        if not knows_tools(getattr(self.engine, "tokenizer", None)):
            return generic_turns(turns, functions), None
        for turn in turns:  # OpenAI's call shape, arguments as an object (what the templates iterate over)
            if "tool_calls" in turn:
                turn["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                    "name": c["name"], "arguments": json.loads(c["arguments"])}} for c in turn["tool_calls"]]
        return turns, [f.declared() for f in functions] or None

    def _encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        return self._tokenize(len(text), encode_text, self.engine.tokenizer, text, self.model_name,
                              add_special_tokens)

    def tokenize(self, req: s.TokenizeRequest) -> s.TokenizeResponse:
        """``/tokenize``: ids of a prompt or of chat messages (``messages``, or a ``prompt`` that is a message list as
        lm-eval's remote tokenizer sends it; through the chat template, with the ``tools`` they offer: the prompt
        :meth:`plan_chat` makes of the same messages and tools). A text prompt that
        provably cannot fit the context is refused as on the generation routes: no request could use its ids, and
        tokenizing a megabyte of text takes ~200 MB for a moment."""
        self._check_model(req.model)
        messages = req.prompt if isinstance(req.prompt, list) else req.messages
        if messages is not None:
            ids = self._chat_ids(messages, req.add_generation_prompt, req.offered())
        else:
            self._check_fits([req.prompt])
            ids = self._encode(req.prompt, req.add_special_tokens)
        return s.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.spec.max_length)

    def detokenize(self, req: s.DetokenizeRequest) -> s.DetokenizeResponse:
        """``/detokenize``: the text of token ids."""
        self._check_model(req.model)
        size = self.spec.decodable_size
        bad = [i for i in req.tokens if not 0 <= i < size]
        if bad:
            raise InvalidRequest(f"token ids must lie in [0, {size}) (the tokenizer's size), got {bad[:5]}",
                                 param="tokens")
        return s.DetokenizeResponse(prompt=self._tokenizer("detokenize token ids", "tokens").decode(req.tokens))

    def tokenizer_info(self) -> dict[str, Any]:
        """What lm-eval's ``RemoteTokenizer`` reads (vLLM's ``/tokenizer_info`` fields)."""
        tok = self._tokenizer("describe its tokenizer", None)
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": getattr(tok, "unk_token", None),
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": self.spec.max_length,
            "vocab_size": self.spec.decodable_size,
            "logit_width": self.spec.vocab_size,
            "eos_token_ids": list(self.spec.eos_ids),
            "mask_token_id": self.spec.mask_id,
        }

    # ---- planning ------------------------------------------------------------------------------------------------
    def _check_ids(self, ids: list[int], param: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.spec.vocab_size]
        if bad:
            raise InvalidRequest(f"token ids must lie in [0, {self.spec.vocab_size}), got {bad[:5]}", param=param)

    def _params(self, req: s.DiffusionKnobs, max_tokens: int | None) -> tuple[DecodeParams, int]:
        """The request's `DecodeParams` and its ``max_tokens`` (given, else the server's default)."""
        max_tokens = max_tokens or self.settings.default_max_tokens
        # A family whose block is the checkpoint's canvas (DiffusionGemma) decodes ceil(max_tokens / canvas)
        # canvases: a block_length sized the window once (32 rounded max_tokens 1 up to two canvases of 16, 512 to
        # 32 of them). A client's other value is refused by name; the server's default is not used
        # (`service.commands.serve` refuses one the operator set to another value).
        gen_length, block = decode_window(max_tokens, req.block_length, self.spec.canvas_length,
                                          self.settings.block_length)
        params = req.decode_params(self.settings, gen_length)
        return params.model_copy(update={"block_length": block}), max_tokens

    def _snapshot(self, req: s.DiffusionKnobs, cache_mode: str) -> ConfigSnapshot:
        check_cache_mode(self.spec, cache_mode)  # before a store lookup for a mode this model does not have
        if req.kv_quant is None:
            return self.active.snapshot(cache_mode)
        cache_mode = configured_cache_mode(cache_mode, self.spec.arch)  # ``block``'s kv_quant is checked as for ``prefix``
        # These answers go to any client: they must not say where the store is (a path, a Redis URL).
        try:
            try:
                return self.active.resolver.resolve(req.kv_quant, cache_mode, "request")
            except ArtifactNotFound:
                full = self._full_artifact_id(req.kv_quant)  # only after a miss: a full id costs no listing
                if full is None:
                    raise
                return self.active.resolver.resolve(full, cache_mode, "request")
        except ArtifactNotFound as exc:
            raise ArtifactNotFound(exc.public, exc.field) from None
        except ArtifactUnfit as exc:
            if exc.field != "kv_quant.cache_mode":
                raise
            raise self._mode_unfit(req, cache_mode, exc) from None
        except StoreUnavailable:
            raise StoreUnavailable("the store of fitted artifacts cannot be reached; retry later") from None

    @staticmethod
    def _mode_unfit(req: s.DiffusionKnobs, cache_mode: str, exc: ArtifactUnfit) -> ArtifactUnfit:
        """A request's artifact fitted for another cache mode, named in the client's fields: a request carries no
        ``kv_quant.cache_mode`` (the resolver's name for the mode it checks), so the 422 names ``cache_mode`` when
        the request sent it, else the artifact's id field (the mode was the server's default)."""
        entry = method(req.kv_quant.method)
        id_field = f"kv_quant.{entry.spelling('artifact_id')}"
        fitted = getattr(exc.__cause__, "detail", str(exc))
        named = f"{id_field} {req.kv_quant.artifact_id!r}"
        if "cache_mode" in req.model_fields_set:
            return ArtifactUnfit("cache_mode", f"cache_mode {cache_mode!r} does not fit {named}, a "
                                 f"{entry.store_kind} fitted for another cache mode ({fitted}); send its cache "
                                 "mode or one fitted for this one")
        return ArtifactUnfit(id_field, f"{named} is a {entry.store_kind} fitted for another cache mode than the "
                             f"server's default {cache_mode!r} ({fitted}); send cache_mode with its mode")

    def _full_artifact_id(self, config: KVQuantConfig) -> KVQuantConfig | None:
        """``config`` naming its policy or state in full where it names a prefix that starts one stored id (as the
        admin routes and ``serve --kv-quant`` take one), else None; a prefix that starts several is a 400 naming
        the field and how many it starts (a serving route lists no stored ids)."""
        entry = method(config.method)
        if entry.store_kind is None or config.artifact_id is None:
            return None
        try:
            full_id = self.active.resolver.store.resolve_id(entry.store_kind, config.artifact_id)
        except AmbiguousId:
            field = f"kv_quant.{entry.spelling('artifact_id')}"
            found = len(ids_matching(self.active.resolver.store.list(entry.store_kind), config.artifact_id))
            ambiguous = AmbiguousId(f"{field} {config.artifact_id!r} is ambiguous: it starts {found} stored "
                                    f"{entry.store_kind} ids; give more of it, or the whole id")
            ambiguous.field = field  # the param of the 400
            raise ambiguous from None
        except (ArtifactNotFound, InvalidName):
            return None
        return config.model_copy(update={"artifact_id": full_id})

    def _mask_param(self, req: Any, prompt_param: str, index: int, count: int) -> tuple[str, str, str]:
        """Where the mask token of prompt ``index`` of ``count`` is (the field named in the error's ``param``, and
        the path to it), and how the client wrote it: a content or a text prompt that spells it, or a token id."""
        mask = self.spec.mask_id
        tok = getattr(self.engine, "tokenizer", None)
        to_token = getattr(tok, "convert_ids_to_tokens", None)
        spelled = to_token(mask) if to_token is not None else None
        if prompt_param == "messages":
            for i, m in enumerate(req.messages):
                if spelled and spelled in m.text:
                    return f"messages.{i}.content", f"messages.{i}.content", f"the text {spelled!r}"
            return "messages", "messages", f"the mask id {mask}"
        prompt = req.prompt
        several = isinstance(prompt, list) and isinstance(prompt[0], str | list)  # strings, or lists of ids
        one = prompt[index] if several else prompt
        path = f"prompt.{index}" if several else "prompt"
        if isinstance(one, str):
            return "prompt", path, f"the text {spelled!r}" if spelled and spelled in one else f"the mask id {mask}"
        at = list(one).index(mask)
        return "prompt", f"{path}.{at}", f"the token id {mask}" + (f" ({spelled!r})" if spelled else "")

    def _refuse_mask(self, req: Any, prompts: list[list[int]], prompt_param: str) -> None:
        """A prompt holding the mask token is a 400 naming the field and what the client wrote (the engine only
        knows the id, which a text prompt never showed). A family with no mask token is asked nothing here: its
        ``mask_id`` is outside the vocabulary, which the engine's id check refuses as that (the true reason)."""
        if not self.spec.has_mask_token:
            return
        for i, ids in enumerate(prompts):
            if self.spec.mask_id in ids:
                param, path, what = self._mask_param(req, prompt_param, i, len(prompts))
                raise InvalidRequest(f"{path} holds {what}, the model's mask token: a prompt must not contain it "
                                     "(only the response is masked)", param=param)

    def _jobs(self, prompts: list[list[int]], params: DecodeParams, rows: list[RowOptions], snapshot: ConfigSnapshot,
              prompt_param: str = "prompt") -> list[Job]:
        # The engine's admission rules (prompt ids, context length, schedule, the model family's limits) checked
        # once, by the engine: a 400 naming the field now, rather than a failed batch later.
        try:
            validate_request(self.spec, prompts, params, [rows[0]] * len(prompts))
        except EngineInputError as exc:
            if exc.field == "prompt":
                exc.field = prompt_param  # the chat route's prompt is its messages
            raise
        return [Job(ids, params, rows[0], snapshot, more_rows=tuple(rows[1:]), validated=True) for ids in prompts]

    def _check_count(self, count: int) -> None:
        """More prompts than the queue can ever hold is a 400 naming ``prompt``: a 429 would invite a retry that
        cannot succeed."""
        if count > self.settings.max_queue:
            raise InvalidRequest(f"prompt holds {count} prompts, more than the {self.settings.max_queue} requests the "
                                 "queue can ever hold (DLLM_MAX_QUEUE); send them in smaller requests",
                                 param="prompt")

    def _stops(self, stop: str | list[str] | None) -> tuple[str, ...]:
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not x for x in stops):
            raise InvalidRequest("stop strings must not be empty", param="stop")
        if stops:  # a stop string is matched in the response's text, which a checkpoint without a tokenizer lacks
            self._tokenizer("match a stop string (the response has no text); cut with max_tokens instead", "stop")
        return stops

    def plan_completion(self, req: s.CompletionRequest) -> Plan:
        """Validate and tokenize ``/v1/completions`` (InvalidRequest/ConfigInvalid/... on bad input)."""
        self._check_model(req.model)
        p = req.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            self._check_count(len(p))  # before tokenizing them all
        if isinstance(p, str):
            self._check_fits([p])
            prompts = [self._encode(p)]
        elif p and all(isinstance(x, str) for x in p):
            self._check_fits(p)
            prompts = [self._encode(x) for x in p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]
        else:
            raise InvalidRequest("prompt must be a string, a list of strings, token ids or lists of token ids, "
                                 "and not empty", param="prompt")
        if req.max_tokens == 0:  # echo only (the request's rules): nothing generated
            self._refuse_mask(req, prompts, "prompt")
            for i, ids in enumerate(prompts):
                self._check_ids(ids, "prompt")
                if not 1 <= len(ids) <= self.spec.max_length:
                    raise InvalidRequest(f"prompt {i} has {len(ids)} tokens: echo with max_tokens 0 takes 1 to "
                                         f"{self.spec.max_length} (the model's context)", param="prompt")
            plan = Plan("completion", "/v1/completions", [], request_id=s.new_id("cmpl"), prompts=prompts)
            snapshot = self.active.snapshot(req.cache_mode or self.settings.cache_mode)
        else:
            plan = self._plan("completion", "/v1/completions", req, prompts, req.max_tokens, req.temperature or 0.0)
            snapshot = plan.jobs[0].snapshot
        plan.logprobs = req.logprobs
        # Without a tokenizer the text is empty: the ids are the answer (vLLM's return_token_ids fields), and a
        # stream, which carries text deltas, would carry nothing.
        plan.token_ids = bool(req.return_token_ids) or getattr(self.engine, "tokenizer", None) is None
        if plan.stream and getattr(self.engine, "tokenizer", None) is None:
            raise InvalidRequest(f"{self.model_name} has no tokenizer: a stream carries text deltas, which would "
                                 "all be empty; send stream = false (the answer's token_ids are the response)",
                                 param="stream")
        if req.echo:
            plan.echo = [x if isinstance(x, str) else self._prompt_text(x)
                         for x in ([p] if isinstance(p, str) or isinstance(p[0], int) else p)]
            if req.logprobs is not None:
                plan.scores = self._score_jobs(req, prompts, snapshot)
        return plan

    def _prompt_text(self, ids: list[int]) -> str:
        tok = getattr(self.engine, "tokenizer", None)
        return tok.decode(ids) if tok is not None else ""

    def _score_jobs(self, req: s.CompletionRequest, prompts: list[list[int]], snapshot: ConfigSnapshot) -> list[Job]:
        """Jobs scoring each prompt's tokens with the Monte-Carlo ELBO (`service.engine.likelihood`); cost bounded
        by the work ceiling and memory admission at `service.api.serving.Serving.submit`."""
        if not self.engine.capabilities.likelihood:  # the engine refuses it in the worker: a 400 here
            raise InvalidRequest("echo with logprobs scores the prompt with the ELBO, which is not implemented for "
                                 f"{self.spec.arch} models", param="logprobs")
        mc_num = req.mc_num or self.settings.likelihood_mc_num
        batch = min(self.settings.likelihood_mc_batch_size, mc_num)
        if mc_num % batch:
            raise InvalidRequest(f"mc_num {mc_num} must be a multiple of {batch} (DLLM_LIKELIHOOD_MC_BATCH_SIZE) "
                                 "when it is larger", param="mc_num")
        seed = req.seed if req.seed is not None else LIKELIHOOD_SEED
        jobs = []
        for i, ids in enumerate(prompts):
            self._check_ids(ids, "prompt")
            if not 1 <= len(ids) <= self.spec.max_length:
                raise InvalidRequest(f"prompt {i} has {len(ids)} tokens: a scored prompt has 1 to "
                                     f"{self.spec.max_length} (the model's context)", param="prompt")
            task = LikelihoodTask(tuple(ids), mc_num, batch, seed, req.logprobs or 0)
            params = DecodeParams(gen_length=self.settings.block_length, block_length=self.settings.block_length,
                                  cache_mode="none", threshold=None, steps=1)
            jobs.append(Job(ids, params, RowOptions(), snapshot, task=task))
        return jobs

    def plan_chat(self, req: s.ChatCompletionRequest) -> Plan:
        """Validate and apply the chat template for ``/v1/chat/completions`` (with tools: `service.api.tools`)."""
        self._check_model(req.model)
        constrained = next((f for f in CONSTRAINT_FIELDS if req._constrains(f)), None)
        tools = req.tool_request(constrained)
        functions = tools.functions if tools is not None else ()
        ids = self._chat_ids(req.messages, functions=functions)
        self._check_tools_fit(req.messages, ids, functions)
        plan = self._plan("chat", "/v1/chat/completions", req, [ids], req.max_completion_tokens or req.max_tokens,
                          req.temperature or 0.0, "messages", tools=tools)
        plan.tools = tools is not None and tools.calls
        plan.tools_forced = plan.tools and tools.mode in ("required", "named")
        return plan

    def _check_tools_fit(self, messages: list[s.ChatMessage], ids: list[int], functions: tuple[Function, ...]
                         ) -> None:
        """A chat prompt over the model's context that fits without its tools is a 400 naming ``tools``: their
        rendered text is what puts it over (the engine's context rule would name ``messages``, which the client
        need not shorten). Over the context without them too, the engine's refusal naming ``messages`` stands."""
        if not functions or len(ids) < self.spec.max_length:
            return
        bare = len(self._chat_ids(messages))
        if bare >= self.spec.max_length:
            return
        raise EngineInputError(
            f"the tools' rendered text puts the prompt over the model's context of {self.spec.max_length} tokens: "
            f"the messages with tools are {len(ids):,} tokens, without them {bare:,}; offer fewer tools or shorten "
            "their descriptions and parameters", "tools")

    def plan_generate(self, req: s.GenerateRequest) -> Plan:
        """Validate ``/generate``: text (optionally through the chat template) or token ids."""
        self._check_model(req.model)
        if isinstance(req.prompt, str):
            if not req.chat:  # a chat template may trim or drop text: no bound
                self._check_fits([req.prompt])
            ids = self._tokenize(len(req.prompt), encode_prompt, self.engine.tokenizer, req.prompt,
                                 self.model_name, req.chat, self.settings.allow_special_tokens_in_content)
        else:
            ids = list(req.prompt)  # chat with token ids is refused by the request's rules
        return self._plan("generate", "/generate", req, [ids], req.max_tokens, req.temperature or 0.0)

    def _grammar(self, req: s.OpenAISampling | s.GenerateRequest, tools: ToolRequest | None = None
                 ) -> CompiledGrammar | None:
        """The compiled grammar of the request's structured-output fields (`service.api.structured`) or of its
        tool calls (`service.api.tools`), or None. Compiling blocks (bounded, cached:
        `service.engine.grammar.GrammarCompiler`): planning runs off the event loop."""
        spec = tools.grammar_spec() if tools is not None else None
        if spec is None:
            spec = req.grammar_spec() if isinstance(req, s.OpenAISampling) else None
        if spec is None:
            return None
        if self._grammars is None:
            raise InvalidRequest(f"{self.model_name} has no tokenizer: its output cannot be constrained",
                                 param=spec.field)
        try:
            return self._grammars.compile(spec)
        except EngineInputError:
            if tools is None or spec.kind != "lark":
                raise
            for one in tools.parameter_specs():  # name the function whose schema is at fault, where one is
                self._grammars.compile(one)
            raise

    def _refuse_constraint(self, req: s.OpenAISampling | s.GenerateRequest, tools: ToolRequest | None) -> None:
        """A family whose decoder cannot constrain a response (`Capabilities.unconstrained`: DiffusionGemma) refuses
        a grammar first, naming the field the client sent: ``tool_choice`` when it sent one, else ``tools`` (auto
        calls are constrained too: to text or well-formed calls), else the structured-output field. Later, the
        grammar's own checks (a max_tokens too short for a call) named a field whose fix then met this refusal."""
        why = self.engine.capabilities.unconstrained
        if not why:
            return
        if tools is not None and tools.calls:
            field = "tool_choice" if getattr(req, "tool_choice", None) is not None else "tools"
            raise InvalidRequest(f"tool calls are not served for {self.spec.arch} models: {why}; their calls are "
                                 "constrained to the functions' schemas (auto too: text or well-formed calls), so "
                                 "send tool_choice \"none\" to list the tools in the prompt unconstrained, or leave "
                                 "tools unset", param=field)
        field = next((f for f in CONSTRAINT_FIELDS if isinstance(req, s.OpenAISampling) and req._constrains(f)),
                     None)
        if field is not None:
            raise InvalidRequest(f"{field} (structured output) is not served for {self.spec.arch} models: {why}; "
                                 "leave it unset", param=field)

    def _plan(self, kind: Kind, endpoint: str, req: s.OpenAISampling | s.GenerateRequest, prompts: list[list[int]],
              max_tokens: int | None, temperature: float, prompt_param: str = "prompt",
              tools: ToolRequest | None = None) -> Plan:
        params, max_tokens = self._params(req, max_tokens)
        self._refuse_mask(req, prompts, prompt_param)
        logprobs = _logprobs_asked(req)
        n = getattr(req, "n", None) or 1
        if n > self.settings.max_n:
            raise InvalidRequest(f"n {n} is over this server's {self.settings.max_n} choices per request "
                                 "(DLLM_MAX_N)", param="n")
        # A response that can only be calls (required, a named function) ends where its grammar ends: a stop string
        # could only cut a call, which is then returned as nothing at all.
        calls_only = tools is not None and tools.mode in ("required", "named")
        self._refuse_constraint(req, tools)
        grammar = self._grammar(req, tools)
        if grammar is not None:  # a constrained response closes within its positions, or is refused now (issue 45)
            grammar.fits(max_tokens, params.block_length)
        row = RowOptions(temperature=temperature, seed=req.seed, stop=() if calls_only else self._stops(req.stop),
                         max_tokens=max_tokens, logprobs=logprobs, grammar=grammar)
        rows = [row.model_copy(update={"seed": _choice_seed(req.seed, j)}) for j in range(n)]
        jobs = self._jobs(prompts, params, rows, self._snapshot(req, params.cache_mode), prompt_param)
        prefix = {"chat": "chatcmpl", "completion": "cmpl", "generate": "gen"}[kind]
        options = getattr(req, "stream_options", None)
        return Plan(kind, endpoint, jobs, stream=bool(getattr(req, "stream", False)),
                    include_usage=bool(options is not None and options.include_usage), request_id=s.new_id(prefix),
                    prompts=prompts, n=n, logprobs=logprobs)


#: The Monte-Carlo seed of a likelihood request that gives none (the in-process lm-eval model's default seed, and
#: the one lm-eval's local-completions sends).
LIKELIHOOD_SEED = 1234


def _choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index``: the request's seed + index (kept within a 64-bit generator seed), or None
    (each choice its own fresh random seed)."""
    if seed is None:
        return None
    return seed + index if seed + index < 1 << 64 else seed + index - (1 << 64)


def _logprobs_asked(req: Any) -> int | None:
    """Alternatives per returned token a request asks for (None: no log-probabilities): completions' ``logprobs``
    (an int), chat's ``top_logprobs`` when ``logprobs`` is true."""
    if isinstance(req, s.CompletionRequest):
        return req.logprobs
    if isinstance(req, s.ChatCompletionRequest) and req.logprobs:
        return req.top_logprobs or 0
    return None


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere: musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _malloc_trim()


def _trimmed(encode: Callable[..., list[int]], *args: Any) -> list[int]:
    """``encode(*args)``, then hand the memory the tokenizer freed back to the system: glibc keeps freed heap
    memory for reuse, so without it the server's RSS stays at its high-water mark after each large text."""
    try:
        return encode(*args)
    finally:
        if _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)
