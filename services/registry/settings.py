"""The registry's settings: CLI flags and ``PDSERVE_*`` environment variables, one object."""

from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class RegistrySettings(BaseSettings):
    """``--pod-ttl-s`` <-> ``PDSERVE_POD_TTL_S`` and so on; ``REDIS_URL`` is accepted as well."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", populate_by_name=True, extra="ignore")

    host: str = "0.0.0.0"
    port: int = Field(8001, ge=0, le=65535)
    redis_url: str = Field("redis://127.0.0.1:6379/0",
                           validation_alias=AliasChoices("PDSERVE_REDIS_URL", "REDIS_URL"))
    # A pod whose last heartbeat is older than this is gone (pods beat every 1 s).
    pod_ttl_s: float = Field(5.0, gt=0)
    log_level: str = "info"
