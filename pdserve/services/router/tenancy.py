"""Prefix-cache namespaces per API key (``--cache-salt-per-api-key``).

``cache_salt`` (vLLM's request field) enters the first block's hash, so requests with different salts never
share a cached block — and a prefix-cache hit, which is a timing side channel, never crosses salts. vLLM leaves
the salt to the client; an operator who gives each tenant an API key wants the key itself to be the boundary,
whatever salt (or none) a client sends. The router then derives the salt it forwards from the key's id and the
client's salt, which still subdivides one tenant's cache.
"""

from __future__ import annotations

import hashlib


def tenant_cache_salt(client_salt: str | None, api_key_id: str | None) -> str | None:
    """The salt the engines hash with: ``client_salt`` unchanged without an API key, else
    SHA-256("pdserve-tenant", key id, client salt) as hex (a distinct namespace per key, and per salt in it)."""
    if api_key_id is None:
        return client_salt
    material = b"\0".join([b"pdserve-tenant", api_key_id.encode(), (client_salt or "").encode()])
    marker = b"\1" if client_salt is not None else b"\0"  # no salt and an empty one stay apart
    return hashlib.sha256(material + marker).hexdigest()
