"""Writes a request's ``OutputEvent``s to its Redis output stream (one Lua call per event)."""

from __future__ import annotations

from typing import Any

from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent

# Workers write OutputEvents through this script: it drops the event when the request was aborted (so a late
# event cannot recreate an output stream the router deleted) and refreshes the stream's TTL on every event (so
# a stream nobody reads still expires). KEYS: output stream, aborted key. ARGV: ttl_s, field, value, ...
_WRITE_OUTPUT_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""


class OutputWriter:
    """Writes ``OutputEvent``s to their output streams (``keys.output_stream``), atomically skipping aborted
    requests and refreshing the stream TTL (``keys.OUTPUT_TTL_S``).

    Works with a sync or an asyncio redis-py client: ``write`` returns 1 (written) or 0 (request aborted), or an
    awaitable of it for an asyncio client. Pass ``client=pipeline`` to batch one engine step's events.
    """

    def __init__(self, redis: Any, ttl_s: int | None = None) -> None:
        self._ttl_s = keys.OUTPUT_TTL_S if ttl_s is None else ttl_s
        self._script = redis.register_script(_WRITE_OUTPUT_LUA)

    def load(self, redis: Any) -> Any:
        """Loads the script into Redis's script cache (a cluster client loads it on every primary): a Redis Cluster
        pipeline sends EVALSHA without loading the script first, as a single-server pipeline does."""
        return redis.script_load(_WRITE_OUTPUT_LUA)

    def write(self, event: OutputEvent, client: Any = None) -> Any:
        flat = [x for item in event.encode().items() for x in item]
        return self._script(keys=[keys.output_stream(event.request_id),
                                  keys.aborted_key(event.request_id)],
                            args=[self._ttl_s, *flat], client=client)
