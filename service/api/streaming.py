"""Streaming: a running plan's committed blocks as SSE chunks.

One chunk per committed block with its text delta (from the engine's ``on_block``), cut by the rule the final
answer is cut by (`service.api.answers.Answers.cut`), so what is streamed never goes past the final answer; a stop
string never appears in the text, also not in streamed deltas (a tail that could start one is held back,
:func:`held_back`); then a chunk with ``finish_reason``, then ``data: [DONE]``. Usage as OpenAI streams it: only
with ``stream_options.include_usage`` true, as one last chunk with ``choices: []`` before ``[DONE]``, every
earlier chunk carrying ``usage: null``; otherwise chunks have no ``usage``. An error after the stream started is
sent as an ``{"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from service.api import schemas as s
from service.api.errors import RequestTimeout, classify
from service.api.logprobs import chat_logprobs, completion_logprobs, tokens_within
from service.api.planning import Plan
from service.api.tools import call_id, read_answer
from service.config import Settings
from service.engine.protocol import EngineLike
from service.engine.report import TokenLogprob
from service.engine.response import Cut
from service.engine.tool_format import Call, parse_calls, starts_as_call
from service.runtime.loop import Job, JobCancelled, JobResult


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


class Streamer:
    """Streams a plan's results (see the module docstring).

    Args:
        engine, settings, model_name: the server's. cut: the cut of a response so far (`Answers.cut`). cancel:
        cancels a plan's jobs (`service.api.serving.Serving`). observe: records a finished plan's telemetry.
    """

    def __init__(self, engine: EngineLike, settings: Settings, model_name: str, cut: Callable[[Job, list[int]], Cut],
                 cancel: Callable[[Plan], None], observe: Callable[[Plan, list[JobResult]], None]) -> None:
        self.engine = engine
        self.settings = settings
        self.model_name = model_name
        self.cut = cut
        self._cancel = cancel
        self._observe = observe

    async def stream(self, plan: Plan, request: Request | None = None) -> AsyncIterator[str]:
        """SSE events of a streaming completion or chat (jobs must be submitted with
        `service.api.serving.Serving.submit` first, so a full queue is a 429 before the stream starts). Cancels the
        jobs when the client goes away, and marks the request cancelled (:func:`mark_cancelled`) so that the
        metrics count it as 499, not as the 200 its headers already said."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        for i, job in enumerate(plan.jobs):
            job.on_block = _threadsafe(loop, events, i)
            job.future.add_done_callback(lambda _f, i=i: loop.call_soon_threadsafe(events.put_nowait, ("done", i)))
        choices = len(plan.jobs) * plan.n  # choice k: job k // n, its row k % n
        emitted = [""] * choices
        sent = [0] * choices  # tokens whose log-probabilities went out (with the chunk that completed their text)
        open_jobs = set(range(len(plan.jobs)))
        prompt_tokens = sum(len(j.prompt_ids) for j in plan.jobs)
        completion_tokens = 0
        call_ids: list[list[str]] = [[] for _ in range(choices)]  # ids of the calls streamed, per choice
        deadline = loop.time() + self.settings.request_timeout_s
        ended = False
        try:
            if plan.kind == "chat":
                for k in range(choices):
                    yield self._chunk(plan, k, role=True)
            while open_jobs:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise RequestTimeout(f"the request took longer than {self.settings.request_timeout_s} s")
                kind, i, *rest = event
                if i not in open_jobs:
                    continue
                job = plan.jobs[i]
                if kind == "block":
                    _, rows_ids, rows_captured = rest
                    for j, (ids, captured) in enumerate(zip(rows_ids, rows_captured, strict=True)):
                        k = i * plan.n + j
                        # Cut as the final answer is cut: what is streamed never goes past it.
                        cut = self.cut(job, ids)
                        text = cut.text or ""
                        text = text[: len(text) - held_back(text, job.row.stop)]
                        if plan.tools and starts_as_call(text):  # calls go out whole, never a partial one
                            for chunk in self._call_chunks(plan, k, parse_calls(text)[0], call_ids[k]):
                                yield chunk
                            continue
                        delta = text[len(emitted[k]):] if text.startswith(emitted[k]) else ""
                        entries = None
                        if plan.logprobs is not None and captured is not None:
                            done = tokens_within(self.engine.decode_text, cut.ids, len(emitted[k]) + len(delta))
                            entries, sent[k] = captured[sent[k]:done], max(sent[k], done)
                        yield self._chunk(plan, k, text=delta, logprobs=entries, offset=len(emitted[k]))
                        emitted[k] += delta
                    continue
                exc = job.future.exception()
                if exc is not None:
                    raise exc
                result: JobResult = job.future.result()
                open_jobs.discard(i)
                for j, row in enumerate(result.report.rows):
                    k = i * plan.n + j
                    text = row.text or ""
                    completion_tokens += len(row.generated_ids)
                    entries = (row.logprobs or [])[sent[k]:len(row.generated_ids)] if plan.logprobs is not None else None
                    finish = row.finish_reason
                    if plan.tools:
                        answer = read_answer(text, row.finish_reason, call_ids[k], forced=plan.tools_forced)
                        finish = answer.finish_reason
                        if answer.content is None:
                            for chunk in self._call_chunks(plan, k, [c for _, c in answer.calls], call_ids[k]):
                                yield chunk
                            if entries:
                                yield self._chunk(plan, k, logprobs=entries)
                            yield self._chunk(plan, k, text="", finish_reason=finish)
                            continue
                    delta = text[len(emitted[k]):] if text.startswith(emitted[k]) else ""
                    if delta or entries:  # the text held back for a stop string, before the finish chunk (no text)
                        yield self._chunk(plan, k, text=delta, logprobs=entries, offset=len(emitted[k]))
                    yield self._chunk(plan, k, text="", finish_reason=finish)
                if not open_jobs:
                    ended = True
                    self._observe(plan, [j.future.result() for j in plan.jobs])
                    if plan.include_usage:
                        yield self._chunk(plan, None, usage=s.Usage(
                            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                            total_tokens=prompt_tokens + completion_tokens))
        except (Exception, asyncio.CancelledError) as exc:
            self._cancel(plan)
            if isinstance(exc, asyncio.CancelledError | JobCancelled):
                raise
            _, body, _ = classify(exc)
            ended = True
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            self._cancel(plan)
            if not ended and request is not None:
                # Left before the end: the client went away (the generator is cancelled or closed at a yield) or
                # its jobs were cancelled.
                mark_cancelled(request)
        yield "data: [DONE]\n\n"

    def _call_chunks(self, plan: Plan, k: int, calls: list[Call], ids: list[str]) -> list[str]:
        """The chunks of the calls of choice ``k`` not yet streamed (``ids``: those streamed, extended here), each
        as OpenAI streams one: its index, id, type and name first, then its arguments."""
        chunks = []
        for index in range(len(ids), len(calls)):
            ids.append(call_id())
            call = calls[index]
            chunks.append(self._chunk(plan, k, tool_calls=[{"index": index, "id": ids[index], "type": "function",
                                                            "function": {"name": call.name, "arguments": ""}}]))
            chunks.append(self._chunk(plan, k, tool_calls=[{"index": index,
                                                            "function": {"arguments": call.arguments}}]))
        return chunks

    def _chunk(self, plan: Plan, index: int | None, text: str | None = None, role: bool = False,
               finish_reason: str | None = None, usage: s.Usage | None = None,
               logprobs: list[TokenLogprob] | None = None, offset: int = 0,
               tool_calls: list[dict[str, Any]] | None = None) -> str:
        """One SSE chunk of choice ``index``, or (``index`` None) the usage chunk with ``choices: []``;
        ``logprobs``: the entries of the tokens whose text this chunk completes (``offset``: the characters sent
        before it); ``tool_calls``: call pieces (chat)."""
        exclude = {"kv_config"} | (set() if plan.include_usage else {"usage"})
        tok = getattr(self.engine, "tokenizer", None)
        if plan.kind == "chat":
            delta = s.DeltaMessage(role="assistant", content="") if role else s.DeltaMessage(content=text,
                                                                                             tool_calls=tool_calls)
            chat = chat_logprobs(tok, logprobs) if logprobs is not None else None
            choices = [] if index is None else [s.ChatChunkChoice(index=index, delta=delta, logprobs=chat,
                                                                  finish_reason=finish_reason)]
            body = s.ChatCompletionChunk(id=plan.request_id, created=plan.created, model=self.model_name,
                                         choices=choices, usage=usage)
        else:
            legacy = completion_logprobs(tok, logprobs, offset=offset) if logprobs is not None else None
            choices = [] if index is None else [s.CompletionChoice(index=index, text=text or "", logprobs=legacy,
                                                                   finish_reason=finish_reason)]
            body = s.CompletionResponse(id=plan.request_id, created=plan.created, model=self.model_name,
                                        choices=choices, usage=usage)
        return f"data: {json.dumps(body.model_dump(mode='json', exclude=exclude))}\n\n"


#: The ASGI scope key under which the metrics middleware (`service.main.MetricsMiddleware`) leaves a dict for the
#: request's outcome: ``{"cancelled": True}`` once :func:`mark_cancelled` ran.
OUTCOME_KEY = "dllm.outcome"


def mark_cancelled(request: Request) -> None:
    """Record that the request was cancelled (client gone, jobs cancelled) after its status was sent (a stream's
    200), so that it is counted as 499 and as a cancellation."""
    outcome = request.scope.get(OUTCOME_KEY)
    if outcome is not None:
        outcome["cancelled"] = True


def _threadsafe(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int
                ) -> Callable[[int, list[int]], None]:
    """An ``on_block`` callback that hands (block, ids) from the worker thread to the event loop."""

    def on_block(block: int, ids: list[list[int]]) -> None:
        # One list per row of the job: `service.engine.decode.CommittedIds`, whose log-probabilities (when asked
        # for) come along.
        loop.call_soon_threadsafe(events.put_nowait, ("block", index, block, [list(r) for r in ids],
                                                      [getattr(r, "logprobs", None) for r in ids]))

    return on_block
