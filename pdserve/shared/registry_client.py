"""The async client of the registry service (``pdserve/services/registry``); its HTTP API and the token rule are
``pdserve/shared/protocol/registry.py`` (pods) and ``pdserve/shared/protocol/kv_events.py`` (block events, lookup)."""

from __future__ import annotations

import httpx
from pydantic import SecretStr

from pdserve.shared.protocol.kv_events import KVEventBatch, KVEventsReply, KVLookupReply, KVSnapshot
from pdserve.shared.protocol.registry import TOKEN_ENV, PodInfo, check_token


class RegistryError(Exception):
    """The registry could not be reached or answered with an error (``status`` when it answered)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RegistryAuthError(RegistryError):
    """The registry answered 401: this client's token is missing or is not the registry's.

    A configuration error: asking again cannot succeed, so ``Heartbeater`` (``pdserve/shared/worker/heartbeat.py``) stops on it.
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
        return KVEventsReply.model_validate(await self._request("POST", "/v1/kv/events", json=batch.model_dump(mode="json")))

    async def publish_kv_snapshot(self, snap: KVSnapshot) -> KVEventsReply:
        """Replaces the registry's view of the pod's cached blocks."""
        return KVEventsReply.model_validate(await self._request("POST", "/v1/kv/snapshot", json=snap.model_dump(mode="json")))

    async def lookup(self, block_hashes: list[str], role: str = "decode") -> KVLookupReply:
        """Alive pods of ``role`` with their load and how many leading blocks of the chain (hex) each holds."""
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
