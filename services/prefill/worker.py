"""The prefill worker: takes requests from the Redis queue, prefills them in batches, samples the
first token (that is the request's TTFT), and pushes the prompt's KV blocks to the decode pod the
router chose — only the blocks that pod does not hold yet — then hands the request over.

A queue entry is acknowledged only after the decode pod confirmed the hand-over (or the request
ended here: finished by its first token, rejected, or failed with an error event), so an entry held
by a worker that died is reclaimed by another worker (XAUTOCLAIM after ``claim_idle_s``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError, ResponseError

from pdserve.shared.engine.llm_engine import RequestRejected
from pdserve.shared.engine.sampling_params import SamplingParams, SamplingParamsError
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import MessageError, PrefillRequest
from pdserve.shared.transport.client import KVTransferClient, KVTransferError
from pdserve.shared.transport.frames import Commit, Reserve
from pdserve.shared.transport.handshake import HandshakeError
from pdserve.shared.worker.base import Worker
from pdserve.shared.worker.events import error_event, publish
from pdserve.shared.worker.redis_retry import retry_redis
from pdserve.shared.worker.settings import WorkerSettings

logger = logging.getLogger(__name__)


class PrefillSettings(WorkerSettings):
    port: int = 8002
    # queue entries a worker holds at once (prefilling or transferring)
    max_inflight: int = 64
    # an entry idle this long in another consumer's pending list is taken over (that consumer died)
    claim_idle_s: float = 60.0
    # a decode pod with no free blocks is asked again for this long before the request fails
    reserve_retry_s: float = 10.0


class PrefillWorker(Worker):
    role = "prefill"

    def __init__(self, settings: PrefillSettings) -> None:
        super().__init__(settings)
        self.inflight: dict[str, tuple[str, PrefillRequest]] = {}  # request id -> (queue entry id, request)
        # request id -> queue entry id, from delivery (XREADGROUP/XAUTOCLAIM) until it is in ``inflight``: the
        # same entry can arrive twice (our own reclaim loop) and must be admitted once, and it is ours to touch
        self._admitting: dict[str, object] = {}
        self._delivered: set = set()  # entry ids of a delivered batch not admitted yet (touched as well)
        self.clients: dict[tuple[str, int], KVTransferClient] = {}
        self._client_locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._slots = asyncio.Semaphore(settings.max_inflight)
        self.transfers: set[asyncio.Task] = set()

    async def start_role(self) -> None:
        try:
            await self.redis.xgroup_create(keys.PREFILL_STREAM, keys.PREFILL_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self.tasks += [asyncio.create_task(self._consume()), asyncio.create_task(self._reclaim())]

    async def stop(self) -> None:
        for task in self.transfers:
            task.cancel()
        for client in self.clients.values():
            await client.close()
        await super().stop()

    def queued_prefill_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for _, r in self.inflight.values())

    # queue
    async def _consume(self) -> None:
        while True:
            await self._slots.acquire()
            self._slots.release()
            free = self._slots._value  # noqa: SLF001 — how many entries we may take now
            try:
                entries = await self.redis.xreadgroup(keys.PREFILL_GROUP, self.settings.pod_id,
                                                      {keys.PREFILL_STREAM: ">"}, count=max(1, free), block=1000)
            except (RedisError, OSError) as exc:
                logger.warning("reading the prefill queue failed (%s); retrying", exc)
                await asyncio.sleep(1.0)
                continue
            try:
                for _, messages in entries or []:
                    self._delivered.update(msg_id for msg_id, _ in messages)
                    for msg_id, fields in messages:
                        await self._admit(msg_id, fields)
                self.metrics.queue_depth.set(await self.redis.xlen(keys.PREFILL_STREAM))
            except (RedisError, OSError) as exc:  # unacked entries stay pending: reclaimed later
                logger.warning("admitting queue entries failed (%s)", exc)
                self._delivered.clear()  # not admitted: let another worker reclaim them
            except Exception:  # this loop is the worker: a bug on one entry must not stop it
                logger.exception("admitting queue entries failed")
                self._delivered.clear()
            self.metrics.queue_tokens.set(self.queued_prefill_tokens())

    async def _reclaim(self) -> None:
        idle_ms = int(self.settings.claim_idle_s * 1000)
        while True:
            await asyncio.sleep(max(0.5, self.settings.claim_idle_s / 4))
            await self._touch()
            try:
                # Redis 6.2 answers [next id, entries], Redis 7 adds the deleted ids
                reply = await self.redis.xautoclaim(keys.PREFILL_STREAM, keys.PREFILL_GROUP,
                                                    self.settings.pod_id, idle_ms, "0-0", count=16)
                for msg_id, fields in reply[1]:
                    if fields:
                        logger.info("reclaimed queue entry %s from a dead prefill worker", msg_id)
                        await self._admit(msg_id, fields)
            except (RedisError, OSError) as exc:
                logger.warning("XAUTOCLAIM failed: %s", exc)
            except Exception:  # this loop is what recovers dead workers' entries: it must not die
                logger.exception("reclaiming queue entries failed")

    async def _touch(self) -> None:
        """Reset the idle time of the entries this worker still holds (XCLAIM to itself, JUSTID), so a slow
        prefill or transfer is never mistaken for a dead worker and reclaimed while it is still running."""
        held = ([msg_id for msg_id, _ in self.inflight.values()] + list(self._admitting.values())
                + list(self._delivered))
        if not held:
            return
        try:
            await self.redis.xclaim(keys.PREFILL_STREAM, keys.PREFILL_GROUP, self.settings.pod_id, 0, held,
                                    justid=True)
        except (RedisError, OSError) as exc:
            logger.warning("XCLAIM of held entries failed: %s", exc)

    async def _ack(self, msg_id, retry_s: float = 60.0) -> None:
        """XACK + XDEL, retried with backoff while Redis is away (an entry left pending would be reclaimed and
        run twice)."""
        async def ack() -> None:
            await self.redis.xack(keys.PREFILL_STREAM, keys.PREFILL_GROUP, msg_id)
            await self.redis.xdel(keys.PREFILL_STREAM, msg_id)

        await retry_redis(ack, f"acknowledging {msg_id}", retry_s)

    async def _admit(self, msg_id, fields) -> None:
        try:
            await self._admit_entry(msg_id, fields)
        finally:
            self._delivered.discard(msg_id)

    async def _admit_entry(self, msg_id, fields) -> None:
        try:
            req = PrefillRequest.decode(fields)
        except MessageError as exc:
            logger.error("dropping malformed queue entry %s: %s", msg_id, exc)
            await self._ack(msg_id)
            return
        held = self.inflight[req.request_id][0] if req.request_id in self.inflight else \
            self._admitting.get(req.request_id)
        if held is not None:
            if held != msg_id:  # a second entry for a request running here (at-least-once): the first one answers
                logger.info("dropping queue entry %s: request %s is already running here", msg_id, req.request_id)
                await self._ack(msg_id)
            return  # else our own reclaim loop delivered the entry we hold
        self._admitting[req.request_id] = msg_id  # no await between the check and this
        try:
            await self._admit_new(msg_id, req)
        finally:
            self._admitting.pop(req.request_id, None)

    async def _admit_new(self, msg_id, req: PrefillRequest) -> None:
        if await self.is_aborted(req.request_id):
            await self._ack(msg_id)
            return
        try:
            params = SamplingParams.from_dict(req.sampling_params)
        except (SamplingParamsError, TypeError, ValueError) as exc:
            await self._fail(msg_id, req.request_id, f"bad sampling_params: {exc}", 400, "BadRequestError")
            return
        await self._slots.acquire()
        self.inflight[req.request_id] = (msg_id, req)
        self.requests[req.request_id] = {"arrival_time": req.arrival_time, "num_logprobs": params.logprobs,
                                         "admitted": time.time()}
        try:
            await self.engine_thread.acall(self.engine.add_request, req.request_id, req.prompt_token_ids, params,
                                           arrival_time=req.arrival_time, priority=req.priority,
                                           cache_salt=req.cache_salt, prefill_only=True,
                                           output_token_ids=req.output_token_ids, output_text_len=req.output_text_len)
        except (RequestRejected, ValueError) as exc:
            self._forget(req.request_id)
            await self._fail(msg_id, req.request_id, str(exc), 400, "BadRequestError")

    def _forget(self, request_id: str) -> None:
        if self.inflight.pop(request_id, None) is not None:
            self._slots.release()
        self.requests.pop(request_id, None)

    async def _fail(self, msg_id, request_id: str, message: str, code: int, type_: str) -> None:
        self.metrics.requests_failed.inc()
        logger.warning("request %s failed: %s", request_id, message)
        await publish(self.writer, self.redis, [error_event(request_id, message, code, type_)])
        await self._ack(msg_id)

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        entry = self.inflight.get(request_id)
        if entry is not None:
            self._forget(request_id)
            await self._ack(entry[0])

    # after each step
    def on_outputs_engine_thread(self, outputs):
        # export while the blocks are held, then let them go (they stay in the prefix cache)
        exported = {}
        for out in outputs:
            if out.request_id in self.engine.parked:
                exported[out.request_id] = self.engine.export_kv(out.request_id)
                self.engine.release_parked(out.request_id)
        return exported

    async def handle_outputs(self, outputs, exported) -> None:
        tracked = {o.request_id for o in outputs if o.request_id in self.requests}
        await publish(self.writer, self.redis, self.events_for(outputs))  # the first token: TTFT
        for out in outputs:
            rid = out.request_id
            if rid not in tracked or rid not in self.inflight:
                continue
            msg_id, req = self.inflight[rid]
            if rid not in exported:  # finished by its first token
                self._forget(rid)
                await self._ack(msg_id)
                continue
            task = asyncio.create_task(self._transfer(msg_id, req, out, *exported[rid]))
            self.transfers.add(task)
            task.add_done_callback(self.transfers.discard)

    # KV transfer
    async def _client(self, host: str, port: int) -> KVTransferClient:
        key = (host, port)
        lock = self._client_locks.setdefault(key, asyncio.Lock())
        async with lock:
            client = self.clients.get(key)
            if client is None or not client.connected:
                client = KVTransferClient(host, port, self.kv_layout(), self.settings.kv_transfer_secret)
                await client.connect()
                self.clients[key] = client
            return client

    async def _transfer(self, msg_id, req: PrefillRequest, out, block_hashes, kv) -> None:
        rid = req.request_id
        first_token = out.outputs[0].token_ids[-1]  # after any resumed output
        started = time.perf_counter()
        try:
            client = await self._client(req.decode_host, req.decode_kv_port)
            deadline = time.monotonic() + self.settings.reserve_retry_s
            kv_tokens = req.prompt_token_ids + req.output_token_ids  # a resumed request's output has KV too
            while True:
                reply = await client.reserve(Reserve(rid, kv_tokens, len(kv_tokens), block_hashes, req.cache_salt))
                if reply.ok or reply.duplicate or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            if reply.duplicate:  # a worker that died before its XACK handed it over already: done
                logger.info("request %s is already on decode pod %s; acknowledging the redelivered entry",
                            rid, req.decode_pod_id)
                self._forget(rid)
                await self._ack(msg_id)
                return
            if not reply.ok:
                raise KVTransferError(f"decode pod {req.decode_pod_id} refused the reservation: {reply.error}")
            skip = reply.num_cached_blocks
            if skip < kv.shape[0]:
                await client.send_blocks(rid, skip, kv[skip:])
            self.metrics.kv_transfer_blocks.inc(kv.shape[0] - skip)
            self.metrics.kv_transfer_blocks_skipped.inc(skip)
            self.metrics.kv_transfer_bytes.inc(kv[skip:].numel() * kv.element_size())
            commit = await client.commit(Commit(rid, first_token, req.sampling_params, req.prompt_token_ids,
                                                req.arrival_time, req.deadline, out.metrics.get("first_token_time"),
                                                req.output_token_ids, req.output_text_len, req.router_id))
            if not commit.ok:
                raise KVTransferError(f"decode pod {req.decode_pod_id} refused the hand-over: {commit.error}")
            self.metrics.kv_transfer_seconds.observe(time.perf_counter() - started)
            self._forget(rid)
            await self._ack(msg_id)
        except asyncio.CancelledError:
            raise
        except (KVTransferError, HandshakeError, OSError, asyncio.TimeoutError) as exc:
            self._forget(rid)
            if await self.is_aborted(rid):
                await self._ack(msg_id)
                return
            await self._fail(msg_id, rid, f"KV transfer to the decode pod failed: {exc}", 503, "ServiceUnavailableError")
