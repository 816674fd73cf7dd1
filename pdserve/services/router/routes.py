"""The router's HTTP routes: each handler reads the request and makes one call into a service
(``CompletionService``, ``TokenizationService``, ``ServedModel``) that ``app.py`` put on ``app.state``."""

from __future__ import annotations

import asyncio
import json
from importlib.metadata import PackageNotFoundError, version as package_version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from pdserve.shared.protocol import keys

from . import errors, inflight
from .openai_responses import ResponsesRequest, ResponsesService
from .schemas import ChatCompletionRequest, CompletionRequest
from .serving import CompletionService, GenerationRequest, RouterState

router = APIRouter()
HEALTH_TIMEOUT_S = 2.0


def _state(request: Request) -> RouterState:
    return request.app.state.router


def _version() -> str:
    try:
        return package_version("pdserve")
    except PackageNotFoundError:
        return "unknown"


async def json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object, else 400 ``OpenAIError``."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise errors.bad_request(f"Malformed JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise errors.bad_request("Request body must be a JSON object")
    return body


# ---- model / health / metrics ------------------------------------------------------------------------

@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [await request.app.state.model.card(_state(request).dispatcher)]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
    """OpenAI's ``models.retrieve``: the served model's card (by its served name or ``--model``), else 404."""
    request.app.state.model.check(model)
    return await request.app.state.model.card(_state(request).dispatcher)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": _version()}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    try:
        # bounded: the client retries connection errors for seconds, /health must answer now
        await asyncio.wait_for(_state(request).redis.ping(), HEALTH_TIMEOUT_S)
    except Exception as exc:
        reason = "no answer within 2 s" if isinstance(exc, asyncio.TimeoutError) else str(exc)
        return JSONResponse({"status": "unavailable", "reason": f"redis: {reason}"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    st = _state(request)
    try:
        # bounded like /health: a scrape must not hang on a frozen Redis
        st.metrics.queue_depth.set(await asyncio.wait_for(st.redis.xlen(keys.PREFILL_STREAM), HEALTH_TIMEOUT_S))
        st.metrics.redis_up.set(1)
    except Exception:
        st.metrics.redis_up.set(0)  # Redis down: the other metrics are still worth scraping
    return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/pdserve/requests")
async def requests_in_flight(request: Request) -> dict[str, Any]:
    """The requests this router is serving, one entry per choice with its phase (inflight.py; ``pdserve top``).
    503 when Redis does not answer (the phases of waiting choices are read there)."""
    st = _state(request)
    try:
        choices = await asyncio.wait_for(st.jobs.snapshot(st.redis), HEALTH_TIMEOUT_S)
    except (RedisError, OSError, asyncio.TimeoutError) as exc:
        raise errors.redis_unavailable(exc, st.settings.retry_after_s) from exc
    return inflight.as_json(choices)


# ---- tokenizer endpoints (vLLM's shapes) ---------------------------------------------------------------

@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    return await request.app.state.tokenization.tokenize(await json_body(request))


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    return await request.app.state.tokenization.detokenize(await json_body(request))


# ---- generation ---------------------------------------------------------------------------------------

async def _create(request: Request, body: GenerationRequest, kind: str) -> Response:
    service: CompletionService = request.app.state.service
    return await service.create(body, kind, header_id=request.headers.get("x-request-id"),
                                api_key_id=getattr(request.state, "api_key_id", None),
                                is_disconnected=request.is_disconnected,
                                traceparent=request.headers.get("traceparent"))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    return await _create(request, body, "chat")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    return await _create(request, body, "completion")


# ---- Responses API (openai_responses.py) -------------------------------------------------------------------

def _responses(request: Request) -> ResponsesService:
    return ResponsesService(request.app.state.service)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    return await _responses(request).create(body, api_key_id=getattr(request.state, "api_key_id", None),
                                            is_disconnected=request.is_disconnected,
                                            traceparent=request.headers.get("traceparent"))


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
    return await _responses(request).retrieve(response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    return await _responses(request).delete(response_id)
