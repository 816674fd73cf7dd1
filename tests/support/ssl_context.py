"""One default SSL context for every httpx client the tests create (a pytest plugin, wired in tests/conftest.py).

httpx builds a new ``ssl.SSLContext`` for each ``Client``/``AsyncClient`` (``httpx.post(...)`` makes one per call),
loading certifi's CA bundle each time: ~60 ms of CPU, for clients that only ever speak plain HTTP on loopback. The
suite makes thousands (tests, the ``openai`` client, the in-process router's registry client), which was most of
the fast tier's CPU time. The context of ``verify=True`` without a client certificate is reused, keyed on the
environment it reads; any other ``verify``/``cert`` still gets its own.
"""

from __future__ import annotations

import functools
import os

from httpx._transports import default as transports


def pytest_configure(config) -> None:
    create = transports.create_ssl_context

    @functools.lru_cache(maxsize=None)
    def cached(trust_env: bool, cert_file: str | None, cert_dir: str | None):
        return create(verify=True, cert=None, trust_env=trust_env)

    def shared(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None:
            return cached(trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        return create(verify=verify, cert=cert, trust_env=trust_env)

    transports.create_ssl_context = shared
