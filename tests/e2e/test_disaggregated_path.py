"""The disaggregated path end to end: ``pdserve up`` (real redis-server, registry, router, one prefill
and one decode worker as real processes), driven over HTTP with the official ``openai`` client.

Oracles: the offline ``LLM`` (itself token-exact against HF transformers) for greedy outputs through
prefill -> KV transfer -> decode; the tokenizer's chat template for ``usage``; the decode pod's own
block counters for what an aborted stream leaves behind.
"""

from __future__ import annotations

import time

import httpx
import pytest

from pdserve.loadtest.sse import read_chunks
from pdserve.loadtest.cluster import Cluster
from support.otlp_receiver import OTLPReceiver

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
LENGTHS = [1, 15, 16, 17, 33, 120]


@pytest.fixture(scope="module")
def otlp():
    with OTLPReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory, otlp):
    # Every process exports its spans to the in-test receiver (docs/observability.md "Tracing"), 50 ms batches.
    with Cluster("--prefill", "1", "--decode", "1", "--dtype", "float32", log_dir=tmp_path_factory.mktemp("up"),
                 env={"PDSERVE_ENABLE_PROMPT_TOKENS_DETAILS": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
                      "OTEL_BSP_SCHEDULE_DELAY": "50"}, process=True) as ens:
        yield ens


@pytest.fixture(scope="module")
def client(ensemble):
    return openai.OpenAI(base_url=f"{ensemble.router_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def offline():
    from pdserve import LLM

    return LLM(MODEL, dtype="float32")


def test_greedy_through_the_shm_connector_equals_offline_engine(tmp_path, offline, prompt_of):
    """``--kv-transfer-config '{"kv_connector": "shm"}'``: the blocks cross /dev/shm instead of the socket.
    Its own ensemble, started and stopped before the module's tcp one (one ensemble at a time). Oracle: the
    offline engine's greedy text; every block arrived; the prefill pod's log says it used shared memory."""
    from pdserve import SamplingParams

    lengths = [17, 120]
    prompts = [prompt_of(n, offset=5 * i) for i, n in enumerate(lengths)]
    want = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    with Cluster("--prefill", "1", "--decode", "1", "--dtype", "float32",
                 "--kv-transfer-config", '{"kv_connector": "shm"}', log_dir=tmp_path, process=True) as ens:
        shm_client = openai.OpenAI(base_url=f"{ens.router_url}/v1", api_key="unused", max_retries=0, timeout=300)
        for prompt, expected in zip(prompts, want):
            got = shm_client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16)
            assert got.choices[0].text == expected.outputs[0].text, len(prompt)
        assert ens.stats(ens.pods("decode")[0])["kv_blocks_received"] == sum(-(-n // 16) for n in lengths)
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file())
    assert "through shared memory (kv_connector shm)" in logs


def test_chat_answers_paris_streamed_and_not_identical(client, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32)
    text = full.choices[0].message.content
    assert "Paris" in text
    assert full.choices[0].finish_reason == "stop"
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids
    assert full.usage.prompt_tokens == len(prompt_ids)
    # completion tokens: the answer's tokens plus the EOS that ended it
    assert full.usage.completion_tokens == len(tokenizer.encode(text, add_special_tokens=False)) + 1
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_greedy_through_kv_transfer_equals_offline_engine(ensemble, client, offline, prompt_of):
    from pdserve import SamplingParams

    prompts = [prompt_of(n, offset=3 * i) for i, n in enumerate(LENGTHS)]
    want = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    decode_before = ensemble.stats(ensemble.pods("decode")[0])["kv_blocks_received"]
    for prompt, expected in zip(prompts, want):
        got = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24)
        assert got.choices[0].text == expected.outputs[0].text, len(prompt)
        assert got.usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert got.usage.prompt_tokens == len(prompt)
    # every prompt's blocks crossed the wire (partial last blocks included)
    received = ensemble.stats(ensemble.pods("decode")[0])["kv_blocks_received"] - decode_before
    assert received == sum(-(-n // 16) for n in LENGTHS)


def test_logits_processors_through_kv_transfer_equal_offline_engine(client, offline, tokenizer, prompt_of):
    """The first token is sampled on the prefill pod, the rest on the decode pod: both apply the request's
    processors (``bad_words`` must see the hand-over's first token as output). Oracles: the offline engine
    with the same parameters, and each processor's definition."""
    from pdserve import SamplingParams

    prompt = prompt_of(40, offset=5)
    plain = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    allowed = sorted(set(prompt))
    forced = next(t for t in range(300, 400) if t not in plain.token_ids)
    word = tokenizer.decode(plain.token_ids[1:3]).strip().split()[0]
    cases = [
        dict(temperature=0, allowed_token_ids=allowed),
        dict(temperature=0, logit_bias={forced: 100.0}),
        dict(temperature=0, bad_words=[word]),
        dict(temperature=1.0, seed=11, min_p=0.3, logit_bias={plain.token_ids[0]: -100.0}),
    ]
    for case in cases:
        want = offline.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, **case))[0].outputs[0]
        bias = case.get("logit_bias")
        extra = {k: v for k, v in case.items() if k in ("allowed_token_ids", "bad_words", "min_p")}
        got = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=case["temperature"], seed=case.get("seed"),
            logit_bias={str(k): v for k, v in bias.items()} if bias else None,
            extra_body={"ignore_eos": True, **extra})
        assert got.choices[0].text == want.text, case
        if "allowed_token_ids" in case:
            assert set(want.token_ids) <= set(allowed)
        if bias and bias.get(forced):
            assert want.token_ids == [forced] * 12
        if "bad_words" in case:
            banned = SamplingParams(bad_words=[word])
            banned.update_from_tokenizer(tokenizer)
            out = want.token_ids
            assert want.text != plain.text
            assert not any(out[i:i + len(seq)] == seq for seq in banned.bad_words_token_ids for i in range(len(out)))
        if "min_p" in case:
            assert want.token_ids[0] != plain.token_ids[0]


def test_client_disconnect_frees_decode_blocks(ensemble):
    decode = ensemble.pods("decode")[0]
    before = ensemble.stats(decode)["kv_blocks_used"]
    body = {"model": MODEL, "prompt": "Tell me a very long story about a dragon.", "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{ensemble.router_url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for _ in read_chunks(resp.iter_lines()):
                break  # first chunk, then hang up
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        stats = ensemble.stats(decode)
        if stats["kv_blocks_used"] == before and stats["num_running"] == 0:
            break
        time.sleep(0.1)
    assert stats["kv_blocks_used"] == before
    assert stats["num_running"] == 0


def test_bad_input_gets_openai_error_and_server_stays_healthy(ensemble, client):
    resp = httpx.post(f"{ensemble.router_url}/v1/completions",
                      json={"model": MODEL, "prompt": "hi", "temperature": -1}, timeout=30)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "temperature"
    assert set(error) >= {"message", "type", "param", "code"}
    ok = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4)
    assert ok.choices[0].text


def test_a_queue_entry_delivered_twice_is_decoded_once(ensemble, offline, prompt_of):
    """Redis Streams deliver at least once: a prefill worker killed after the decode pod's commit reply but
    before its XACK leaves the entry pending, and another worker reclaims it (XAUTOCLAIM) and runs it again.
    The fault is injected by queueing a second copy of the in-flight request's entry — what the reclaiming
    worker receives. Oracle: the client's stream equals the offline engine's greedy text with no error, the
    decode pod generated the request's tokens once, and the redelivered entry is acknowledged."""

    import redis

    from pdserve import SamplingParams
    from pdserve.shared.protocol import keys
    from pdserve.shared.protocol.messages import PrefillRequest

    prompt = prompt_of(40, offset=7)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = offline.generate([prompt], params)[0].outputs[0]
    decode = ensemble.pods("decode")[0]
    before = ensemble.stats(decode)["generation_tokens"]
    r = redis.Redis.from_url(ensemble.redis_url)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    text, usage, errors, redelivered = "", None, [], False
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{ensemble.router_url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for data in read_chunks(resp.iter_lines()):
                errors += [data["error"]] if "error" in data else []
                usage = data.get("usage") or usage
                text += "".join(c.get("text") or "" for c in data.get("choices") or [])
                if text and not redelivered:
                    # the entry a reclaiming worker gets is the same one: it names the router relaying the output
                    routers = [k.decode() for k in r.scan_iter(match=keys.relay_stream("*"))]
                    assert len(routers) == 1, routers
                    router_id = routers[0].removeprefix(keys.relay_stream("").removesuffix("}:relay"))
                    router_id = router_id.removesuffix("}:relay")
                    # n = 1 and no client id: the internal request id is the response's, owned by the router
                    rid = keys.owned_request_id(data["id"], router_id)
                    # the first worker acknowledged its entry: it handed the request over
                    deadline = time.monotonic() + 30
                    while r.xpending(keys.PREFILL_STREAM, keys.PREFILL_GROUP)["pending"] and time.monotonic() < deadline:
                        time.sleep(0.01)
                    again = PrefillRequest(rid, MODEL, prompt, params, decode["pod_id"], decode["host"],
                                           int(decode["kv_port"]), time.time(), router_id=router_id)
                    r.xadd(keys.PREFILL_STREAM, again.encode())
                    redelivered = True
    assert redelivered and not errors
    assert text == want.text and usage["completion_tokens"] == 48
    prefill = ensemble.pods("prefill")[0]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (r.xpending(keys.PREFILL_STREAM, keys.PREFILL_GROUP)["pending"]
                                           or ensemble.stats(prefill)["requests_tracked"]):
        time.sleep(0.2)
    assert r.xpending(keys.PREFILL_STREAM, keys.PREFILL_GROUP)["pending"] == 0
    assert ensemble.stats(decode)["generation_tokens"] - before == 48
    assert f"request {rid} is already on decode pod" in (ensemble.log_dir / "prefill-0.log").read_text()
    r.delete(keys.output_stream(rid))  # the replayed first token's stream (it expires on its own as well)
    r.close()


def test_decode_pod_reads_its_request_stream_again_after_it_expired(ensemble, offline, prompt_of):
    """A decode pod's own request stream expires when the pod stops heartbeating (the registry sets its TTL);
    a live pod whose stream expired anyway (a long registry outage) must read the stream the router's next
    XADD creates, without a consumer group. Oracle: the offline engine's tokens on the output stream."""
    import redis

    from pdserve import SamplingParams
    from pdserve.shared.protocol import keys
    from pdserve.shared.protocol.messages import OutputEvent, PrefillRequest

    prompt = prompt_of(20, offset=9)
    params = SamplingParams(temperature=0, max_tokens=8)
    want = offline.generate([prompt], params)[0].outputs[0].token_ids
    decode = ensemble.pods("decode")[0]
    r = redis.Redis.from_url(ensemble.redis_url)
    stream = keys.decode_stream(decode["pod_id"])
    assert r.delete(stream) == 1  # as its expiry would
    request = PrefillRequest("expired-stream-0", MODEL, prompt, params, decode["pod_id"], decode["host"],
                             int(decode["kv_port"]), time.time())
    r.xadd(stream, request.encode())
    tokens, last, finished = [], "0-0", False
    deadline = time.monotonic() + 60
    while not finished and time.monotonic() < deadline:
        for _, entries in r.xread({keys.output_stream(request.request_id): last}, block=1000) or []:
            for last, fields in entries:
                event = OutputEvent.decode(fields)
                assert event.error is None, event.error
                tokens += event.token_ids
                finished = finished or event.finish_reason is not None
    assert tokens == want
    r.delete(keys.output_stream(request.request_id))
    r.close()


def test_usage_reports_the_prompts_prefix_cache_hit(client, prompt_of):
    """``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``): a new 40-token prompt
    hits nothing; its repeat hits its 2 full blocks (32 tokens) on the prefill pod; streamed usage says the same."""
    prompt = prompt_of(40, offset=50)
    first = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=4)
    assert again.usage.prompt_tokens_details.cached_tokens == 32 and again.usage.prompt_tokens == 40
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32


def test_responses_conversation_continues_from_the_stored_one_with_a_prefix_cache_hit(client, offline, tokenizer):
    """``/v1/responses`` with ``previous_response_id`` on the real ensemble: the continuation's prompt is the
    chat template over the stored input and output and the new input (its greedy answer equals the offline
    engine's on that prompt), and its shared prefix is served from the prefix cache."""
    from pdserve import SamplingParams

    first = client.responses.create(model=MODEL, input="What is the capital of France?", temperature=0,
                                    max_output_tokens=8)
    second = client.responses.create(model=MODEL, input="And of Italy?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=8)

    def ids(messages):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    asked = [{"role": "user", "content": "What is the capital of France?"}]
    before = ids(asked)
    prompt = ids(asked + [{"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "And of Italy?"}])
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert second.output_text == want
    assert second.usage.input_tokens == len(prompt)
    common = next((i for i, (a, b) in enumerate(zip(before, prompt)) if a != b), len(before))
    assert second.usage.input_tokens_details.cached_tokens >= 16 * (common // 16) >= 32
    assert client.responses.retrieve(second.id).output_text == second.output_text


# ---- tracing ----------------------------------------------------------------------------------------------

ROUTER_STEPS = {"validate", "tokenize", "admission", "route"}
ROOT_CHILDREN = ROUTER_STEPS | {"queue", "prefill", "kv_transfer", "decode"}
TRANSFER_CHILDREN = {"reserve", "blocks", "commit"}


def kv_sent_bytes(pod: dict) -> float:
    text = httpx.get(f"http://{pod['host']}:{pod['http_port']}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:kv_transfer_sent_bytes_total"))


def covered_s(spans, start_ns: int, end_ns: int) -> float:
    """Seconds of [start_ns, end_ns] inside at least one of the spans (the union of their intervals)."""
    covered, cursor = 0, start_ns
    for s in sorted(spans, key=lambda s: s.start_ns):
        lo, hi = max(s.start_ns, cursor), min(s.end_ns, end_ns)
        if hi > lo:
            covered += hi - lo
            cursor = hi
    return covered / 1e9


def test_one_request_is_one_trace_through_router_queue_prefill_transfer_and_decode(ensemble, otlp, prompt_of):
    """Oracles: the client's own trace context, the prefill pod's byte counter, the client's stopwatch."""
    (prefill,) = ensemble.pods("prefill")
    before = kv_sent_bytes(prefill)
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    prompt = prompt_of(100)  # above any local-prefill threshold: the hand-over path
    started = time.perf_counter()
    resp = httpx.post(f"{ensemble.router_url}/v1/completions", timeout=120,
                      headers={"traceparent": f"00-{client_trace}-{client_span}-01"},
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    wall_s = time.perf_counter() - started
    assert resp.status_code == 200, resp.text
    body = resp.json()

    spans = otlp.wait_for(lambda got: {s.name for s in got if s.trace_id == client_trace} >=
                          ROOT_CHILDREN | TRANSFER_CHILDREN | {f"text_completion {MODEL}"})
    spans = [s for s in spans if s.trace_id == client_trace]
    (root,) = [s for s in spans if s.parent_span_id == client_span]  # the client's traceparent is honoured
    assert root.name == f"text_completion {MODEL}" and root.service == "pdserve-router"
    assert root.attributes["gen_ai.request.model"] == MODEL
    assert root.attributes["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"] == 100
    assert root.attributes["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"]
    assert root.attributes["gen_ai.response.finish_reasons"] == [body["choices"][0]["finish_reason"]]
    by_name = {s.name: s for s in spans}
    assert {by_name[n].service for n in ROUTER_STEPS} == {"pdserve-router"}
    assert {by_name[n].service for n in ("queue", "prefill", "kv_transfer", *TRANSFER_CHILDREN)} == {"pdserve-prefill"}
    assert by_name["decode"].service == "pdserve-decode"
    assert all(by_name[n].parent_span_id == root.span_id for n in ROOT_CHILDREN)
    assert all(by_name[n].parent_span_id == by_name["kv_transfer"].span_id for n in TRANSFER_CHILDREN)
    assert by_name["route"].attributes["pdserve.prefill"] == "remote"
    assert by_name["route"].attributes["pdserve.decode_pod"] == by_name["decode"].resource["service.instance.id"]
    assert by_name["decode"].attributes["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"]
    assert "first_token" in by_name["prefill"].events and "join_batch" in by_name["decode"].events

    sent = by_name["blocks"].attributes["pdserve.kv.bytes"]
    assert sent > 0 and sent == kv_sent_bytes(prefill) - before

    # What adds up: the root span (the router's arrival to its last event relayed) is the client's wall time
    # less HTTP and JSON (within 10%), and the union of its children's intervals (router steps, queue wait,
    # prefill, KV transfer, decode) covers 90% of the root: no hop of the request goes unaccounted for.
    assert 0.9 * wall_s <= root.duration_s <= wall_s, (root.duration_s, wall_s)
    children = [s for s in spans if s.parent_span_id == root.span_id]
    timeline = [(s.name, (s.start_ns - root.start_ns) / 1e9, s.duration_s)
                for s in sorted(children, key=lambda s: s.start_ns)]
    assert covered_s(children, root.start_ns, root.end_ns) >= 0.9 * root.duration_s, timeline


def _chat_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_greedy_under_a_grammar_through_kv_transfer_equals_offline_engine(client, offline, tokenizer):
    """The prefill pod samples the first token under the grammar; the decode pod rebuilds the matcher by replaying
    it. Oracles: the offline engine under the same grammar, and jsonschema."""
    import jsonschema

    from pdserve import SamplingParams
    from support.structured_schemas import SCHEMAS

    for name in ("array of objects", "pattern date"):
        schema = SCHEMAS[name]
        messages = [{"role": "user", "content": f"An example of {name} as JSON."}]
        want = offline.generate(_chat_ids(tokenizer, messages), SamplingParams(
            temperature=0, max_tokens=80, structured_outputs={"json": schema}))[0].outputs[0]
        got = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=80,
                                             response_format={"type": "json_schema", "json_schema": {
                                                 "name": "answer", "strict": True, "schema": schema}})
        assert got.choices[0].message.content == want.text, name
        assert got.choices[0].finish_reason == "stop"
        jsonschema.validate(__import__("json").loads(want.text), schema)
    regex = r"[A-Z][a-z]+, [A-Z][a-z]+"
    messages = [{"role": "user", "content": "Name a city and its country."}]
    want = offline.generate(_chat_ids(tokenizer, messages), SamplingParams(
        temperature=0, max_tokens=40, structured_outputs={"regex": regex}))[0].outputs[0].text
    chunks = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40, stream=True,
                                            extra_body={"structured_outputs": {"regex": regex}})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_openai_sdk_parse_returns_the_pydantic_model(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):  # bounded, so a 135M model's greedy answer fits the token budget
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population: int = Field(ge=0, le=10**8)

    done = client.chat.completions.parse(model=MODEL, temperature=0, max_tokens=100, response_format=City,
                                         messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    assert isinstance(done.choices[0].message.parsed, City)
    assert done.choices[0].finish_reason == "stop"


def test_langchain_openai_structured_output_and_bound_tools(ensemble):
    """langchain-openai's ``with_structured_output`` (json_schema) returns the pydantic model, and ``bind_tools``
    with a named tool choice (guided by the tool's schema) returns a tool call whose arguments validate."""
    import jsonschema
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    llm = ChatOpenAI(model=MODEL, base_url=f"{ensemble.router_url}/v1", api_key="unused", temperature=0,
                     max_tokens=60, max_retries=0, timeout=300)
    city = llm.with_structured_output(City, method="json_schema").invoke("Describe Paris as JSON.")
    assert isinstance(city, City)
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}}
    message = llm.bind_tools([weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], weather["function"]["parameters"])


def test_a_schema_the_grammar_compiler_refuses_gets_a_400_from_the_worker_naming_the_field(ensemble, client):
    """A lookbehind passes the router's meta-schema check; the engine's compiler refuses it: a 400, not a 500."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                       extra_body={"structured_outputs": {"json": schema}})
    assert err.value.body["param"] == "structured_outputs"
    assert "Lookbehind is not supported" in err.value.body["message"]
    assert httpx.get(f"{ensemble.router_url}/health", timeout=30).status_code == 200
