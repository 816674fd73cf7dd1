"""The prefill pod's side of the KV hand-over, through a KV connector's sender only
(pdserve/shared/transport/connector.py; docs/ensemble.md "KV connectors").

One hand-over: reserve blocks on the decode pod the router chose (waiting in a first-come-first-served line while
it is full), send only the blocks it lacks (``num_cached_blocks``), then commit the request with its first token.
The same for every connector: they differ only in how block bytes travel.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch

from pdserve.shared import tracing
from pdserve.shared.protocol.messages import PrefillRequest
from pdserve.shared.transport.client import KVTransferClient, KVTransferError
from pdserve.shared.transport.connector import KVConnector, KVEndpoint
from pdserve.shared.transport.frames import Commit, Reserve, ReserveReply
from pdserve.shared.transport.pool import KVClientPool

logger = logging.getLogger(__name__)


class RequestAborted(Exception):
    """The request was aborted (``PrefillWorker.abort``) before its transfer could wait for the decode pod."""


class KVHandover:
    """Hands prefilled requests over to decode pods through ``senders`` (one connection per pod, made by
    ``connector``; set before the first hand-over, once the engine's KV layout is known). ``is_held(request_id)``: whether this worker still holds the request (False once aborted).
    ``waiting``: request id -> its transfer task while it waits in line for a full pod's blocks (``cancel_wait``)."""

    def __init__(self, connector: KVConnector, senders: KVClientPool | None, metrics, is_held: Callable[[str], bool],
                 wait_timeout_s: float = 0.0) -> None:
        self.connector, self.senders, self.metrics = connector, senders, metrics
        self.is_held = is_held
        self.wait_timeout_s = wait_timeout_s
        self.lines: dict[KVEndpoint, asyncio.Lock] = {}  # decode pod -> FIFO line waiting for its free KV blocks
        self.waiting: dict[str, asyncio.Task] = {}

    def endpoint(self, req: PrefillRequest) -> KVEndpoint:
        return self.connector.endpoint(req.decode_host, req.decode_kv_endpoint or req.decode_kv_port)

    async def hand_over(self, req: PrefillRequest, first_token: int, first_token_time: float | None,
                        block_hashes: list[str], kv: torch.Tensor, span=None) -> bool:
        """Moves the request (``kv``: its blocks ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]``) to its
        decode pod. True once the pod committed it (and ``span``, the request's ``kv_transfer`` span, is ended with
        the bytes sent); False when the pod already had it (a redelivered queue entry).
        Raises :class:`KVTransferError`, ``HandshakeError``, ``OSError``, ``asyncio.TimeoutError`` or
        :class:`RequestAborted`."""
        rid = req.request_id
        started = time.perf_counter()
        endpoint = self.endpoint(req)
        assert self.senders is not None, "KVHandover.senders is set in start_role"
        client = await self.senders.get(endpoint.host, endpoint.port)
        kv_tokens = req.prompt_token_ids + req.output_token_ids  # a resumed request's output has KV too
        with tracing.span("reserve", span):
            reply = await self.reserve(client, req, Reserve(rid, kv_tokens, len(kv_tokens), block_hashes,
                                                            req.cache_salt), span)
        if reply.duplicate:
            return False
        if not reply.ok:
            raise KVTransferError(f"decode pod {req.decode_pod_id} refused the reservation: {reply.error}")
        skip, sent_bytes = reply.num_cached_blocks, kv[reply.num_cached_blocks:].numel() * kv.element_size()
        with tracing.span("blocks", span, {"pdserve.kv.bytes": sent_bytes, "pdserve.kv.blocks": kv.shape[0] - skip,
                                           "pdserve.kv.blocks_skipped": skip}):
            if skip < kv.shape[0]:
                await client.send_blocks(rid, skip, kv[skip:])
        self.metrics.kv_transfer_blocks.inc(kv.shape[0] - skip)
        self.metrics.kv_transfer_blocks_skipped.inc(skip)
        self.metrics.kv_transfer_bytes.inc(sent_bytes)
        with tracing.span("commit", span):
            commit = await client.commit(Commit(rid, first_token, req.sampling_params, req.prompt_token_ids,
                                                req.arrival_time, req.deadline, first_token_time,
                                                req.output_token_ids, req.output_text_len, req.router_id,
                                                traceparent=req.traceparent))
        if not commit.ok:
            raise KVTransferError(f"decode pod {req.decode_pod_id} refused the hand-over: {commit.error}")
        self.metrics.kv_transfer_seconds.observe(time.perf_counter() - started)
        tracing.end(span, {"pdserve.kv.bytes": sent_bytes})
        return True

    async def reserve(self, client: KVTransferClient, req: PrefillRequest, msg: Reserve, span=None) -> ReserveReply:
        """The decode pod's reservation. While it is full, wait in this pod's first-come-first-served line for
        it (only the line's head asks again, backing off to 1 s) until it has room, or until ``wait_limit`` (the
        request's deadline, ``kv_wait_timeout_s``; none by default): then :class:`KVTransferError`. The router hears
        keep-alive events meanwhile (``pdserve/shared/worker/keepalive.py``); an abort cancels the wait."""
        line = self.lines.setdefault(self.endpoint(req), asyncio.Lock())
        if not line.locked():
            reply = await client.reserve(msg)
            if not reply.full:
                return reply
        rid, limit = req.request_id, self.wait_limit(req)
        started = time.monotonic()
        self.waiting[rid] = asyncio.current_task()
        if not self.is_held(rid):  # aborted before it could be cancelled here: it never joins the line
            self.waiting.pop(rid, None)
            raise RequestAborted(rid)
        logger.info("decode pod %s has no free KV blocks for request %s: waiting in line%s", req.decode_pod_id, rid,
                    "" if limit is None else f" (up to {limit[0]:.0f} s: {limit[1]})")
        wait = tracing.start("kv_wait", span)  # for free decode blocks
        try:
            try:
                await asyncio.wait_for(line.acquire(), None if limit is None else limit[0])
            except (asyncio.TimeoutError, TimeoutError):
                pass
            else:
                try:
                    pause = 0.05
                    while True:
                        reply = await client.reserve(msg)
                        if not reply.full:
                            logger.info("request %s got its KV blocks on %s after waiting %.1f s", rid,
                                        req.decode_pod_id, time.monotonic() - started)
                            return reply
                        if limit is not None and time.monotonic() - started + pause > limit[0]:
                            break
                        await asyncio.sleep(pause)
                        pause = min(2 * pause, 1.0)
                finally:
                    line.release()
            raise KVTransferError(f"decode pod {req.decode_pod_id} had no free KV blocks for "
                                  f"{time.monotonic() - started:.0f} s ({limit[1]})")
        finally:
            self.waiting.pop(rid, None)
            tracing.end(wait)

    def wait_limit(self, req: PrefillRequest) -> tuple[float, str] | None:
        """How long ``req`` may still wait for decode KV blocks (s) and what sets that, or None (no limit)."""
        limits = []
        if self.wait_timeout_s:
            limits.append((self.wait_timeout_s, "--kv-wait-timeout-s"))
        if req.deadline is not None:
            limits.append((max(0.0, req.deadline - time.time()), "the request's deadline"))
        return min(limits) if limits else None

    def cancel_wait(self, request_id: str) -> None:
        """Ends the request's wait in line (it holds no reservation yet)."""
        waiting = self.waiting.pop(request_id, None)
        if waiting is not None:
            waiting.cancel()

    async def close(self) -> None:
        if self.senders is not None:
            await self.senders.close()
