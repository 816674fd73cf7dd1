"""Settings every engine worker (prefill, decode) reads: CLI flags and ``PDSERVE_*`` variables."""

from __future__ import annotations

import os
import socket
import uuid

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from pdserve.shared.engine.config import EngineConfig


def _default_pod_id() -> str:
    # In Kubernetes the pod name is unique; elsewhere add a suffix so two local workers never collide.
    name = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:63]


class WorkerSettings(BaseSettings):
    """``--max-num-seqs`` <-> ``PDSERVE_MAX_NUM_SEQS`` and so on; ``REDIS_URL`` is accepted as well."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", populate_by_name=True, extra="ignore")

    host: str = "0.0.0.0"
    port: int = Field(8003, ge=0, le=65535)
    pod_id: str = Field(default_factory=_default_pod_id)
    # Address other pods use to reach this one (the pod IP in Kubernetes).
    advertise_host: str = "127.0.0.1"
    redis_url: str = Field("redis://127.0.0.1:6379/0", validation_alias=AliasChoices("PDSERVE_REDIS_URL", "REDIS_URL"))
    registry_url: str = "http://127.0.0.1:8001"
    # The registry's bearer token (PDSERVE_REGISTRY_TOKEN); None for a registry without authentication.
    registry_token: SecretStr | None = None
    kv_transfer_secret: str = "pdserve-dev-secret"
    heartbeat_interval_s: float = Field(1.0, gt=0)
    # An engine whose loop finishes no step (nor idle wait) for this long counts as stuck: heartbeats stop (the pod
    # leaves the registry), /health answers 503, a prefill pod stops holding its queue entries. Far above any one
    # step: a long prefill on a loaded CPU is slow, not stuck.
    engine_stall_s: float = Field(300.0, gt=0)
    log_level: str = "info"
    # engine
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # publish the prefix cache's block events to the registry (KV-aware routing)
    enable_kv_events: bool = True
    kv_cache_memory: str | None = None
    preemption_mode: str = "recompute"
    attention_backend: str = "auto"
    device: str = "cpu"
    # vLLM's speculative_config as JSON text, e.g. '{"method": "ngram", "num_speculative_tokens": 4}' (decode pods)
    speculative_config: str | None = None

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, dtype=self.dtype, block_size=self.block_size, max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching, kv_cache_memory_bytes=self.kv_cache_memory,
            preemption_mode=self.preemption_mode, attention_backend=self.attention_backend, device=self.device,
            enable_kv_events=self.enable_kv_events and self.enable_prefix_caching,
            speculative_config=self.speculative_config,
        )
