"""Native routes: ``/generate`` (the engine's full report) and the tokenizer endpoints lm-eval's remote
tokenizer calls (``/tokenize``, ``/detokenize``, ``/tokenizer_info``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from service.api import schemas as s
from service.api.deps import ServingDep, require_api_key

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/generate")
async def generate(body: s.GenerateRequest, request: Request, serving: ServingDep) -> s.GenerateResponse:
    plan = serving.plan_generate(body)
    (result,) = await serving.run(plan, request)
    return serving.generate_response(plan, result)


@router.post("/tokenize")
def tokenize(body: s.TokenizeRequest, serving: ServingDep) -> s.TokenizeResponse:
    return serving.tokenize(body)


@router.post("/detokenize")
def detokenize(body: s.DetokenizeRequest, serving: ServingDep) -> s.DetokenizeResponse:
    return serving.detokenize(body)


@router.get("/tokenizer_info")
def tokenizer_info(serving: ServingDep) -> dict[str, Any]:
    return serving.tokenizer_info()
