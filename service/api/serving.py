"""Serving logic behind the routes: requests -> worker jobs -> OpenAI / native answers and SSE streams.

Built once in the lifespan and kept on ``app.state.serving`` (vLLM's ``OpenAIServing*`` habit); testable without
HTTP. Rules it implements (issue #5, item 3):

* ``max_tokens`` is the number of response positions, rounded **up** to whole blocks
  (`service.engine.params.response_length`); the output is cut at EOS and at the first stop string, which never
  appears in the text (also not in streamed deltas: a tail that could start a stop string is held back).
* A request is admitted with one configuration snapshot: the one its ``kv_quant`` names, else the active
  configuration of its cache mode at admission.
* A client that disconnects, or a request older than ``request_timeout_s``, cancels its jobs.
* Streaming: one chunk per committed block with its text delta (from the engine's ``on_block``), then a chunk
  with ``finish_reason`` and the usage, then ``data: [DONE]``. An error after the stream started is sent as an
  ``{"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request

from service.api import schemas as s
from service.api.errors import InvalidRequest, NotFound, RequestTimeout, classify
from service.config import Settings
from service.engine.engine import validate_request
from service.engine.params import DecodeParams, RowOptions, response_length
from service.engine.report import RowReport
from service.store.active import ActiveConfigs, ConfigSnapshot
from service.telemetry import Telemetry
from service.worker import EngineLike, Job, JobCancelled, JobResult, Worker

Kind = Literal["completion", "chat", "generate"]


@dataclass
class Plan:
    """A validated request: its jobs (one per prompt) and what shaping the answer needs."""

    kind: Kind
    endpoint: str
    jobs: list[Job]
    stops: tuple[str, ...]
    ignore_eos: bool
    stream: bool = False
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True)
class Finished:
    """A row's final text and accounting."""

    text: str
    finish_reason: Literal["stop", "length"]
    completion_tokens: int


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the earliest occurrence of any stop string (excluded), and whether one occurred."""
    cut = min((i for i in (text.find(x) for x in stops if x) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of a partial text to withhold while streaming: an undecodable tail (U+FFFD
    from a split multi-byte character) and the longest tail that could be the start of a stop string."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return hold


class Serving:
    """Turns API requests into jobs and results into answers (see the module docstring)."""

    def __init__(self, engine: EngineLike, worker: Worker, active: ActiveConfigs, settings: Settings,
                 telemetry: Telemetry, model_name: str) -> None:
        self.engine = engine
        self.worker = worker
        self.active = active
        self.settings = settings
        self.telemetry = telemetry
        self.spec = engine.spec
        self.model_name = model_name

    # ---- models and tokenizer ----------------------------------------------------------------------------------------
    def models(self) -> s.ModelList:
        """``/v1/models``: the one served model."""
        return s.ModelList(data=[s.ModelCard(id=self.model_name, max_model_len=self.spec.max_length,
                                             root=self.spec.model_id)])

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.spec.model_id):
            raise NotFound(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model")

    @property
    def tokenizer(self):
        """The engine's tokenizer (400 when the checkpoint has none)."""
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            raise InvalidRequest(f"{self.spec.model_id} has no tokenizer: send token ids instead of text",
                                 param="prompt")
        return tok

    def _chat_ids(self, messages: list[s.ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise InvalidRequest(f"{self.spec.model_id} has no chat template; use /v1/completions", param="messages")
        turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in messages]
        return list(tok.apply_chat_template(turns, add_generation_prompt=add_generation_prompt, tokenize=True))

    def tokenize(self, req: s.TokenizeRequest) -> s.TokenizeResponse:
        """``/tokenize``: ids of a prompt or of chat messages (through the chat template)."""
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            ids = self._chat_ids(req.messages, req.add_generation_prompt)
        else:
            ids = list(self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
        return s.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.spec.max_length)

    def detokenize(self, req: s.DetokenizeRequest) -> s.DetokenizeResponse:
        """``/detokenize``: the text of token ids."""
        self._check_model(req.model)
        self._check_ids(req.tokens, "tokens")
        return s.DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))

    def tokenizer_info(self) -> dict[str, Any]:
        """What lm-eval's ``RemoteTokenizer`` reads (vLLM's ``/tokenizer_info`` fields)."""
        tok = self.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": getattr(tok, "unk_token", None),
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": self.spec.max_length,
            "vocab_size": self.spec.vocab_size,
            "eos_token_ids": list(self.spec.eos_ids),
            "mask_token_id": self.spec.mask_id,
        }

    # ---- planning ------------------------------------------------------------------------------------------------
    def _check_ids(self, ids: list[int], param: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.spec.vocab_size]
        if bad:
            raise InvalidRequest(f"token ids must lie in [0, {self.spec.vocab_size}), got {bad[:5]}", param=param)

    def _params(self, req: s.DiffusionKnobs, max_tokens: int | None, extra: dict[str, Any] | None = None
                ) -> DecodeParams:
        block_length = req.block_length or self.settings.block_length
        gen_length = response_length(max_tokens or self.settings.default_max_tokens, block_length)
        if gen_length > self.spec.max_length:
            raise InvalidRequest(f"max_tokens {max_tokens} (rounded up to {gen_length} response positions) exceeds "
                                 f"the model's context of {self.spec.max_length} tokens", param="max_tokens")
        if req.steps is not None and req.threshold is not None:
            raise InvalidRequest("give threshold (confidence-threshold decoding) or steps (fixed schedule), not both",
                                 param="threshold")
        if req.steps is not None and req.steps % (gen_length // block_length):
            raise InvalidRequest(f"steps {req.steps} must be a multiple of the number of blocks "
                                 f"{gen_length // block_length} (response {gen_length} / block {block_length})",
                                 param="steps")
        return DecodeParams(
            gen_length=gen_length,
            block_length=block_length,
            cache_mode=req.cache_mode or self.settings.cache_mode,
            threshold=None if req.steps is not None else (
                req.threshold if req.threshold is not None else self.settings.threshold),
            steps=req.steps,
            remasking=req.remasking or "low_confidence",
            ignore_eos=req.ignore_eos,
            **(extra or {}),
        )

    def _snapshot(self, req: s.DiffusionKnobs, cache_mode: str) -> ConfigSnapshot:
        if req.kv_quant is not None:
            return self.active.resolver.resolve(req.kv_quant, cache_mode, "request")
        return self.active.snapshot(cache_mode)

    def _jobs(self, prompts: list[list[int]], params: DecodeParams, row: RowOptions, snapshot: ConfigSnapshot
              ) -> list[Job]:
        for ids in prompts:
            if not ids:
                raise InvalidRequest("the prompt is empty", param="prompt")
            self._check_ids(ids, "prompt")
            if len(ids) + params.gen_length > self.spec.max_length:
                raise InvalidRequest(
                    f"prompt ({len(ids)} tokens) + response ({params.gen_length} positions) exceeds the model's "
                    f"context of {self.spec.max_length} tokens", param="prompt" if len(ids) >= self.spec.max_length
                    else "max_tokens")
        # The engine's own admission rules (mask id in a prompt, Dream's schedule limits ...): a 400 now, rather
        # than a failed batch later.
        validate_request(self.spec, prompts, params, [row] * len(prompts))
        return [Job(ids, params, row, snapshot) for ids in prompts]

    @staticmethod
    def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not x for x in stops):
            raise InvalidRequest("stop strings must not be empty", param="stop")
        return stops

    def _openai_common(self, req: s.OpenAISampling) -> None:
        self._check_model(req.model)
        problem = s.unhonoured(req)
        if problem is not None:
            raise InvalidRequest(problem[1], param=problem[0])

    def plan_completion(self, req: s.CompletionRequest) -> Plan:
        """Validate and tokenize ``/v1/completions`` (InvalidRequest/ConfigInvalid/... on bad input)."""
        self._openai_common(req)
        p = req.prompt
        if isinstance(p, str):
            prompts = [self._encode(p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [self._encode(x) for x in p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]
        else:
            raise InvalidRequest("prompt must be a string, a list of strings, token ids or lists of token ids, "
                                 "and not empty", param="prompt")
        return self._plan("completion", "/v1/completions", req, prompts, req.max_tokens)

    def plan_chat(self, req: s.ChatCompletionRequest) -> Plan:
        """Validate and apply the chat template for ``/v1/chat/completions``."""
        self._openai_common(req)
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise InvalidRequest("give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        return self._plan("chat", "/v1/chat/completions", req, [self._chat_ids(req.messages)],
                          req.max_completion_tokens or req.max_tokens)

    def plan_generate(self, req: s.GenerateRequest) -> Plan:
        """Validate ``/generate``: text (optionally through the chat template) or token ids."""
        if isinstance(req.prompt, str):
            ids = self._chat_ids([s.ChatMessage(role="user", content=req.prompt)]) if req.chat \
                else self._encode(req.prompt)
        else:
            if req.chat:
                raise InvalidRequest("chat applies to a text prompt, not token ids", param="chat")
            ids = list(req.prompt)
        extra = {"dream_schedule": req.dream_schedule} if req.dream_schedule else None
        params = self._params(req, req.max_tokens, extra)
        stops = self._stops(req.stop)
        row = RowOptions(temperature=req.temperature, seed=req.seed, stop=stops)
        jobs = self._jobs([ids], params, row, self._snapshot(req, params.cache_mode))
        return Plan("generate", "/generate", jobs, stops, req.ignore_eos, request_id=s.new_id("gen"))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def _plan(self, kind: Kind, endpoint: str, req: s.OpenAISampling, prompts: list[list[int]],
              max_tokens: int | None) -> Plan:
        params = self._params(req, max_tokens)
        stops = self._stops(req.stop)
        row = RowOptions(temperature=req.temperature or 0.0, seed=req.seed, stop=stops)
        jobs = self._jobs(prompts, params, row, self._snapshot(req, params.cache_mode))
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return Plan(kind, endpoint, jobs, stops, req.ignore_eos, stream=bool(req.stream), request_id=s.new_id(prefix))

    # ---- running -------------------------------------------------------------------------------------------------
    def submit(self, plan: Plan) -> None:
        """Admit every job of the plan, or none (QueueFull / WorkerUnavailable leave nothing queued)."""
        admitted = []
        try:
            for job in plan.jobs:
                admitted.append(self.worker.submit(job))
        except BaseException:
            for job in admitted:
                self.worker.cancel(job)
            raise

    def _cancel(self, plan: Plan) -> None:
        for job in plan.jobs:
            if not job.future.done():
                self.worker.cancel(job)

    async def run(self, plan: Plan, request: Request) -> list[JobResult]:
        """Submit and wait for every job; cancel them if the client goes away or the request times out.

        Raises: QueueFull, WorkerUnavailable, BatchFailed, JobCancelled, RequestTimeout.
        """
        self.submit(plan)
        gathered = asyncio.gather(*(asyncio.wrap_future(j.future) for j in plan.jobs), return_exceptions=True)
        watcher = asyncio.create_task(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({gathered, watcher}, timeout=self.settings.request_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            self._cancel(plan)
        if gathered not in done:
            gathered.cancel()
            if watcher in done:
                raise JobCancelled("the client disconnected")
            raise RequestTimeout(f"the request took longer than {self.settings.request_timeout_s} s")
        results = gathered.result()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        self._observe(plan, results)
        return results

    def _observe(self, plan: Plan, results: list[JobResult]) -> None:
        for job, result in zip(plan.jobs, results, strict=True):
            self.telemetry.prompt_tokens.inc(len(job.prompt_ids))
            if job.first_block_at is not None:
                self.telemetry.first_block.labels(plan.endpoint).observe(job.first_block_at - job.admitted_at)

    def finish(self, plan: Plan, row: RowReport) -> Finished:
        """Final text of a row: cut at the first EOS (unless ignore_eos) and at the first stop string."""
        ids, hit_eos = self._cut_eos(row.generated_ids, plan.ignore_eos)
        text = self.engine.decode_text(ids) or ""
        text, hit_stop = cut_at_stop(text, plan.stops)
        completion_tokens = len(ids) + (1 if hit_eos else 0)
        return Finished(text, "stop" if hit_eos or hit_stop else "length", completion_tokens)

    def _cut_eos(self, ids: list[int], ignore_eos: bool) -> tuple[list[int], bool]:
        if ignore_eos:
            return list(ids), False
        for i, t in enumerate(ids):
            if t in self.spec.eos_ids:
                return list(ids[:i]), True
        return list(ids), False

    # ---- answers -----------------------------------------------------------------------------------------------------
    def completion_response(self, plan: Plan, results: list[JobResult]) -> s.CompletionResponse:
        """The ``/v1/completions`` answer: one choice per prompt, summed usage."""
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, (job, result) in enumerate(zip(plan.jobs, results, strict=True)):
            fin = self.finish(plan, result.row)
            choices.append(s.CompletionChoice(index=i, text=fin.text, finish_reason=fin.finish_reason))
            prompt_tokens += len(job.prompt_ids)
            completion_tokens += fin.completion_tokens
        return s.CompletionResponse(
            id=plan.request_id, created=plan.created, model=self.model_name, choices=choices,
            usage=s.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens),
            kv_config=results[0].snapshot.describe(),
        )

    def chat_response(self, plan: Plan, results: list[JobResult]) -> s.ChatCompletionResponse:
        """The ``/v1/chat/completions`` answer."""
        fin = self.finish(plan, results[0].row)
        prompt_tokens = len(plan.jobs[0].prompt_ids)
        return s.ChatCompletionResponse(
            id=plan.request_id, created=plan.created, model=self.model_name,
            choices=[s.ChatChoice(index=0, message=s.ChatMessageOut(content=fin.text), finish_reason=fin.finish_reason)],
            usage=s.Usage(prompt_tokens=prompt_tokens, completion_tokens=fin.completion_tokens,
                          total_tokens=prompt_tokens + fin.completion_tokens),
            kv_config=results[0].snapshot.describe(),
        )

    def generate_response(self, plan: Plan, result: JobResult) -> s.GenerateResponse:
        """The ``/generate`` answer: the one-row report with its text cut at EOS and stop strings."""
        fin = self.finish(plan, result.row)
        report = result.report.model_copy(update={"rows": [result.row.model_copy(update={"text": fin.text})]})
        return s.GenerateResponse(
            **report.model_dump(), id=plan.request_id, model=self.model_name,
            prompt_tokens=len(plan.jobs[0].prompt_ids), kv_config=result.snapshot.describe(),
            queue_s=result.queue_s, batch_size=result.batch_size,
        )

    # ---- streaming -----------------------------------------------------------------------------------------------
    async def stream(self, plan: Plan) -> AsyncIterator[str]:
        """SSE events of a streaming completion or chat (jobs must be submitted with :meth:`submit` first, so a
        full queue is a 429 before the stream starts). Cancels the jobs when the client goes away."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        n = len(plan.jobs)
        for i, job in enumerate(plan.jobs):
            job.on_block = _threadsafe(loop, events, i)
            job.future.add_done_callback(lambda _f, i=i: loop.call_soon_threadsafe(events.put_nowait, ("done", i)))
        emitted = [""] * n
        open_rows = set(range(n))
        prompt_tokens = sum(len(j.prompt_ids) for j in plan.jobs)
        completion_tokens = 0
        deadline = loop.time() + self.settings.request_timeout_s
        try:
            if plan.kind == "chat":
                yield self._chunk(plan, 0, role=True)
            while open_rows:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise RequestTimeout(f"the request took longer than {self.settings.request_timeout_s} s")
                kind, i, *rest = event
                if i not in open_rows:
                    continue
                if kind == "block":
                    ids, _ = self._cut_eos(rest[1], plan.ignore_eos)
                    text, _ = cut_at_stop(self.engine.decode_text(ids) or "", plan.stops)
                    text = text[: len(text) - held_back(text, plan.stops)]
                    delta = text[len(emitted[i]):] if text.startswith(emitted[i]) else ""
                    emitted[i] += delta
                    yield self._chunk(plan, i, text=delta)
                    continue
                job = plan.jobs[i]
                exc = job.future.exception()
                if exc is not None:
                    raise exc
                result: JobResult = job.future.result()
                fin = self.finish(plan, result.row)
                completion_tokens += fin.completion_tokens
                open_rows.discard(i)
                delta = fin.text[len(emitted[i]):] if fin.text.startswith(emitted[i]) else ""
                usage = None
                if not open_rows:
                    usage = s.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                    total_tokens=prompt_tokens + completion_tokens)
                    self._observe(plan, [j.future.result() for j in plan.jobs])
                yield self._chunk(plan, i, text=delta, finish_reason=fin.finish_reason, usage=usage)
        except (Exception, asyncio.CancelledError) as exc:
            self._cancel(plan)
            if isinstance(exc, asyncio.CancelledError | JobCancelled):
                raise
            _, body, _ = classify(exc)
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            self._cancel(plan)
        yield "data: [DONE]\n\n"

    def _chunk(self, plan: Plan, index: int, text: str | None = None, role: bool = False,
               finish_reason: str | None = None, usage: s.Usage | None = None) -> str:
        if plan.kind == "chat":
            delta = s.DeltaMessage(role="assistant", content="") if role else s.DeltaMessage(content=text)
            body = s.ChatCompletionChunk(id=plan.request_id, created=plan.created, model=self.model_name,
                                         choices=[s.ChatChunkChoice(index=index, delta=delta,
                                                                    finish_reason=finish_reason)],
                                         usage=usage).model_dump(mode="json")
        else:
            body = s.CompletionResponse(id=plan.request_id, created=plan.created, model=self.model_name,
                                        choices=[s.CompletionChoice(index=index, text=text or "",
                                                                    finish_reason=finish_reason)],
                                        usage=usage).model_dump(mode="json", exclude={"kv_config"})
        return f"data: {json.dumps(body)}\n\n"


def _threadsafe(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int
                ) -> Callable[[int, list[int]], None]:
    """An ``on_block`` callback that hands (block, ids) from the worker thread to the event loop."""

    def on_block(block: int, ids: list[int]) -> None:
        loop.call_soon_threadsafe(events.put_nowait, ("block", index, block, list(ids)))

    return on_block


async def _wait_disconnect(request: Request, poll_s: float = 0.1) -> None:
    """Return when the client has gone away."""
    while not await request.is_disconnected():
        await asyncio.sleep(poll_s)


__all__ = ["Finished", "Plan", "Serving", "cut_at_stop", "held_back"]
