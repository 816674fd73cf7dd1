"""Speculative decoding through ``pdserve up --speculative-config`` (real processes, the ``openai`` client):
the decode pod speculates on requests handed over from the prefill pod; streamed output equals
non-streamed, ``usage`` is exact, and greedy output equals the offline engine *without* speculation."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.loadtest.cluster import Cluster

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
COPY = ("Repeat this text exactly, word for word: Order 4411: two boxes of blue ceramic tiles, one bag of grout, "
        "delivery to 18 Harbour Street on Tuesday morning.")


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory):
    with Cluster("--prefill", "1", "--decode", "1", "--dtype", "float32", "--speculative-config", json.dumps(SPEC),
                 log_dir=tmp_path_factory.mktemp("up"), process=True) as ens:
        yield ens


@pytest.mark.slow
def test_speculating_decode_pod_matches_plain_offline_engine(ensemble, tokenizer):
    from pdserve import LLM, SamplingParams

    client = openai.OpenAI(base_url=f"{ensemble.router_url}/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": COPY}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    # transformers 5 returns a BatchEncoding from apply_chat_template
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    want = LLM(MODEL, dtype="float32").generate([prompt_ids], SamplingParams(temperature=0, max_tokens=48))[0].outputs[0]

    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=48)
    assert full.choices[0].message.content == want.text
    assert full.choices[0].finish_reason == want.finish_reason
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(prompt_ids), len(want.token_ids))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=48,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    usage = next(c.usage for c in chunks if c.usage)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), len(want.token_ids))

    (decode,) = ensemble.pods("decode")
    stats = ensemble.stats(decode)
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["spec_decode_mean_accepted_length"] > 1
    metrics = httpx.get(f"http://{decode['host']}:{decode['http_port']}/metrics", timeout=10).text
    for name in ("pdserve:spec_decode_num_drafts_total", "pdserve:spec_decode_num_draft_tokens_total",
                 "pdserve:spec_decode_num_accepted_tokens_total", "pdserve:spec_decode_num_accepted_tokens_per_pos_total"):
        assert f"\n{name}{{" in metrics, name
