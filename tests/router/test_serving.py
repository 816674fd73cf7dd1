"""``CompletionService`` step by step, without HTTP: what ``submit`` enqueues, how admission refuses, how a
failed batch and an abort are cleaned up, how output events become a body or a stream. A real redis-server
and the real tokenizer; the pods come from an in-memory directory (no registry, no workers: the tests write
the workers' output events themselves)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from redis.asyncio import Redis

from pdserve.services.router import delivery
from pdserve.services.router.admission import Admission
from pdserve.services.router.dispatch import DispatchConfig, Dispatcher
from pdserve.services.router.errors import OpenAIError
from pdserve.services.router.metrics import RouterMetrics
from pdserve.services.router.models import ServedModel
from pdserve.services.router.schemas import CompletionRequest
from pdserve.services.router.serving import CompletionService, RouterState
from pdserve.services.router.settings import RouterSettings
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent, PrefillRequest

ROUTER_ID = "router-test"


def pod(pod_id: str, role: str = "decode") -> SimpleNamespace:
    return SimpleNamespace(pod_id=pod_id, role=role, host="10.0.0.5", kv_port=9100, http_port=0, free_blocks=100,
                           num_running=0, num_waiting=0, colocated=False, block_size=16, max_model_len=0,
                           started_at=None)


class Directory:
    """The registry as the dispatcher sees it. ``drop_decode_after_prefill``: the decode pods leave once the
    prefill pods were listed once (a batch's first prompt placed, its second finding no pod)."""

    def __init__(self, drop_decode_after_prefill: bool = False) -> None:
        self.listed = {"decode": [pod("decode-0")], "prefill": [pod("prefill-0", "prefill")]}
        self.drop_decode_after_prefill = drop_decode_after_prefill

    async def list_pods(self, role: str) -> list[SimpleNamespace]:
        found = list(self.listed[role])
        if role == "prefill" and self.drop_decode_after_prefill:
            self.listed["decode"] = []
        return found


def make_service(redis_url: str, processor, directory: Directory | None = None, **settings) -> CompletionService:
    s = RouterSettings(redis_url=redis_url, registry_cache_s=0.0, routing_mode="least_loaded", **settings)
    redis = Redis.from_url(s.redis_url)
    dispatcher = Dispatcher(redis, directory or Directory(), DispatchConfig.from_settings(s), router_id=ROUTER_ID)
    admission = Admission(s.max_concurrent_requests, s.max_queued_requests, s.max_queued_prompt_tokens,
                          s.retry_after_s)
    state = RouterState(settings=s, processor=processor, redis=redis, dispatcher=dispatcher,
                        metrics=RouterMetrics(s.served_name), defaults={}, admission=admission, router_id=ROUTER_ID)
    return CompletionService(state, ServedModel(s.served_name, s.model, processor.max_model_len, state.created))


def queued(redis_client, stream: str = keys.PREFILL_STREAM) -> list[PrefillRequest]:
    return [PrefillRequest.decode(fields) for _, fields in redis_client.xrange(stream)]


def write(redis_client, request_id: str, *events: OutputEvent) -> None:
    for event in events:
        redis_client.xadd(keys.output_stream(request_id), event.encode())


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(model="smollm2-135m-instruct", **fields)


def counters(service: CompletionService) -> tuple[int, int, int, dict]:
    admission = service.state.admission
    return admission.active, admission.queued, admission.queued_tokens, dict(service.state.dispatcher.in_flight)


@pytest.mark.asyncio
async def test_submit_enqueues_one_prefill_request_per_choice(redis_url, redis_client, processor):
    service = make_service(redis_url, processor)
    req = completion(prompt=[[1, 2, 3], [4, 5]], n=2, max_tokens=3, seed=7,
                            request_id="abc", priority=2, cache_salt="s1")
    job = await service.submit(req, "completion")
    assert job.response_id == "cmpl-abc"
    owner = f"@{service.state.router_id}"  # each id names its router: its keys share the router's slot
    stem = job.request_ids[0].removesuffix(owner)[:-2]
    assert stem.startswith("cmpl-abc-") and len(stem) == len("cmpl-abc-") + 8
    assert job.request_ids == [f"{stem}-{i}{owner}" for i in range(4)]
    got = queued(redis_client)
    assert [(q.request_id, q.choice_index, q.prompt_token_ids, q.sampling_params.seed) for q in got] == [
        (f"{stem}-0{owner}", 0, [1, 2, 3], 7), (f"{stem}-1{owner}", 1, [1, 2, 3], 8),
        (f"{stem}-2{owner}", 2, [4, 5], 7), (f"{stem}-3{owner}", 3, [4, 5], 8)]
    for q in got:
        assert (q.model, q.decode_pod_id, q.decode_host, q.decode_kv_port, q.router_id) == \
            ("smollm2-135m-instruct", "decode-0", "10.0.0.5", 9100, ROUTER_ID)
        assert (q.priority, q.cache_salt, q.sampling_params.max_tokens, q.output_token_ids) == (2, "s1", 3, [])
    assert [r.queue_entry for r in job.routes] == [e.decode() for e, _ in redis_client.xrange(keys.PREFILL_STREAM)]
    assert counters(service) == (1, 4, 10, {"decode-0": 4})
    await service.finish(job, aborted=False)
    assert counters(service) == (0, 0, 0, {})


@pytest.mark.asyncio
async def test_finish_aborts_every_choice_once_and_releases_the_counters(redis_url, redis_client, processor):
    service = make_service(redis_url, processor)
    job = await service.submit(completion(prompt="Hello", n=3, max_tokens=2), "completion")
    await service.finish(job, aborted=True, reason="client_disconnected")
    await service.finish(job, aborted=True, reason="client_disconnected")  # idempotent
    assert all(redis_client.exists(keys.aborted_key(rid)) for rid in job.request_ids)
    assert counters(service) == (0, 0, 0, {})
    aborted = service.state.metrics.registry.get_sample_value(
        "pdserve:requests_aborted_total", {"model_name": "smollm2-135m-instruct", "reason": "client_disconnected"})
    assert aborted == 1


@pytest.mark.asyncio
async def test_admission_refuses_with_exact_bodies(redis_url, redis_client, processor):
    service = make_service(redis_url, processor, max_concurrent_requests=1, max_queued_requests=3)
    with pytest.raises(OpenAIError) as too_many:
        await service.submit(completion(prompt="Hello", n=4, max_tokens=2), "completion")
    assert too_many.value.body() == {"error": {
        "message": "This request has 4 choices (1 prompts x n=4); the server queues at most 3 at once "
                   "(--max-queued-requests): send fewer prompts or a smaller n",
        "type": "BadRequestError", "param": "n", "code": 400}}
    job = await service.submit(completion(prompt="Hello", n=2, max_tokens=2), "completion")
    with pytest.raises(OpenAIError) as busy:
        await service.submit(completion(prompt="Hello", max_tokens=2), "completion")
    assert (busy.value.status, busy.value.headers) == (429, {"Retry-After": "1"})
    assert busy.value.message == "The server is serving its limit of 1 concurrent requests; retry later"
    service.state.admission.max_concurrent_requests = 0
    with pytest.raises(OpenAIError) as full:
        await service.submit(completion(prompt="Hello", n=2, max_tokens=2), "completion")
    assert full.value.message == "2 requests are waiting for prefill or a decode slot (limit 3); retry later"
    assert len(queued(redis_client)) == 2  # the refused requests enqueued nothing
    await service.finish(job, aborted=True)


@pytest.mark.asyncio
async def test_a_batch_whose_second_prompt_finds_no_pod_aborts_the_first(redis_url, redis_client, processor):
    service = make_service(redis_url, processor, Directory(drop_decode_after_prefill=True))
    req = completion(prompt=[[1, 2, 3], [4, 5]], max_tokens=2, request_id="batch")
    with pytest.raises(OpenAIError) as exc:
        await service.submit(req, "completion")
    assert exc.value.body()["error"] == {"message": "No decode pod is available; retry later",
                                         "type": "ServiceUnavailableError", "param": None, "code": 503}
    (first,) = queued(redis_client)
    assert first.prompt_token_ids == [1, 2, 3]
    assert redis_client.exists(keys.aborted_key(first.request_id))
    assert counters(service) == (0, 0, 0, {})


@pytest.mark.asyncio
async def test_events_dequeue_at_the_second_token_and_raise_a_worker_error(redis_url, redis_client, processor):
    service = make_service(redis_url, processor)
    job = await service.submit(completion(prompt=[1, 2, 3], max_tokens=5), "completion")
    (rid,) = job.request_ids
    write(redis_client, rid, OutputEvent(rid, token_ids=[5], text="a", prompt_tokens=3, completion_tokens=1),
          OutputEvent(rid, token_ids=[6], text="b", prompt_tokens=3, completion_tokens=2),
          OutputEvent(rid, error={"code": 400, "message": "bad stop", "type": "BadRequestError", "param": "stop"}))
    seen = []
    with pytest.raises(OpenAIError) as exc:
        async for index, event in service.events(job):
            seen.append((index, event.completion_tokens, service.state.admission.queued))
    assert seen == [(0, 1, 1), (0, 2, 0)]
    assert exc.value.body() == {"error": {"message": "bad stop", "type": "BadRequestError", "param": "stop",
                                          "code": 400}}
    await service.finish(job, aborted=True, reason=exc.value.type)


@pytest.mark.asyncio
async def test_full_response_assembles_the_body_and_counts_usage(redis_url, redis_client, processor):
    service = make_service(redis_url, processor)
    job = await service.submit(completion(prompt=[1, 2, 3], max_tokens=2), "completion")
    (rid,) = job.request_ids
    write(redis_client, rid, OutputEvent(rid, token_ids=[5], text="Hi", prompt_tokens=3, completion_tokens=1),
          OutputEvent(rid, token_ids=[6], text="!", finish_reason="length", prompt_tokens=3, completion_tokens=2))
    resp = await delivery.full_response(service, job)
    body = json.loads(resp.body)
    assert resp.status_code == 200
    assert (body["id"], body["object"], body["model"]) == (job.response_id, "text_completion", "smollm2-135m-instruct")
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [(0, "Hi!", "length")]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert counters(service) == (0, 0, 0, {})
    assert not redis_client.exists(keys.aborted_key(rid))
    sample = service.state.metrics.registry.get_sample_value
    assert sample("pdserve:request_success_total",
                  {"model_name": "smollm2-135m-instruct", "finished_reason": "length"}) == 1
    assert sample("pdserve:generation_tokens_total", {"model_name": "smollm2-135m-instruct"}) == 2


@pytest.mark.asyncio
async def test_full_response_to_a_client_gone_is_499_and_aborts(redis_url, redis_client, processor):
    service = make_service(redis_url, processor)
    job = await service.submit(completion(prompt=[1, 2, 3], max_tokens=2), "completion")

    async def gone() -> bool:
        return True

    resp = await delivery.full_response(service, job, gone)
    assert (resp.status_code, json.loads(resp.body)) == (499, {"error": {
        "message": "Client disconnected", "type": "InternalServerError", "param": None, "code": 499}})
    assert redis_client.exists(keys.aborted_key(job.request_ids[0]))
    assert counters(service) == (0, 0, 0, {})


@pytest.mark.asyncio
async def test_a_stream_ends_an_error_with_its_body_and_done(redis_url, redis_client, processor):
    service = make_service(redis_url, processor)
    job = await service.submit(completion(prompt=[1, 2, 3], max_tokens=4, stream=True), "completion")
    (rid,) = job.request_ids
    write(redis_client, rid, OutputEvent(rid, token_ids=[5], text="Hi", prompt_tokens=3, completion_tokens=1),
          OutputEvent(rid, error={"code": 500, "message": "engine died", "type": "InternalServerError"}))
    lines = [line async for line in delivery.stream_chunks(service, job)]
    assert json.loads(lines[0])["choices"][0]["text"] == "Hi"
    assert json.loads(lines[-2]) == {"error": {"message": "engine died", "type": "InternalServerError",
                                               "param": None, "code": 500}}
    assert lines[-1] == "[DONE]"
    assert redis_client.exists(keys.aborted_key(rid))
    assert service.state.metrics.registry.get_sample_value(
        "pdserve:requests_aborted_total", {"model_name": "smollm2-135m-instruct", "reason": "InternalServerError"}) == 1
    assert counters(service) == (0, 0, 0, {})


@pytest.mark.asyncio
async def test_router_log_lines_of_a_request_carry_its_id(redis_url, redis_client, processor):
    import asyncio
    import logging

    from support.log_capture import captured_log

    service = make_service(redis_url, processor)

    async def one(client_id: str) -> None:
        job = await service.submit(completion(prompt="Hello", max_tokens=2, request_id=client_id), "completion")
        await asyncio.sleep(0.01)  # the other request logs meanwhile
        await service.finish(job, aborted=True, reason="client_disconnected")

    with captured_log("pdserve.router") as stream:
        await asyncio.gather(one("a"), one("b"))
        logging.getLogger("pdserve.router").info("between requests")
    lines = stream.getvalue().splitlines()
    for rid in ("cmpl-a", "cmpl-b"):
        mine = [line for line in lines if f"request {rid}" in line]
        assert len(mine) == 2 and all(line.startswith(f"INFO pdserve.router [{rid}]: ") for line in mine), lines
    assert lines[-1] == "INFO pdserve.router [-]: between requests"
