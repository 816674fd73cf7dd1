"""KV connectors: both sides of the KV hand-over, chosen by name (vLLM's ``--kv-transfer-config``).

A connector pairs a sender (the prefill pod's :class:`KVTransferClient`) with a receiver-side server (the decode
pod's :class:`KVTransferServer`, which calls the decode worker's :class:`KVReceiver`), and says what the decode pod
advertises in the registry to be reached (its endpoint). Every connector keeps the same verbs and guarantees
(handshake with the layout check and HMAC, leases, ``num_cached_blocks`` skipping, abort, commit); it only changes
how block bytes travel. :class:`KVConnectorFactory` maps a name to a class, as vLLM's ``KVConnectorFactory`` does;
docs/design.md "How to add a KV backend" shows the steps.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pdserve.shared.transport.client import KVTransferClient
from pdserve.shared.transport.layout import KVLayout
from pdserve.shared.transport.pool import KVClientPool
from pdserve.shared.transport.receiver import KVReceiver
from pdserve.shared.transport.server import KVTransferServer

# vLLM's kv_role values; pdserve's role comes from the service (prefill produces, decode consumes), so any is accepted
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


class KVConnectorError(ValueError):
    """A ``--kv-transfer-config`` that cannot be used: not JSON, an unknown field, or an unregistered connector."""


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """vLLM's ``kv_transfer_config`` (the fields pdserve uses): ``{"kv_connector": "shm"}``.

    ``kv_connector``: a name registered in :class:`KVConnectorFactory`. ``kv_role``: accepted for vLLM
    compatibility (the service decides the role). ``kv_connector_extra_config``: the backend's own options.
    """

    kv_connector: str = "tcp"
    kv_role: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: str | dict | KVTransferConfig | None) -> KVTransferConfig:
        """From JSON text, a dict, or None (``tcp``). Raises :class:`KVConnectorError` naming the registered
        connectors when ``kv_connector`` is not one of them."""
        if isinstance(value, KVTransferConfig):
            return value
        if value is None or value == "":
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise KVConnectorError(f"kv_transfer_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise KVConnectorError(f"kv_transfer_config must be a JSON object, got {type(value).__name__}")
        known = {"kv_connector", "kv_role", "kv_connector_extra_config"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise KVConnectorError(f"kv_transfer_config: unknown field(s) {', '.join(unknown)} "
                                   f"(known: {', '.join(sorted(known))})")
        config = cls(**value)
        if not isinstance(config.kv_connector, str) or config.kv_connector not in KVConnectorFactory.names():
            raise KVConnectorError(f"kv_transfer_config: unknown kv_connector {config.kv_connector!r}; registered: "
                                   f"{', '.join(KVConnectorFactory.names())}")
        if config.kv_role is not None and config.kv_role not in KV_ROLES:
            raise KVConnectorError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, "
                                   f"got {config.kv_role!r}")
        if not isinstance(config.kv_connector_extra_config, dict):
            raise KVConnectorError("kv_transfer_config: kv_connector_extra_config must be a JSON object")
        return config


@dataclass(frozen=True, slots=True)
class KVEndpoint:
    """Where a decode pod takes hand-overs: its address (``PodInfo.host``, passed on as ``PrefillRequest``'s
    ``decode_host``), the port its sender connects to, and any other field its backend advertises (``extra``:
    sorted ``(name, value)`` pairs, so an endpoint stays hashable: the prefill pod keys a FIFO line by it)."""

    host: str
    port: int
    extra: tuple[tuple[str, Any], ...] = ()


class KVConnector:
    """Base of every connector: the TCP sender and server, and a ``kv_port`` endpoint. A backend subclasses it,
    sets ``name`` and overrides what differs (usually ``client_class`` and ``server_class``)."""

    name: ClassVar[str] = "tcp"
    client_class: ClassVar[type[KVTransferClient]] = KVTransferClient
    server_class: ClassVar[type[KVTransferServer]] = KVTransferServer

    def __init__(self, config: KVTransferConfig | None = None) -> None:
        self.config = config or KVTransferConfig(kv_connector=self.name)

    # prefill side
    def sender_pool(self, layout: KVLayout, secret: str | bytes, **client_kwargs: Any) -> KVClientPool:
        """One connected sender per decode pod (``await pool.get(endpoint.host, endpoint.port)``)."""
        return KVClientPool(layout, secret, client_class=self.client_class, **client_kwargs)

    # decode side
    def receiver_server(self, receiver: KVReceiver, secret: str | bytes, host: str, port: int,
                        **server_kwargs: Any) -> KVTransferServer:
        """The decode pod's server (``await server.start()``), calling ``receiver``."""
        server = self.server_class(receiver, secret, host, port, **server_kwargs)
        server.connector_name = self.name
        return server

    def endpoint_fields(self, server: KVTransferServer) -> dict[str, Any]:
        """This backend's endpoint fields for ``server`` (msgpack- and JSON-safe values): the decode pod advertises
        them as ``PodInfo.kv_endpoint``, the router passes them on as ``PrefillRequest.decode_kv_endpoint``, and
        :meth:`endpoint` reads them back on the prefill pod. The pod's address is ``PodInfo.host``, not a field.
        tcp (and shm, whose control connection is tcp's): ``{"port": ...}``."""
        return {"port": server.port}

    def pod_fields(self, server: KVTransferServer) -> dict[str, Any]:
        """What the decode pod advertises in the registry so senders reach ``server``: ``kv_endpoint`` (the
        backend's fields) and ``kv_port`` (for readers that predate ``kv_endpoint``)."""
        return {"kv_port": server.port, "kv_endpoint": self.endpoint_fields(server)}

    def endpoint(self, host: str, fields: Mapping[str, Any] | int) -> KVEndpoint:
        """A decode pod's endpoint from its address and the fields :meth:`endpoint_fields` advertised (an int: a
        bare ``kv_port`` from a router or pod that predates ``kv_endpoint``). Raises :class:`KVConnectorError`
        naming a missing or invalid field."""
        if isinstance(fields, int):
            fields = {"port": fields}
        return KVEndpoint(host, self._port(fields, "port"))

    def _port(self, fields: Mapping[str, Any], name: str) -> int:
        port = fields.get(name)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise KVConnectorError(f"kv_connector {self.name}: endpoint field {name!r} must be a port (1-65535), "
                                   f"got {port!r} in {dict(fields)}")
        return port


class KVConnectorFactory:
    """Connector name -> class, imported on first use (vLLM's ``KVConnectorFactory.register_connector``)."""

    _registry: ClassVar[dict[str, tuple[str, str]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered")
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def create_connector(cls, config: str | dict | KVTransferConfig | None) -> KVConnector:
        """The connector ``config`` names (see :meth:`KVTransferConfig.parse` for the errors)."""
        config = KVTransferConfig.parse(config)
        module_path, class_name = cls._registry[config.kv_connector]
        connector_class = getattr(importlib.import_module(module_path), class_name)
        return connector_class(config)


KVConnectorFactory.register_connector("tcp", "pdserve.shared.transport.connector", "KVConnector")
KVConnectorFactory.register_connector("loopback", "pdserve.shared.transport.loopback", "LoopbackConnector")
KVConnectorFactory.register_connector("shm", "pdserve.shared.transport.shm", "ShmConnector")
