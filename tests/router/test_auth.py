"""API keys: with ``api_key`` set, /v1 and the tokenizer routes need ``Authorization: Bearer <key>``."""

from __future__ import annotations

from typing import Iterator

import httpx
import openai
import pytest

from router_harness import RouterServer, start_router
from pdserve.services.router.middleware import key_matches
from pdserve.services.router.settings import RouterSettings

CHAT = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "France?"}]}


@pytest.fixture
def keyed_router(redis_url, registry_url, processor, pods) -> Iterator[RouterServer]:
    server = start_router(RouterSettings(redis_url=redis_url, registry_url=registry_url, api_key="key-one, key-two",
                                         registry_cache_s=0.0), processor, pods)
    yield server
    server.stop()


def assert_401(resp: httpx.Response) -> None:
    assert resp.status_code == 401
    assert resp.json() == {"error": {"message": resp.json()["error"]["message"], "type": "AuthenticationError",
                                     "param": None, "code": 401}}
    assert resp.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-one"},
                                     {"Authorization": "Basic key-one"}, {"Authorization": "Bearer key-one-and-more"}])
def test_missing_or_bad_key_gets_401_then_a_good_key_works(keyed_router, worker, headers):
    for path in ("/v1/chat/completions", "/tokenize"):
        assert_401(httpx.post(keyed_router.url + path, json=CHAT, headers=headers, timeout=30))
    assert_401(httpx.get(keyed_router.url + "/v1/models", headers=headers, timeout=30))
    assert worker.received == []
    ok = httpx.post(keyed_router.url + "/v1/chat/completions", json=CHAT, timeout=30,
                    headers={"Authorization": "Bearer key-two"})
    assert ok.status_code == 200 and "Paris" in ok.json()["choices"][0]["message"]["content"]


def test_openai_client_with_the_key_is_served(keyed_router, worker):
    client = openai.OpenAI(base_url=keyed_router.url + "/v1", api_key="key-one", max_retries=0)
    assert "Paris" in client.chat.completions.create(**CHAT).choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_router.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_probes_need_no_key(keyed_router):
    assert httpx.get(keyed_router.url + "/health", timeout=30).json() == {"status": "ok"}
    assert httpx.get(keyed_router.url + "/metrics", timeout=30).status_code == 200


def test_key_comparison():
    assert key_matches("b", ["a", "b"])
    assert not key_matches("c", ["a", "b"])
    assert not key_matches("", ["a"])
    assert not key_matches("ab", ["a"])


def salt_sent(server: RouterServer, worker, key: str, **extra) -> str | None:
    """The cache_salt of the PrefillRequest the router queued for one chat request with this key."""
    before = len(worker.received)
    resp = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, **extra}, timeout=30,
                      headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 200, resp.text
    return worker.received[before].request.cache_salt


def test_each_api_key_gets_its_own_prefix_cache_namespace(redis_url, registry_url, processor, pods, worker):
    from pdserve.services.router.middleware import key_id
    from pdserve.services.router.tenancy import tenant_cache_salt

    server = start_router(RouterSettings(redis_url=redis_url, registry_url=registry_url, api_key="key-one,key-two",
                                         cache_salt_per_api_key=True, registry_cache_s=0.0), processor, pods)
    try:
        one, two = salt_sent(server, worker, "key-one"), salt_sent(server, worker, "key-two")
        assert one == tenant_cache_salt(None, key_id("key-one")) and len(one) == 64
        assert two != one
        assert salt_sent(server, worker, "key-one") == one  # a tenant's repeat shares its own cache
        # the client's salt subdivides a key's namespace but cannot reach into another key's
        one_x, two_x = salt_sent(server, worker, "key-one", cache_salt="x"), salt_sent(server, worker, "key-two", cache_salt="x")
        assert len({one, two, one_x, two_x, "x"}) == 5
        assert salt_sent(server, worker, "key-two", cache_salt=one) not in (one, two, one_x, two_x)
    finally:
        server.stop()


def test_without_per_key_namespaces_the_clients_salt_passes_unchanged(keyed_router, worker):
    assert salt_sent(keyed_router, worker, "key-one", cache_salt="tenant-a") == "tenant-a"
    assert salt_sent(keyed_router, worker, "key-two") is None


def test_a_registry_refusing_the_routers_token_gets_a_503_that_says_so(redis_url, processor, pods):
    """Not "unreachable": an operator must see that the token is wrong (no retry can fix it)."""
    from router_harness import ThreadServer

    from pdserve.services.registry.app import create_app as create_registry_app
    from pdserve.services.registry.settings import RegistrySettings

    registry = ThreadServer.start(create_registry_app(RegistrySettings(redis_url=redis_url, auth_token="reg-right")))
    server = start_router(RouterSettings(redis_url=redis_url, registry_url=registry.url, registry_token="reg-wrong",
                                         registry_cache_s=0.0), processor, pods)
    try:
        resp = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["message"] == ("The pod registry refused this router's token "
                                                   "(PDSERVE_REGISTRY_TOKEN); see the router's log")
    finally:
        server.stop()
        registry.stop()
