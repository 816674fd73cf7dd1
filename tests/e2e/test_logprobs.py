"""Logprobs end to end: ``pdserve up`` (real redis-server, registry, router, a prefill and a decode worker) over
HTTP, in fp32.

* No token is ever dropped when logprobs are asked for, even with the CPU contended (busy-loop processes beside
  the ensemble, which once made the worker read a step's logprobs after the next step had changed them).
  Oracle: the offline engine's greedy text; ``len(logprobs) == usage.completion_tokens``.
* Byte tokens (pieces of a UTF-8 character) have their own bytes and ``bytes:\\xNN`` strings, the chosen token is
  among its alternatives with the same value, alternatives never collapse. Oracles: the tokenizer's own byte
  mapping (GPT-2's byte-level table) and HF transformers' log-softmax in fp32.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from pdserve.loadtest.cluster import Cluster

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
COUNT = "Count from one to twenty in words: one, two, three,"
EMOJI = "Kneeling person emoji: 🧎 🧎 🧎"
EMOJI_CHAT = [{"role": "user", "content": "Reply with only this emoji, three times: 🧎"}]


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory):
    with Cluster("--prefill", "1", "--decode", "1", "--dtype", "float32",
                 log_dir=tmp_path_factory.mktemp("up"), process=True) as ens:
        yield ens


@pytest.fixture(scope="module")
def offline():
    from pdserve import LLM

    return LLM(MODEL, dtype="float32")


@pytest.fixture(scope="module")
def hf():
    """HF transformers' model and tokenizer, fp32: the log-softmax oracle."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.shared.models.resolve import resolve_model

    path = resolve_model(MODEL)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def log_softmax(model, ids: list[int]):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def own_bytes(tokenizer, token_id: int) -> bytes:
    """The token's bytes from the tokenizer's byte-level piece (GPT-2's byte <-> character table)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = {ch: b for b, ch in bytes_to_unicode().items()}
    return bytes(table[ch] for ch in tokenizer.convert_ids_to_tokens(token_id))


def rendered(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@contextmanager
def busy_cpu(n: int):
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()


def sse(resp: httpx.Response) -> list[dict]:
    chunks = []
    for line in resp.iter_lines():
        if not line or line.startswith(":"):  # an SSE comment (keep-alive) carries no data
            continue
        assert line.startswith("data: "), line
        if line != "data: [DONE]":
            chunks.append(json.loads(line[6:]))
    return chunks


def complete(url: str, body: dict) -> tuple[str, list[str], list[float], int]:
    """(text, logprob tokens, token logprobs, usage.completion_tokens), streamed or not."""
    if not body.get("stream"):
        resp = httpx.post(url + "/v1/completions", json=body, timeout=600)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        lp = data["choices"][0]["logprobs"]
        return data["choices"][0]["text"], lp["tokens"], lp["token_logprobs"], data["usage"]["completion_tokens"]
    text, tokens, values, usage = "", [], [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        assert resp.status_code == 200
        for chunk in sse(resp):
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += choice["text"]
                if choice["logprobs"]:
                    tokens += choice["logprobs"]["tokens"]
                    values += choice["logprobs"]["token_logprobs"]
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
    return text, tokens, values, usage


def test_logprobs_never_drop_a_token_under_cpu_contention(ensemble, offline):
    from pdserve import SamplingParams

    expected = offline.generate([COUNT], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    bodies = [{"model": MODEL, "prompt": COUNT, "max_tokens": 40, "temperature": 0, "logprobs": 1,
               "stream": i % 2 == 1, "stream_options": {"include_usage": True} if i % 2 else None}
              for i in range(8)]
    with busy_cpu(3), ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda body: complete(ensemble.router_url, body), bodies))
    for text, tokens, values, completion_tokens in results:
        assert text == expected
        assert len(tokens) == len(values) == completion_tokens == 40
        assert "".join(tokens) == text


def test_completion_byte_tokens_have_their_own_bytes_and_distinct_alternatives(ensemble, offline, hf):
    from pdserve import SamplingParams

    model, tokenizer = hf
    out = offline.generate([EMOJI], SamplingParams(temperature=0, max_tokens=3))[0]
    ids = out.outputs[0].token_ids
    raw = [own_bytes(tokenizer, t) for t in ids]
    assert any(rendered(b).startswith("bytes:") for b in raw)  # the case under test: pieces of a character
    resp = httpx.post(ensemble.router_url + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": EMOJI, "temperature": 0, "logprobs": 5, "max_tokens": 3})
    choice = resp.json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [rendered(b) for b in raw]
    assert b"".join(raw) == choice["text"].encode("utf-8")
    lsm = log_softmax(model, out.prompt_token_ids + ids)
    for i, token_id in enumerate(ids):
        row = lsm[len(out.prompt_token_ids) - 1 + i]
        assert lp["token_logprobs"][i] == pytest.approx(float(row[token_id]), abs=1e-3)
        top = lp["top_logprobs"][i]
        assert top[lp["tokens"][i]] == lp["token_logprobs"][i]  # the chosen one, with the same value
        values, top_ids = row.topk(5)
        assert len(top) == 5
        assert top == pytest.approx({rendered(own_bytes(tokenizer, t)): float(v)
                                     for t, v in zip(top_ids.tolist(), values.tolist())}, abs=1e-3)


def test_chat_byte_tokens_carry_their_own_bytes_which_rebuild_the_text(ensemble, offline, hf):
    from pdserve import SamplingParams

    model, tokenizer = hf
    prompt = tokenizer.apply_chat_template(EMOJI_CHAT, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    ids = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    raw = [own_bytes(tokenizer, t) for t in ids]
    assert any(rendered(b).startswith("bytes:") for b in raw)
    lsm = log_softmax(model, prompt + ids)
    for stream in (False, True):
        body = {"model": MODEL, "messages": EMOJI_CHAT, "temperature": 0, "max_tokens": 6, "logprobs": True,
                "top_logprobs": 5, "stream": stream}
        if stream:
            with httpx.stream("POST", ensemble.router_url + "/v1/chat/completions", json=body, timeout=300) as resp:
                chunks = sse(resp)
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            content = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                       for e in c["choices"][0]["logprobs"]["content"]]
        else:
            choice = httpx.post(ensemble.router_url + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
            text, content = choice["message"]["content"], choice["logprobs"]["content"]
        assert [e["bytes"] for e in content] == [list(b) for b in raw]
        assert [e["token"] for e in content] == [rendered(b) for b in raw]
        assert bytes(b for e in content for b in e["bytes"]) == text.encode("utf-8")
        for i, (entry, token_id) in enumerate(zip(content, ids)):
            row = lsm[len(prompt) - 1 + i]
            assert entry["logprob"] == pytest.approx(float(row[token_id]), abs=1e-3)
            alternatives = {a["token"]: a for a in entry["top_logprobs"]}
            assert len(alternatives) == len(entry["top_logprobs"]) == 5
            assert alternatives[entry["token"]]["logprob"] == entry["logprob"]
            assert alternatives[entry["token"]]["bytes"] == entry["bytes"]
            values, top_ids = row.topk(5)
            assert [a["bytes"] for a in entry["top_logprobs"]] == [list(own_bytes(tokenizer, t)) for t in top_ids.tolist()]
            assert [a["logprob"] for a in entry["top_logprobs"]] == pytest.approx(values.tolist(), abs=1e-3)
