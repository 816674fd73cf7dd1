"""The registry wire: :class:`PodInfo` (what a pod reports) and the token rule. The client that speaks it is
``pdserve/shared/registry_client.py``; the heartbeat task of a worker is ``pdserve/shared/worker/heartbeat.py``.

HTTP API of ``pdserve/services/registry`` (JSON):
    POST   /v1/pods             body PodInfo   -> 200 PodInfo (``last_heartbeat`` set by the registry)
    GET    /v1/pods?role=R      R: prefill|decode, optional -> 200 {"pods": [PodInfo, ...]} (alive only)
    GET    /v1/pods/{pod_id}    -> 200 PodInfo | 404
    DELETE /v1/pods/{pod_id}    -> 200 {"deleted": true} | 404
A pod missing heartbeats for ``pod_ttl_s`` (default 5 s) drops out of every answer.

Authentication: a registry given a token (``PDSERVE_REGISTRY_TOKEN``) answers every path but ``/health`` and
``/metrics`` only with ``Authorization: Bearer <token>``; otherwise 401 with ``WWW-Authenticate: Bearer`` and
``{"error": {"message", "type": "authentication_error", "param": null, "code": "missing_token"|"invalid_token"}}``.
Block events and prefix lookups (``/v1/kv/...``): see ``pdserve/shared/protocol/kv_events.py``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

Role = Literal["prefill", "decode"]
ROLES: tuple[str, ...] = ("prefill", "decode")
# Pod ids become Redis keys and URL path segments: Kubernetes pod names (DNS-1123) and the like.
POD_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"


class PodInfo(BaseModel):
    """One pod's registration and load, sent with every heartbeat.

    Blocks are KV-cache blocks of ``block_size`` tokens. ``kv_endpoint``: a decode pod's KV-connector endpoint
    fields, as its backend defines them (``KVConnector.endpoint_fields``: tcp and shm ``{"port"}``, loopback
    ``{"loopback_id"}``; empty for prefill pods and pods that predate it). ``kv_port``: the decode pod's
    KV-transfer port, kept for readers that predate ``kv_endpoint`` (0 for prefill pods). ``colocated``: a decode pod that prefills its own requests.
    ``started_at``/``last_heartbeat``: unix seconds; ``last_heartbeat`` is stamped by the registry
    (Redis server clock), whatever the pod sends.
    """

    model_config = ConfigDict(extra="ignore")  # a newer pod may report more than this registry knows

    pod_id: str = Field(pattern=POD_ID_PATTERN)
    role: Role
    host: str = Field(min_length=1, max_length=253)
    http_port: int = Field(ge=1, le=65535)
    kv_port: int = Field(0, ge=0, le=65535)
    kv_endpoint: dict[str, Any] = Field(default_factory=dict, max_length=16)
    model: str = Field(min_length=1, max_length=512)
    block_size: int = Field(16, ge=1)
    total_blocks: int = Field(0, ge=0)
    free_blocks: int = Field(0, ge=0)
    num_running: int = Field(0, ge=0)
    num_waiting: int = Field(0, ge=0)
    # a prefill pod's queue as routers estimate its TTFT from it (pdserve/services/router/pd_policy.py): tokens of the
    # prompts it holds and has not prefilled, those of long ones (over its long_prefill_token_threshold, 0: none), and
    # its measured prompt tokens per second of engine steps (0: not measured yet)
    queued_prefill_tokens: int = Field(0, ge=0)
    queued_long_prefill_tokens: int = Field(0, ge=0)
    long_prefill_token_threshold: int = Field(0, ge=0)
    prefill_tokens_per_s: float = Field(0.0, ge=0)
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
