"""Keep-alive events: a request a worker holds but has no output for yet is not a lost request.

The router ends a request that has had no output event for ``--request-timeout-s`` (600 s), and it moves a silent
request off a pod that left the registry. A request can be silent and well for longer than that under load: waiting
for a full decode pod's KV blocks on the prefill pod, waiting for the prefill pod's own blocks,
preempted on a decode pod until blocks free up, or queued behind long steps. Every ``output_keepalive_s / 2`` the
worker writes ``OutputEvent(keepalive=True)`` to the output stream of each request it holds that has been silent for
``output_keepalive_s`` (so a request is silent for at most 1.5 x that); the router counts it as output for its
silence bounds and relays nothing (``pdserve/services/router/relay.py``), and refuses a bound below twice the interval.
The loop runs on the worker's event loop and never waits for an engine step; the queue readers read during steps too,
so a request queued behind a long step is held, and kept alive, as soon as it arrives. None is written while the engine counts as stuck
(``Worker.engine_stalled``): a stuck pod's requests fall silent, and the router's stall checks move them, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from pdserve.shared.protocol.messages import OutputEvent
from pdserve.shared.worker.events import publish

logger = logging.getLogger(__name__)


async def keepalive_loop(worker) -> None:
    """Runs until cancelled; ``worker`` is a ``Worker`` (its ``silent_requests``, ``engine_stalled``, ``writer``)."""
    period = worker.settings.output_keepalive_s
    while True:
        await asyncio.sleep(period / 2)
        if worker.engine_stalled() is not None:
            continue
        ids = worker.silent_requests(time.time() - period)
        if not ids:
            continue
        try:
            await publish(worker.writer, worker.redis, [OutputEvent(rid, keepalive=True) for rid in ids], retry_s=0.0)
        except (RedisError, OSError) as exc:  # the next round tries again
            logger.warning("writing %d keep-alive events failed: %s", len(ids), exc)
        except Exception:  # this loop keeps waiting requests alive: it must not die
            logger.exception("writing keep-alive events failed")
