"""Running an engine worker (``pdserve prefill``, ``pdserve decode``) from its flags."""

from __future__ import annotations

import asyncio

from pdserve.shared import tracing
from pdserve.shared.logs import setup_logging
from pdserve.shared.settings import given, load_settings


def run_worker(settings_cls, worker_cls, flags: dict) -> None:
    """Build the settings from the given flags (env fills the rest), set up logging, serve until stopped."""
    from pdserve.shared.worker.base import serve

    settings = load_settings(settings_cls, **given(flags))  # a bad value: one clear line, no traceback
    setup_logging(settings.log_level)
    role = worker_cls.__name__.removesuffix("Worker").lower()  # prefill, decode
    # on only when an OTLP endpoint is set (docs/observability.md "Tracing")
    tracing.setup(f"pdserve-{role}", **{"service.instance.id": settings.pod_id, "pdserve.role": role})
    worker = worker_cls(settings)
    worker.freeze_gc_after_start = True  # this process is the worker's alone (Worker.start)
    asyncio.run(serve(worker))
