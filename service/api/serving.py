"""Serving logic behind the routes: requests -> worker jobs -> OpenAI / native answers and SSE streams.

Built once in the lifespan and kept on ``app.state.serving`` (vLLM's ``OpenAIServing*`` habit); testable without
HTTP. A coordinator: planning (`service.api.planning`: a request read into jobs), running (here: the jobs
submitted, waited for, cancelled when the client disconnects or the request is older than ``request_timeout_s``),
answers (`service.api.answers`) and streaming (`service.api.streaming`). Data flows one way: planning, then
answers or streaming, then this module.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from service.api import schemas as s
from service.api.answers import Answers
from service.api.errors import RequestTimeout
from service.api.planning import Plan, Planner
from service.api.streaming import OUTCOME_KEY, Streamer, held_back, mark_cancelled
from service.config import Settings
from service.engine.protocol import EngineLike
from service.engine.response import Cut
from service.runtime.loop import Job, JobCancelled, JobResult, RequestTooLarge, Worker
from service.store.active import ActiveConfigs
from service.telemetry import Telemetry


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
        self.planner = Planner(engine, active, settings, model_name)
        self.answers = Answers(engine, active, settings, model_name)
        self.streamer = Streamer(engine, settings, model_name, self.answers.cut, self._cancel, self._observe)

    # ---- models and tokenizer (`service.api.planning`) --------------------------------------------------------------
    def models(self) -> s.ModelList:
        """``/v1/models`` (`Planner.models`)."""
        return self.planner.models()

    def model(self, name: str) -> s.ModelCard:
        """``/v1/models/{name}`` (`Planner.model`; NotFound)."""
        return self.planner.model(name)

    def tokenize(self, req: s.TokenizeRequest) -> s.TokenizeResponse:
        """``/tokenize`` (`Planner.tokenize`)."""
        return self.planner.tokenize(req)

    def detokenize(self, req: s.DetokenizeRequest) -> s.DetokenizeResponse:
        """``/detokenize`` (`Planner.detokenize`)."""
        return self.planner.detokenize(req)

    def tokenizer_info(self) -> dict[str, Any]:
        """``/tokenizer_info`` (`Planner.tokenizer_info`)."""
        return self.planner.tokenizer_info()

    # ---- planning (`service.api.planning`) --------------------------------------------------------------------------
    def plan_completion(self, req: s.CompletionRequest) -> Plan:
        """``/v1/completions`` read into a plan (`Planner.plan_completion`)."""
        return self.planner.plan_completion(req)

    def plan_chat(self, req: s.ChatCompletionRequest) -> Plan:
        """``/v1/chat/completions`` read into a plan (`Planner.plan_chat`)."""
        return self.planner.plan_chat(req)

    def plan_generate(self, req: s.GenerateRequest) -> Plan:
        """``/generate`` read into a plan (`Planner.plan_generate`)."""
        return self.planner.plan_generate(req)

    # ---- running -------------------------------------------------------------------------------------------------
    def submit(self, plan: Plan) -> None:
        """Admit every job of the plan, or none (QueueFull / WorkerUnavailable leave nothing queued)."""
        admitted = []
        try:
            for job in plan.all_jobs:
                admitted.append(self.worker.submit(job))
        except BaseException as exc:
            for job in admitted:
                self.worker.cancel(job)
            if isinstance(exc, RequestTooLarge) and exc.field == "prompt" and plan.kind == "chat":
                exc.field = "messages"  # the chat route's prompt
            raise

    def _cancel(self, plan: Plan) -> None:
        for job in plan.all_jobs:
            if not job.future.done():
                self.worker.cancel(job)

    async def run(self, plan: Plan, request: Request) -> list[JobResult]:
        """Submit and wait for every job; cancel them if the client goes away or the request times out.

        Raises: QueueFull, WorkerUnavailable, BatchFailed, JobCancelled, RequestTimeout.
        """
        self.submit(plan)
        gathered = asyncio.gather(*(asyncio.wrap_future(j.future) for j in plan.all_jobs), return_exceptions=True)
        watcher = asyncio.create_task(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({gathered, watcher}, timeout=self.settings.request_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            self._cancel(plan)
        if gathered not in done:
            gathered.cancel()
            # A cancelled gather ends with a CancelledError that nobody awaits: retrieve it, or asyncio logs an
            # "exception was never retrieved" ERROR for every client that went away (a handled disconnect).
            gathered.add_done_callback(_retrieve)
            if watcher in done:
                raise JobCancelled("the client disconnected")
            raise RequestTimeout(f"the request took longer than {self.settings.request_timeout_s} s")
        results = gathered.result()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        results, plan.scored = results[:len(plan.jobs)], results[len(plan.jobs):]
        self._observe(plan, results)
        return results

    def _observe(self, plan: Plan, results: list[JobResult]) -> None:
        for job, result in zip(plan.jobs, results, strict=True):
            self.telemetry.prompt_tokens.inc(len(job.prompt_ids))
            if job.first_block_at is not None:
                self.telemetry.first_block.labels(plan.endpoint).observe(job.first_block_at - job.admitted_at)

    # ---- answers (`service.api.answers`) and streaming (`service.api.streaming`) -----------------------------------
    def cut(self, job: Job, ids: list[int]) -> Cut:
        """The response so far of a job still decoding (`Answers.cut`)."""
        return self.answers.cut(job, ids)

    def completion_response(self, plan: Plan, results: list[JobResult]) -> s.CompletionResponse:
        """The ``/v1/completions`` answer (`Answers.completion_response`)."""
        return self.answers.completion_response(plan, results)

    def chat_response(self, plan: Plan, results: list[JobResult]) -> s.ChatCompletionResponse:
        """The ``/v1/chat/completions`` answer (`Answers.chat_response`)."""
        return self.answers.chat_response(plan, results)

    def generate_response(self, plan: Plan, result: JobResult) -> s.GenerateResponse:
        """The ``/generate`` answer (`Answers.generate_response`)."""
        return self.answers.generate_response(plan, result)

    def stream(self, plan: Plan, request: Request | None = None) -> AsyncIterator[str]:
        """SSE events of a streaming completion or chat (`Streamer.stream`; jobs submitted with :meth:`submit`
        first)."""
        return self.streamer.stream(plan, request)


def _retrieve(future: asyncio.Future) -> None:
    """Mark a finished future's outcome as seen (its exception, if any, was handled by the caller)."""
    if not future.cancelled():
        future.exception()


async def _wait_disconnect(request: Request, poll_s: float = 0.1) -> None:
    """Return when the client has gone away."""
    while not await request.is_disconnected():
        await asyncio.sleep(poll_s)


__all__ = ["OUTCOME_KEY", "Plan", "Serving", "held_back", "mark_cancelled"]
