"""The decode worker: a KV-transfer server feeding a continuous-batching engine.

Requests arrive two ways: over KV transfer from a prefill pod (reserve -> blocks -> commit; they join
the running batch with their first token already sampled), or on the pod's own Redis stream
``pdserve:{p-<pod_id>}:queue`` when the router decided this pod prefills them itself (no prefill tier
alive, ``--colocated``, or a short uncached suffix). Every token goes to the request's output stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from redis.exceptions import RedisError

from pdserve.shared.engine.llm_engine import RequestRejected
from pdserve.shared import tracing
from pdserve.shared.logs import logging_request
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import BadSamplingParams, MessageError, PrefillRequest
from pdserve.shared.streams import ensure_group, is_nogroup
from pdserve.shared.transport.connector import KVConnectorFactory
from pdserve.shared.transport.frames import Commit, CommitReply, Reserve, ReserveReply
from pdserve.shared.transport.server import KVTransferServer
from pdserve.shared.worker.base import Worker
from pdserve.shared.worker.events import error_event, publish
from pdserve.shared.worker.tracked import Tracked

from pdserve.services.decode.settings import DecodeSettings

logger = logging.getLogger(__name__)


class HandedOver:
    """Request ids this pod took over, for ``memory_s`` seconds (at most ``max_entries``, oldest dropped).

    A prefill worker that dies after the decode pod's commit reply but before its XACK leaves its queue entry
    pending; another worker reclaims it (XAUTOCLAIM), prefills it again and offers the same request here. Redis
    Streams deliver at least once; this makes the hand-over idempotent, so the request runs once.
    """

    def __init__(self, memory_s: float, max_entries: int) -> None:
        self.memory_s, self.max_entries = memory_s, max_entries
        self._ids: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._ids[request_id] = time.monotonic()
        self._ids.move_to_end(request_id)
        self._trim()

    def __contains__(self, request_id: str) -> bool:
        self._trim()
        return request_id in self._ids

    def _trim(self) -> None:
        horizon = time.monotonic() - self.memory_s
        while self._ids and (len(self._ids) > self.max_entries or next(iter(self._ids.values())) < horizon):
            self._ids.popitem(last=False)


class DecodeReceiver:
    """``KVReceiver`` for the transfer server: every call runs on the engine thread."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker
        self.layout = worker.kv_layout()

    async def reserve(self, msg: Reserve) -> ReserveReply:
        w = self.worker
        if len(msg.prompt_token_ids) != msg.num_tokens:
            return ReserveReply(ok=False, error=f"num_tokens {msg.num_tokens} != {len(msg.prompt_token_ids)} prompt tokens")
        if msg.request_id in w.handed_over:
            logger.info("request %s was already handed over to this pod; refusing it again", msg.request_id)
            return ReserveReply(ok=False, duplicate=True, error="request was already handed over to this pod")
        result = await w.engine_thread.acall(self._reserve_if_room, msg.request_id, msg.prompt_token_ids,
                                             msg.cache_salt)
        if result is None:
            return ReserveReply(ok=False, full=True, error="no free KV blocks on this decode pod right now")
        _, num_cached = result
        return ReserveReply(ok=True, num_cached_blocks=num_cached)

    def _reserve_if_room(self, request_id: str, prompt_token_ids: list[int], cache_salt: str | None):
        """``engine.reserve`` (engine thread), but none while requests already here wait for blocks (preempted, or
        not scheduled yet): they go first, and a reservation taking blocks they need would only preempt more."""
        engine = self.worker.engine
        if engine.num_waiting:
            return None
        return engine.reserve(request_id, prompt_token_ids, cache_salt)

    async def receive_blocks(self, request_id: str, first_block_index: int, blocks) -> None:
        w = self.worker
        await w.engine_thread.acall(w.engine.write_kv, request_id, first_block_index, blocks)
        w.metrics.kv_transfer_bytes.inc(blocks.numel() * blocks.element_size())
        w.metrics.kv_transfer_blocks.inc(blocks.shape[0])

    async def commit(self, msg: Commit) -> CommitReply:
        with logging_request(msg.request_id):
            return await self._commit(msg)

    async def _commit(self, msg: Commit) -> CommitReply:
        w = self.worker
        params = msg.sampling_params
        if await w.is_aborted(msg.request_id):
            return CommitReply(ok=False, error="request was aborted")
        span = tracing.start("decode", msg.traceparent, {"pdserve.pod": w.settings.pod_id,
                                                         "pdserve.prefill": "remote"})
        w.track(msg.request_id, Tracked(msg.arrival_time, params.logprobs, committed=time.time(),
                                        router_id=msg.router_id, sent_first=True, span=span))
        try:
            await w.engine_thread.acall(w.engine.commit, msg.request_id, msg.first_token_id, params,
                                        arrival_time=msg.arrival_time, output_token_ids=msg.output_token_ids,
                                        output_text_len=msg.output_text_len)
        except ValueError as exc:
            w.requests.pop(msg.request_id, None)
            tracing.end(span, error=str(exc))
            return CommitReply(ok=False, error=str(exc))
        w.handed_over.add(msg.request_id)
        return CommitReply(ok=True)

    async def release(self, request_id: str) -> None:
        w = self.worker
        await w.engine_thread.acall(w.engine.release_reservation, request_id)


class DecodeWorker(Worker):
    role = "decode"

    def __init__(self, settings: DecodeSettings) -> None:
        super().__init__(settings)
        self.kv_port = settings.kv_port
        self.colocated = settings.colocated
        self.connector = KVConnectorFactory.create_connector(settings.kv_transfer_config)
        self.kv_server: KVTransferServer | None = None
        self.handed_over = HandedOver(settings.handover_memory_s, settings.handover_memory_max)
        self.admissions: set[asyncio.Task] = set()  # batches read from the local queue, waiting to reach the engine

    async def start_role(self) -> None:
        s = self.settings
        self.kv_server = self.connector.receiver_server(DecodeReceiver(self), s.kv_transfer_secret, s.host, s.kv_port,
                                                        lease_ttl_s=s.lease_ttl_s)
        await self.kv_server.start()
        self.kv_port = self.kv_server.port
        self.tasks += [asyncio.create_task(self._consume_local()), asyncio.create_task(self._reap_orphans())]

    async def stop(self) -> None:
        """Shutdown (SIGTERM): leave the registry and take no new request, then hand the running ones over."""
        self.ready = False
        if self.heartbeater is not None:
            await self.heartbeater.stop()  # deregisters: the router places nothing here and finds this pod gone
            self.heartbeater = None
        if self.kv_server is not None:
            await self.kv_server.stop()
        await self.hand_over()
        for task in self.admissions:
            task.cancel()
        await super().stop()

    async def hand_over(self) -> None:
        """Every request this pod holds ends here with a 503, which the router answers by migrating it to another
        decode pod with the output its client already has (``pdserve/services/router/migration.py``): a stopping pod
        loses no request. The engine stops them first, so nothing follows the 503."""
        if self.engine_thread is None or not self.engine_thread.alive or not self.requests:
            return
        ids = list(self.requests)
        for rid in ids:
            await self.abort(rid)
        logger.warning("shutting down: handing %d requests over to other decode pods", len(ids))
        message = f"decode pod {self.settings.pod_id} is shutting down"
        try:
            await publish(self.writer, self.redis, [error_event(rid, message, 503) for rid in ids], retry_s=5.0)
        except (RedisError, OSError) as exc:  # the router's stall check still finds this pod gone
            logger.warning("could not tell the router about %d handed-over requests: %s", len(ids), exc)

    async def _reap_orphans(self) -> None:
        """Drop the requests whose router is gone (its ``keys.router_key`` missing for ``ORPHAN_AFTER_S``, seen
        while Redis answers): nobody reads their output, and they would hold blocks and batch slots until they
        finish. Requests that name no router are never dropped so."""
        missing_since: dict[str, float] = {}
        while True:
            await asyncio.sleep(1.0)
            owners: dict[str, list[str]] = {}
            for rid, info in list(self.requests.items()):
                if info.router_id:
                    owners.setdefault(info.router_id, []).append(rid)
            for router in set(missing_since) - set(owners):
                del missing_since[router]
            if not owners:
                continue
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for router in owners:
                        pipe.exists(keys.router_key(router))
                    alive = await pipe.execute()
            except (RedisError, OSError):
                continue
            now = time.monotonic()
            for (router, rids), exists in zip(owners.items(), alive):
                if exists:
                    missing_since.pop(router, None)
                elif now - missing_since.setdefault(router, now) >= keys.ORPHAN_AFTER_S:
                    logger.warning("router %s is gone: aborting its %d requests here", router, len(rids))
                    for rid in rids:
                        await self.abort(rid)
                    self.metrics.requests_orphaned.inc(len(rids))

    async def _consume_local(self) -> None:
        """Requests this pod prefills itself, from its own stream (which expires if this pod stops beating:
        then the router's next XADD recreates it without a group, and the group is made again here, at id 0
        so that entry is read)."""
        stream = keys.decode_stream(self.settings.pod_id)
        await ensure_group(self.redis, stream, keys.DECODE_GROUP)
        while True:
            try:
                entries = await self.redis.xreadgroup(keys.DECODE_GROUP, self.settings.pod_id, {stream: ">"},
                                                      count=32, block=1000)
                self.set_fault("local queue", None)
            except (RedisError, OSError) as exc:
                if is_nogroup(exc):
                    try:
                        await ensure_group(self.redis, stream, keys.DECODE_GROUP)
                        continue
                    except (RedisError, OSError) as again:
                        exc = again
                self.set_fault("local queue", f"reading {stream} failed: {exc}")
                await asyncio.sleep(1.0)
                continue
            for _, messages in entries or []:
                # Admitting waits for the current step: a task of its own, so this loop reads (and the requests
                # are tracked, with keep-alives) while the step runs, instead of leaving the next entries unread.
                task = asyncio.create_task(self._admit_local(stream, messages))
                self.admissions.add(task)
                task.add_done_callback(self.admissions.discard)

    async def _admit_local(self, stream: str, messages: list) -> None:
        """Admit entries read from this pod's own stream in one engine call (the next step prefills them together,
        not one per step), then acknowledge them."""
        try:
            await self._admit_all([fields for _, fields in messages], [keys.enqueued_at(i) for i, _ in messages])
            ids = [msg_id for msg_id, _ in messages]
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xack(stream, keys.DECODE_GROUP, *ids)
                pipe.xdel(stream, *ids)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            logger.warning("admitting from %s failed (%s)", stream, exc)

    async def _admit(self, fields) -> None:
        await self._admit_all([fields])

    async def _admit_all(self, entries: list, enqueued: list[float] | None = None) -> None:
        """Admit local queue entries into the engine in one call between two steps. Malformed entries are dropped
        with a log line, bad sampling params and requests the engine refuses get a 400, aborted ones are skipped.
        ``enqueued``: when each entry was added (unix s), for its ``queue`` span; None: not known."""
        reqs: list[PrefillRequest] = []
        queued_at: dict[str, float] = {}
        for i, fields in enumerate(entries):
            try:
                reqs.append(PrefillRequest.decode(fields))
                if enqueued is not None:
                    queued_at[reqs[-1].request_id] = enqueued[i]
            except BadSamplingParams as exc:
                self.writer.route(exc.request_id, exc.router_id)
                if not await self.is_aborted(exc.request_id):
                    await self._fail(exc.request_id, str(exc))
            except MessageError as exc:
                logger.error("dropping malformed queue entry: %s", exc)
        if not reqs:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for req in reqs:
                pipe.exists(keys.aborted_key(req.request_id))
            aborted = await pipe.execute()
        reqs = [req for req, gone in zip(reqs, aborted) if not gone and req.request_id not in self.aborted]
        now = time.time()
        for req in reqs:
            if req.request_id in queued_at:
                tracing.record("queue", req.traceparent, queued_at[req.request_id], now, {
                    "messaging.system": "redis", "messaging.destination.name": keys.decode_stream(self.settings.pod_id),
                    "pdserve.pod": self.settings.pod_id}, kind="consumer")
            span = tracing.start("decode", req.traceparent, {"pdserve.pod": self.settings.pod_id,
                                                             "pdserve.prefill": "local",
                                                             "gen_ai.usage.input_tokens": req.prompt_tokens})
            self.track(req.request_id, Tracked(req.arrival_time, req.sampling_params.logprobs,
                                               admitted=time.time(), router_id=req.router_id, span=span))
        errors = await self.engine_thread.acall(self._add_requests, reqs)
        for req, exc in zip(reqs, errors):
            if exc is not None:
                info = self.requests.pop(req.request_id, None)
                tracing.end(info.span if info else None, error=str(exc))
                with logging_request(req.request_id):
                    await self._fail(req.request_id, str(exc), getattr(exc, "param", None))

    def _add_requests(self, reqs: list[PrefillRequest]) -> list[Exception | None]:
        """Engine thread: add every request; per request None, or the error that refused it (a bad request)."""
        errors: list[Exception | None] = []
        for req in reqs:
            if req.request_id not in self.requests:  # aborted while this call waited for the step
                errors.append(None)
                continue
            try:
                self.engine.add_request(req.request_id, req.prompt_token_ids, req.sampling_params,
                                        arrival_time=req.arrival_time, priority=req.priority, cache_salt=req.cache_salt,
                                        output_token_ids=req.output_token_ids, output_text_len=req.output_text_len)
                errors.append(None)
            except (RequestRejected, ValueError, TypeError) as exc:
                errors.append(exc)
        return errors

    async def _fail(self, request_id: str, message: str, param: str | None = None) -> None:
        self.metrics.requests_failed.inc()
        await publish(self.writer, self.redis, [error_event(request_id, message, 400, "BadRequestError", param)])

    def pod_fields(self) -> dict:
        endpoint = self.connector.pod_fields(self.kv_server) if self.kv_server is not None else {"kv_port": self.kv_port}
        return {**endpoint, "colocated": self.colocated}

    def worker_stats(self) -> dict:
        stats = super().worker_stats()
        if self.kv_server is not None:
            stats.update(kv_active_leases=self.kv_server.active_leases, kv_bytes_received=self.kv_server.bytes_received,
                         kv_blocks_received=self.kv_server.blocks_received)
        return stats
