"""The registry wire: :class:`PodInfo` (what a pod reports), the async :class:`RegistryClient`, and the
:class:`Heartbeater` task a worker runs to stay registered.

HTTP API of ``services/registry`` (JSON):
    POST   /v1/pods             body PodInfo   -> 200 PodInfo (``last_heartbeat`` set by the registry)
    GET    /v1/pods?role=R      R: prefill|decode, optional -> 200 {"pods": [PodInfo, ...]} (alive only)
    GET    /v1/pods/{pod_id}    -> 200 PodInfo | 404
    DELETE /v1/pods/{pod_id}    -> 200 {"deleted": true} | 404
A pod missing heartbeats for ``pod_ttl_s`` (default 5 s) drops out of every answer.

Authentication: a registry given a token (``PDSERVE_REGISTRY_TOKEN``) answers every path but ``/health`` and
``/metrics`` only with ``Authorization: Bearer <token>``; otherwise 401 with ``WWW-Authenticate: Bearer`` and
``{"error": {"message", "type": "authentication_error", "param": null, "code": "missing_token"|"invalid_token"}}``.
Block events and prefix lookups (``/v1/kv/...``): see ``shared/protocol/kv_events.py``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr

if TYPE_CHECKING:
    from pdserve.shared.protocol.kv_events import KVEventBatch, KVEventsReply, KVLookupReply, KVSnapshot

log = logging.getLogger("pdserve.registry")

Role = Literal["prefill", "decode"]
ROLES: tuple[str, ...] = ("prefill", "decode")
# Pod ids become Redis keys and URL path segments: Kubernetes pod names (DNS-1123) and the like.
POD_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"


class PodInfo(BaseModel):
    """One pod's registration and load, sent with every heartbeat.

    Blocks are KV-cache blocks of ``block_size`` tokens. ``kv_port``: the decode pod's KV-transfer
    TCP port (0 for prefill pods). ``colocated``: a decode pod that prefills its own requests.
    ``started_at``/``last_heartbeat``: unix seconds; ``last_heartbeat`` is stamped by the registry
    (Redis server clock), whatever the pod sends.
    """

    model_config = ConfigDict(extra="ignore")  # a newer pod may report more than this registry knows

    pod_id: str = Field(pattern=POD_ID_PATTERN)
    role: Role
    host: str = Field(min_length=1, max_length=253)
    http_port: int = Field(ge=1, le=65535)
    kv_port: int = Field(0, ge=0, le=65535)
    model: str = Field(min_length=1, max_length=512)
    block_size: int = Field(16, ge=1)
    total_blocks: int = Field(0, ge=0)
    free_blocks: int = Field(0, ge=0)
    num_running: int = Field(0, ge=0)
    num_waiting: int = Field(0, ge=0)
    queued_prefill_tokens: int = Field(0, ge=0)
    colocated: bool = False
    # the engine's context length (it may be below the model's when the KV cache is small); 0 = not reported
    max_model_len: int = Field(0, ge=0)
    started_at: float = Field(default_factory=time.time)
    last_heartbeat: float | None = None

    @property
    def http_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.http_port}"

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (0 when the pod reports no blocks)."""
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0


TOKEN_ENV = "PDSERVE_REGISTRY_TOKEN"


def check_token(token: str | SecretStr | None) -> str | None:
    """The registry token as a plain string, or ``None`` (no authentication).

    Raises ``ValueError`` for an empty token (it would look like "no token" to one side and open the
    registry on the other) or one that cannot travel in an HTTP header (visible ASCII only, no spaces).
    The message never contains the token.
    """
    if isinstance(token, SecretStr):
        token = token.get_secret_value()
    if token is None:
        return None
    if not token:
        raise ValueError(f"the registry token must not be empty (unset {TOKEN_ENV} for no authentication)")
    if not all("!" <= c <= "~" for c in token):
        raise ValueError("the registry token must be visible ASCII characters without spaces")
    return token


class RegistryError(Exception):
    """The registry could not be reached or answered with an error (``status`` when it answered)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RegistryAuthError(RegistryError):
    """The registry answered 401: this client's token is missing or is not the registry's.

    A configuration error: asking again cannot succeed, so :class:`Heartbeater` stops on it.
    """


class RegistryClient:
    """Async client of the registry service (httpx). Every method raises :class:`RegistryError`
    (:class:`RegistryAuthError` on a 401).

    ``token``: sent as ``Authorization: Bearer <token>`` on every request (``None``: no header, for a
    registry without authentication). Checked by :func:`check_token`.
    """

    def __init__(self, base_url: str, *, token: str | SecretStr | None = None, timeout_s: float = 2.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        token = check_token(token)
        self._has_token = token is not None
        headers = {"Authorization": f"Bearer {token}"} if token is not None else None
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, transport=transport,
                                       headers=headers)

    async def heartbeat(self, info: PodInfo) -> PodInfo:
        """Registers or refreshes ``info``; returns it as stored (with ``last_heartbeat``)."""
        data = await self._request("POST", "/v1/pods", json=info.model_dump(mode="json"))
        return PodInfo.model_validate(data)

    async def list_pods(self, role: str | None = None) -> list[PodInfo]:
        """Alive pods, by ``pod_id``; ``role``: ``"prefill"``, ``"decode"`` or ``None`` for both."""
        params = {"role": role} if role is not None else None
        data = await self._request("GET", "/v1/pods", params=params)
        return [PodInfo.model_validate(p) for p in data["pods"]]

    async def get_pod(self, pod_id: str) -> PodInfo | None:
        data = await self._request("GET", f"/v1/pods/{pod_id}", allow_404=True)
        return None if data is None else PodInfo.model_validate(data)

    async def deregister(self, pod_id: str) -> bool:
        """Removes the pod at once (graceful shutdown); ``False`` if it was not registered."""
        return await self._request("DELETE", f"/v1/pods/{pod_id}", allow_404=True) is not None

    async def publish_kv_events(self, batch: KVEventBatch) -> KVEventsReply:
        """Sends a pod's numbered block events; the reply says whether the registry needs a snapshot."""
        from pdserve.shared.protocol.kv_events import KVEventsReply
        return KVEventsReply.model_validate(await self._request("POST", "/v1/kv/events", json=batch.model_dump(mode="json")))

    async def publish_kv_snapshot(self, snap: KVSnapshot) -> KVEventsReply:
        """Replaces the registry's view of the pod's cached blocks."""
        from pdserve.shared.protocol.kv_events import KVEventsReply
        return KVEventsReply.model_validate(await self._request("POST", "/v1/kv/snapshot", json=snap.model_dump(mode="json")))

    async def lookup(self, block_hashes: list[str], role: str = "decode") -> KVLookupReply:
        """Alive pods of ``role`` with their load and how many leading blocks of the chain (hex) each holds."""
        from pdserve.shared.protocol.kv_events import KVLookupReply
        data = await self._request("POST", "/v1/kv/lookup", json={"block_hashes": block_hashes, "role": role})
        return KVLookupReply.model_validate(data)

    async def health(self) -> bool:
        try:
            r = await self._http.get("/health")
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, allow_404: bool = False, **kw) -> dict | None:
        try:
            r = await self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise RegistryError(f"registry {self.base_url} unreachable: {type(e).__name__}: {e}") from e
        if r.status_code == 404 and allow_404:
            return None
        if r.status_code == 401:
            why = (f"the registry token was refused: it is not the registry's (check {TOKEN_ENV})"
                   if self._has_token else
                   f"the registry requires a token and none was sent (set {TOKEN_ENV} to the registry's token)")
            raise RegistryAuthError(f"registry {method} {path} -> 401: {why}", 401)
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except Exception:
                message = r.text[:500]
            raise RegistryError(f"registry {method} {path} -> {r.status_code}: {message}", r.status_code)
        return r.json()


class Heartbeater:
    """Background task: ``client.heartbeat(info_fn())`` every ``interval_s`` seconds.

    ``info_fn`` may be sync or async. Failures are logged (once per outage, then at DEBUG) and
    retried with a backoff up to ``max_backoff_s``, except a :class:`RegistryAuthError` (wrong or
    missing token): no retry can fix that, so it is logged as an error, kept in ``refused`` and ends the
    task. ``stop()`` ends it and, with ``deregister_on_stop``, removes the pod at once rather than
    waiting for its TTL.
    """

    def __init__(self, client: RegistryClient, info_fn: Callable[[], PodInfo | Awaitable[PodInfo]],
                 interval_s: float = 1.0, *, deregister_on_stop: bool = True, max_backoff_s: float = 5.0) -> None:
        self.client = client
        self.info_fn = info_fn
        self.interval_s = interval_s
        self.deregister_on_stop = deregister_on_stop
        self.max_backoff_s = max(max_backoff_s, interval_s)
        self.beats = 0
        self.failures = 0
        self.last_error: str | None = None
        self.refused: RegistryAuthError | None = None
        self._pod_id: str | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Starts beating (first beat immediately); call from inside the running event loop."""
        if self._task is None:
            self._stop.clear()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pdserve-heartbeat")

    async def beat(self) -> PodInfo:
        """One heartbeat now; raises what the client raises."""
        info = self.info_fn()
        if inspect.isawaitable(info):
            info = await info
        self._pod_id = info.pod_id
        stored = await self.client.heartbeat(info)
        self.beats += 1
        return stored

    async def _run(self) -> None:
        delay = self.interval_s
        while not self._stop.is_set():
            try:
                await self.beat()
                if self.last_error is not None:
                    log.info("registry heartbeat of %s recovered", self._pod_id)
                self.last_error, delay = None, self.interval_s
            except RegistryAuthError as e:
                self.failures += 1
                self.last_error = f"{type(e).__name__}: {e}"
                self.refused = e
                log.error("registry heartbeat of %s refused, not retrying (this pod stays unregistered): %s",
                          self._pod_id, e)
                return
            except Exception as e:
                self.failures += 1
                if self.last_error is None:
                    log.warning("registry heartbeat of %s failed (retrying): %s", self._pod_id, e)
                else:
                    log.debug("registry heartbeat of %s failed again: %s", self._pod_id, e)
                self.last_error = f"{type(e).__name__}: {e}"
                delay = min(max(delay * 2, self.interval_s), self.max_backoff_s)
            try:
                await asyncio.wait_for(self._stop.wait(), delay)
            except (asyncio.TimeoutError, TimeoutError):
                pass

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.deregister_on_stop and self._pod_id is not None:
            try:
                await self.client.deregister(self._pod_id)
            except RegistryError as e:
                log.warning("could not deregister %s: %s", self._pod_id, e)
