"""``echo``, ``max_tokens=0`` and vLLM's ``prompt_logprobs`` through ``pdserve up`` (real redis-server, registry,
router and workers), split tiers (the prefill pod computes the prompt's logprobs) and colocated.

Oracle: HF transformers' log-softmax of the same prompt in fp32 (within 1e-3), sent twice so the second
request finds the prompt in the prefix cache (and, split, the router may prefill it on the decode pod). The
request shape is lm-evaluation-harness's ``local-completions`` loglikelihood request.
"""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.loadtest.cluster import Cluster
from support.hf_logprobs import hf_prompt_logprobs

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
TOL = 1e-3
# Over three KV blocks, so the second request finds full blocks of it in the prefix cache
TEXT = ("Photosynthesis is the process by which green plants use sunlight, water and a gas from the air to make "
        "sugar, releasing oxygen as a by-product. Question: Which gas do plants take in from the air? "
        "Answer: carbon dioxide")


@pytest.fixture(scope="module", params=["split", "colocated"])
def ensemble(request, tmp_path_factory):
    tiers = ["--prefill", "1", "--decode", "1"] if request.param == "split" else ["--colocated", "--decode", "1"]
    with Cluster(*tiers, "--dtype", "float32", log_dir=tmp_path_factory.mktemp(f"up-{request.param}"),
                 process=True) as ens:
        yield ens


def post(ensemble, path, body):
    r = httpx.post(f"{ensemble.router_url}{path}", json={"model": MODEL, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def check_echoed_prompt(lp, ids, want, tokenizer):
    assert lp["tokens"][:len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], lp["tokens"]))
    for i, (value, rank) in enumerate(want, start=1):
        got, top = lp["token_logprobs"][i], lp["top_logprobs"][i]
        assert abs(got - value) < TOL, (i, got, value)
        assert top[lp["tokens"][i]] == got  # the prompt token first, then the most likely one
        assert len(top) in (1, 2)
        # lm-eval's greedy test: the token is the argmax exactly when HF ranks it first
        assert (got == max(top.values())) == (rank == 1) or abs(max(top.values()) - got) < TOL


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token_ids"])
def test_lm_eval_scoring_request_matches_hf_also_when_cached(ensemble, tokenizer, model_dir, as_ids):
    ids = tokenizer.encode(TEXT)
    want = hf_prompt_logprobs(model_dir, ids)
    prompt = ids if as_ids else TEXT
    for attempt in range(2):  # the second finds the prompt's blocks cached
        body = post(ensemble, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0,
                                                  "temperature": 0})
        (choice,) = body["choices"]
        assert choice["text"] == (tokenizer.decode(ids) if as_ids else TEXT)
        assert len(choice["logprobs"]["tokens"]) == len(ids)
        check_echoed_prompt(choice["logprobs"], ids, want, tokenizer)
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}

    # the harness's own request: max_tokens=1, the generated token's logprob last
    body = post(ensemble, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1,
                                              "temperature": 0})
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and body["usage"]["completion_tokens"] == 1
    check_echoed_prompt(lp, ids, want, tokenizer)
    assert choice["text"] == (tokenizer.decode(ids) if as_ids else TEXT) + lp["tokens"][-1]
    assert lp["text_offset"][-1] == lp["text_offset"][-2] + len(lp["tokens"][-2])


def test_prompt_logprobs_field_has_vllm_shape(ensemble, tokenizer, model_dir):
    ids = tokenizer.encode(TEXT)
    want = hf_prompt_logprobs(model_dir, ids)
    body = post(ensemble, "/v1/completions", {"prompt": ids, "max_tokens": 2, "temperature": 0,
                                              "prompt_logprobs": 2})
    (choice,) = body["choices"]
    assert choice["logprobs"] is None
    pl = choice["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for i, (value, rank) in enumerate(want, start=1):
        entry = pl[i]
        first = next(iter(entry))
        assert first == str(ids[i])
        assert abs(entry[first]["logprob"] - value) < TOL
        assert abs(entry[first]["rank"] - rank) <= 1 + rank // 100  # near-ties may swap neighbours
        assert entry[first]["decoded_token"] == tokenizer.decode([ids[i]])
        assert sorted(v["rank"] for k, v in entry.items() if k != first) == [r for r in (1, 2) if r != entry[first]["rank"]]

    chat = post(ensemble, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                   "max_tokens": 2, "prompt_logprobs": 0})
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])


def sse(ensemble, path, body):
    chunks = []
    with httpx.stream("POST", f"{ensemble.router_url}{path}", json={"model": MODEL, "stream": True, **body},
                      timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: ")
                if line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    return chunks


def test_echo_streamed_equals_not_streamed(ensemble, tokenizer):
    request = {"prompt": TEXT, "echo": True, "logprobs": 0, "max_tokens": 4, "temperature": 0}
    full = post(ensemble, "/v1/completions", request)["choices"][0]
    chunks = sse(ensemble, "/v1/completions", request)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == full["text"]
    assert full["text"].startswith(TEXT) and len(full["text"]) > len(TEXT)
    tokens = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
              for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == full["logprobs"]["tokens"]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    scored = sse(ensemble, "/v1/completions", {**request, "max_tokens": 0})
    assert "".join(c["choices"][0]["text"] for c in scored if c["choices"]) == TEXT


def test_chat_echo_prepends_the_last_assistant_message(ensemble):
    question = {"role": "user", "content": "What is the capital of France?"}
    start = "The capital of France is"
    cont = {"messages": [question, {"role": "assistant", "content": start}], "add_generation_prompt": False,
            "continue_final_message": True, "max_tokens": 6, "temperature": 0}
    plain = post(ensemble, "/v1/chat/completions", cont)["choices"][0]["message"]["content"]
    echoed = post(ensemble, "/v1/chat/completions", {**cont, "echo": True})["choices"][0]["message"]["content"]
    assert echoed == start + plain and plain
    streamed = sse(ensemble, "/v1/chat/completions", {**cont, "echo": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"]) == echoed
    # the last message is the user's: nothing to echo (vLLM's rule)
    ask = {"messages": [question], "max_tokens": 6, "temperature": 0}
    assert post(ensemble, "/v1/chat/completions", {**ask, "echo": True})["choices"][0]["message"]["content"] == \
        post(ensemble, "/v1/chat/completions", ask)["choices"][0]["message"]["content"]
