"""The registry's settings: CLI flags and ``PDSERVE_*`` environment variables, one object, written once."""

from __future__ import annotations

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from pdserve.shared.settings import ServiceSettings


class RegistrySettings(ServiceSettings):
    """``--pod-ttl-s`` <-> ``PDSERVE_POD_TTL_S`` and so on (the flags are generated from these fields:
    ``pdserve/shared/settings.py``); ``REDIS_URL`` is accepted as well."""

    # hide_input_in_errors: a refused token (or a Redis URL with a password) must not reach the log
    model_config = SettingsConfigDict(hide_input_in_errors=True)

    host: str = Field("0.0.0.0", description="Bind address.")
    port: int = Field(8001, ge=0, le=65535, description="HTTP port.")
    redis_url: str = Field("redis://127.0.0.1:6379/0", validation_alias=AliasChoices("PDSERVE_REDIS_URL", "REDIS_URL"),
                           description="Redis URL.")
    # A pod whose last heartbeat is older than this is gone (pods beat every 1 s).
    pod_ttl_s: float = Field(5.0, gt=0, description="Seconds without a heartbeat after which a pod is dropped.")
    # Bearer token every caller must send (all paths but /health and /metrics). None: no authentication,
    # for local development only (a warning is logged at startup). Shared with router, prefill and decode.
    auth_token: SecretStr | None = Field(
        None, validation_alias=AliasChoices("PDSERVE_REGISTRY_TOKEN", "auth_token"), description=(
            "Bearer token callers must send (all paths but /health, /metrics; prefer the variable: a flag shows in "
            "the process list). Unset: no authentication."))
    # Redis connections this registry opens at most; past it, a command waits up to 2 s for a free one
    # (redis-py's default pool of 100 fails at once: "Too many connections" under an abort storm).
    redis_max_connections: int = Field(256, gt=0, description="Redis connections this registry opens at most.")
    log_level: str = Field("info", description="debug|info|warning|error.")

    @field_validator("auth_token")
    @classmethod
    def _token_usable(cls, v: SecretStr | None) -> SecretStr | None:
        from pdserve.shared.protocol.registry import check_token
        check_token(v)  # an empty token would open the registry to anyone sending "Bearer "
        return v
