"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` (and one by name)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.api import schemas as s
from service.api.body import JSONBodyRoute
from service.api.deps import ServingDep, require_api_key

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], route_class=JSONBodyRoute)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.get("/models")
def list_models(serving: ServingDep) -> s.ModelList:
    """The served model (one)."""
    return serving.models()


@router.get("/models/{model:path}")
def retrieve_model(model: str, serving: ServingDep) -> s.ModelCard:
    """One model by name (OpenAI's retrieve; a hub id's slash included): the served model's card, else 404."""
    return serving.model(model)


@router.post("/completions", response_model=None,
             description="OpenAI completions; server-sent events when `stream`.\n\n" + s.GENERATION_RULES)
async def completions(body: s.CompletionRequest, request: Request, serving: ServingDep
                      ) -> s.CompletionResponse | StreamingResponse:
    """OpenAI completions; SSE when ``stream`` (jobs admitted first, so a full queue is a 429). Planning
    (tokenizing, reading a named artifact from the store) runs in the thread pool, off the event loop."""
    plan = await run_in_threadpool(serving.plan_completion, body)
    if plan.stream:
        serving.submit(plan)
        return StreamingResponse(serving.stream(plan, request), media_type="text/event-stream", headers=SSE_HEADERS)
    return serving.completion_response(plan, await serving.run(plan, request))


@router.post("/chat/completions", response_model=None,
             description="OpenAI chat completions; server-sent events when `stream`.\n\n" + s.GENERATION_RULES)
async def chat_completions(body: s.ChatCompletionRequest, request: Request, serving: ServingDep
                           ) -> s.ChatCompletionResponse | StreamingResponse:
    """OpenAI chat completions; SSE when ``stream``."""
    plan = await run_in_threadpool(serving.plan_chat, body)
    if plan.stream:
        serving.submit(plan)
        return StreamingResponse(serving.stream(plan, request), media_type="text/event-stream", headers=SSE_HEADERS)
    return serving.chat_response(plan, await serving.run(plan, request))
