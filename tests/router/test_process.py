"""``pdserve router`` as its own process (the CLI, settings from flags and PDSERVE_* env, uvicorn), answering
the official openai client. The stand-in worker plays the backend (it stands in for the real workers, which
have their own tests); the registry is the real service."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from router_harness import free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def router_process(router_proc):
    return router_proc[0]


@pytest.fixture
def router_proc(redis_url, registry_url, pods, tmp_path):
    """(base URL, Popen) of ``pdserve router`` started as its own process, healthy."""
    port = free_port()
    log = open(tmp_path / "router.log", "wb")
    env = {**os.environ, "PDSERVE_REDIS_URL": redis_url, "PDSERVE_API_KEY": "secret-key",
           "PDSERVE_MAX_MODEL_LEN": "2048"}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.services.cli", "router", "--host", "127.0.0.1",
                             "--port", str(port), "--registry-url", registry_url, "--served-model-name", "smol"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "router.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise RuntimeError("router did not become healthy")
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_router_process_serves_the_openai_client(router_proc, worker):
    router_process, proc = router_proc
    client = openai.OpenAI(base_url=router_process + "/v1", api_key="secret-key", max_retries=0, timeout=30)
    (model,) = client.models.list().data
    assert (model.id, model.model_extra["max_model_len"]) == ("smol", 2048)  # flag and env both applied
    resp = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "France?"}],
                                          temperature=0)
    assert "Paris" in resp.choices[0].message.content
    assert worker.received[0].request.sampling_params.max_tokens == 2048 - resp.usage.prompt_tokens
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=router_process + "/v1", api_key="wrong", max_retries=0).models.list()
    check_served_without_torch(router_process, proc, worker)


def torch_files_mapped(pid: int) -> list[str]:
    """Files of the torch package mapped into process ``pid``: importing torch maps torch/_C and libtorch_cpu, so
    this is empty exactly when the process never imported it (read from outside: no hook in the process)."""
    with open(f"/proc/{pid}/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "/torch/" in line.split()[-1]})


def check_served_without_torch(url: str, proc: subprocess.Popen, worker) -> None:
    """The router's tokenizer is AutoTokenizer's without its torch import (pdserve/services/router/tokenizer_loader.py):
    after loading it and serving chats, a completion and /tokenize, the process has mapped no torch file, and the
    token ids it answered and sent on equal the engine's tokenizer's (AutoTokenizer, loaded here). Part of the test
    above, whose router it reuses (a router start costs CI ~5 s)."""
    from transformers import AutoTokenizer

    from pdserve.shared.models.resolve import resolve_model

    chat = [{"role": "user", "content": "France? Ça va 🙂"}]
    with httpx.Client(base_url=url, headers={"Authorization": "Bearer secret-key"}, timeout=30) as client:
        for path, body in (("/v1/chat/completions", {"messages": chat}), ("/v1/completions", {"prompt": "France is"})):
            resp = client.post(path, json={"model": "smol", "max_tokens": 4, **body})
            assert resp.status_code == 200, resp.text
        chat_ids = client.post("/tokenize", json={"model": "smol", "messages": chat}).json()["tokens"]
        prompt_ids = client.post("/tokenize", json={"model": "smol", "prompt": "日本語 🙂 x"}).json()["tokens"]
    assert proc.poll() is None
    if os.path.exists(f"/proc/{proc.pid}/maps"):  # Linux
        assert torch_files_mapped(proc.pid) == []
    oracle = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    expected = oracle.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    assert chat_ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert prompt_ids == oracle.encode("日本語 🙂 x")
    assert [r.request.prompt_token_ids for r in worker.received[-2:]] == [chat_ids, oracle.encode("France is")]


def test_access_log_never_shows_a_key_sent_in_the_query_string(router_process, tmp_path):
    resp = httpx.get(router_process + "/v1/models?api_key=sk-in-the-query&x=1", timeout=10,
                     headers={"Authorization": "Bearer secret-key"})
    assert resp.status_code == 200
    log = tmp_path / "router.log"
    deadline = time.monotonic() + 10
    while "GET /v1/models?" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    text = log.read_text()
    assert "GET /v1/models?api_key=<redacted>&x=<redacted> HTTP/1.1" in text
    assert "sk-in-the-query" not in text
