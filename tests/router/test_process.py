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
def router_process(redis_url, registry_url, pods, tmp_path):
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
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_router_process_serves_the_openai_client(router_process, worker):
    client = openai.OpenAI(base_url=router_process + "/v1", api_key="secret-key", max_retries=0, timeout=30)
    (model,) = client.models.list().data
    assert (model.id, model.model_extra["max_model_len"]) == ("smol", 2048)  # flag and env both applied
    resp = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "France?"}],
                                          temperature=0)
    assert "Paris" in resp.choices[0].message.content
    assert worker.received[0].request.sampling_params.max_tokens == 2048 - resp.usage.prompt_tokens
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=router_process + "/v1", api_key="wrong", max_retries=0).models.list()


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
