"""Native routes: ``/generate`` (the engine's full report) and the tokenizer endpoints lm-eval's remote
tokenizer calls (``/tokenize``, ``/detokenize``, ``/tokenizer_info``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from service.api import schemas as s
from service.api.body import JSONBodyRoute
from service.api.deps import ServingDep, require_api_key

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=JSONBodyRoute)


@router.post("/generate", description="One prompt in, the engine's report out (with the configuration snapshot "
             "it ran with).\n\n" + s.GENERATION_RULES)
async def generate(body: s.GenerateRequest, request: Request, serving: ServingDep) -> s.GenerateResponse:
    """One prompt in, the engine's `DecodeReport` out (with the configuration snapshot it ran with)."""
    plan = await run_in_threadpool(serving.plan_generate, body)  # tokenizing: off the event loop
    (result,) = await serving.run(plan, request)
    return serving.generate_response(plan, result)


@router.post("/tokenize")
def tokenize(body: s.TokenizeRequest, serving: ServingDep) -> s.TokenizeResponse:
    """Token ids of a text or of chat messages (vLLM's shape)."""
    return serving.tokenize(body)


@router.post("/detokenize")
def detokenize(body: s.DetokenizeRequest, serving: ServingDep) -> s.DetokenizeResponse:
    """Text of token ids (vLLM's shape)."""
    return serving.detokenize(body)


@router.get("/tokenizer_info")
def tokenizer_info(serving: ServingDep) -> dict[str, Any]:
    """Special tokens and chat template (what lm-eval's RemoteTokenizer reads)."""
    return serving.tokenizer_info()
