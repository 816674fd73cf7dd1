"""Writes ``OutputEvent``s to Redis: one ``OutputBatch`` entry per step per router (``keys.relay_stream``) for the
requests a router relays, one Lua call per event on the request's own stream for requests that name no router.

Per token, the per-request path costs Redis an EXISTS (the abort marker), an XADD and an EXPIRE inside an EVALSHA,
and the router one more entry to parse. The relay path costs one XADD per step per router for the whole batch, and
an EXPIRE once per ``keys.RELAY_TTL_S / 3`` per stream. It needs no abort check: a late event of an aborted request
lands in the router's relay stream, where no relay reads that request any more, instead of recreating a stream the
router deleted.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import DATA_FIELD, OutputBatch, OutputEvent

# Workers write per-request OutputEvents through this script: it drops the event when the request was aborted (so a
# late event cannot recreate an output stream the router deleted) and refreshes the stream's TTL on every event (so
# a stream nobody reads still expires). KEYS: output stream, aborted key. ARGV: ttl_s, field, value, ...
_WRITE_OUTPUT_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

ROUTE_MEMORY = 65536  # request id -> router id entries a writer remembers (requests end without telling it)


async def _one() -> int:
    return 1


class OutputWriter:
    """Writes ``OutputEvent``s where their router reads them (see the module doc).

    ``route(request_id, router_id)`` tells the writer which router relays a request (the worker calls it when it
    takes the request); ``queue_batches(pipe, events)`` queues one XADD per router onto a pipeline and returns the
    events of unrouted requests, which ``write`` queues one by one. ``write`` alone works with a sync or an asyncio
    redis-py client: it returns 1 (written) or 0 (request aborted), or an awaitable of it for an asyncio client;
    pass ``client=pipeline`` to batch. ``pod_id`` names the writer in its batches.
    """

    def __init__(self, redis: Any, ttl_s: int | None = None, pod_id: str = "") -> None:
        self._redis = redis
        self._async = type(redis).__module__.startswith("redis.asyncio")
        self._ttl_s = keys.OUTPUT_TTL_S if ttl_s is None else ttl_s
        self._script = redis.register_script(_WRITE_OUTPUT_LUA)
        self.pod_id = pod_id
        self._routes: OrderedDict[str, str] = OrderedDict()
        self._ttl_due: dict[str, float] = {}  # relay stream -> monotonic time its TTL is to be refreshed

    def load(self, redis: Any) -> Any:
        """Loads the script into Redis's script cache (a cluster client loads it on every primary): a Redis Cluster
        pipeline sends EVALSHA without loading the script first, as a single-server pipeline does."""
        return redis.script_load(_WRITE_OUTPUT_LUA)

    def route(self, request_id: str, router_id: str | None) -> None:
        """``request_id``'s events go to ``keys.relay_stream(router_id)`` from now on (None: its own stream)."""
        if not router_id:
            return
        self._routes[request_id] = router_id
        self._routes.move_to_end(request_id)
        while len(self._routes) > ROUTE_MEMORY:
            self._routes.popitem(last=False)

    def router_of(self, request_id: str) -> str | None:
        return self._routes.get(request_id)

    def queue_batches(self, pipe: Any, events: list[OutputEvent]) -> list[OutputEvent]:
        """Queue one ``OutputBatch`` XADD per router (and its TTL refresh, when due) onto ``pipe``; returns the
        events of requests that name no router, in order, for ``write``."""
        batches: dict[str, list[OutputEvent]] = {}
        loose = []
        for event in events:
            router_id = self._routes.get(event.request_id)
            if router_id is None:
                loose.append(event)
            else:
                batches.setdefault(router_id, []).append(event)
        for router_id, batch in batches.items():
            self._queue_batch(pipe, router_id, batch)
        return loose

    def _queue_batch(self, pipe: Any, router_id: str, events: list[OutputEvent]) -> None:
        stream = keys.relay_stream(router_id)
        pipe.xadd(stream, {DATA_FIELD: OutputBatch(events, self.pod_id).pack()}, maxlen=keys.RELAY_MAXLEN,
                  approximate=True)
        now = time.monotonic()
        if self._ttl_due.get(stream, 0.0) <= now:
            pipe.expire(stream, keys.RELAY_TTL_S)
            self._ttl_due[stream] = now + keys.RELAY_TTL_S / 3
            if len(self._ttl_due) > 4096:  # routers come and go: forget the streams no longer written
                self._ttl_due = {s: t for s, t in self._ttl_due.items() if t > now}

    def write(self, event: OutputEvent, client: Any = None, router_id: str | None = None) -> Any:
        router_id = router_id or self._routes.get(event.request_id)
        if router_id is not None:
            if client is not None:
                self._queue_batch(client, router_id, [event])
                return _one() if self._async else 1
            pipe = self._redis.pipeline(transaction=False)
            self._queue_batch(pipe, router_id, [event])
            if self._async:
                async def run() -> int:
                    await pipe.execute()
                    return 1
                return run()
            pipe.execute()
            return 1
        flat = [x for item in event.encode().items() for x in item]
        return self._script(keys=[keys.output_stream(event.request_id),
                                  keys.aborted_key(event.request_id)],
                            args=[self._ttl_s, *flat], client=client)
