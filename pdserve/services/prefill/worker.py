"""The prefill worker: takes requests from the Redis queue, prefills them in batches, samples the
first token (that is the request's TTFT), and pushes the prompt's KV blocks to the decode pod the
router chose — only the blocks that pod does not hold yet — then hands the request over.

A queue entry is acknowledged only after the decode pod confirmed the hand-over (or the request
ended here: finished by its first token, rejected, or failed with an error event), so an entry held
by a worker that died is reclaimed by another worker (XAUTOCLAIM after ``claim_idle_s``). The entries a worker
holds are touched every second (their idle time reset) while its engine makes progress, so the router can tell a
worker that stopped (SIGSTOP, a stuck engine) from a slow one by the idle time of its entries.

Redis may lose its data (restarted without persistence, FLUSHALL): the consumer group is made again at once (at
id 0, so what the router queued meanwhile is read), and entries that vanished need no acknowledgement.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from pdserve.shared.engine.llm_engine import RequestRejected
from pdserve.shared import tracing
from pdserve.shared.logs import logging_request, request_id
from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import BadSamplingParams, MessageError, PrefillRequest
from pdserve.shared.registry_client import RegistryError
from pdserve.shared.streams import ensure_group, is_nogroup
from pdserve.shared.transport.client import KVTransferError
from pdserve.shared.transport.connector import KVConnectorFactory
from pdserve.shared.transport.handshake import HandshakeError
from pdserve.shared.worker.base import Worker
from pdserve.shared.worker.events import error_event, publish
from pdserve.shared.worker.redis_retry import retry_redis
from pdserve.shared.worker.tracked import Tracked

from pdserve.services.prefill.handover import KVHandover, RequestAborted
from pdserve.services.prefill.rate import PrefillRate
from pdserve.services.prefill.settings import PrefillSettings

logger = logging.getLogger(__name__)


class PrefillWorker(Worker):
    role = "prefill"

    def __init__(self, settings: PrefillSettings) -> None:
        super().__init__(settings)
        self.inflight: dict[str, tuple[str, PrefillRequest]] = {}  # request id -> (queue entry id, request)
        # request id -> queue entry id, from delivery (XREADGROUP/XAUTOCLAIM) until it is in ``inflight``: the
        # same entry can arrive twice (our own reclaim loop) and must be admitted once, and it is ours to touch
        self._admitting: dict[str, object] = {}
        # entry id -> (request id or None, when delivered) of a delivered batch not admitted yet: touched as well, and
        # kept alive toward the router (admitting one waits for an engine step: the last of a batch waits many)
        self._delivered: dict[object, tuple[str | None, float]] = {}
        self.connector = KVConnectorFactory.create_connector(settings.kv_transfer_config)
        # the KV hand-over through the connector (its senders are made in start_role, from the engine's KV layout)
        self.handover = KVHandover(self.connector, None, self.metrics, lambda rid: rid in self.inflight,
                                   settings.kv_wait_timeout_s)
        self._slots = asyncio.Semaphore(settings.max_inflight)
        self.transfers: set[asyncio.Task] = set()
        self.admissions: set[asyncio.Task] = set()  # batches read from the queue, waiting to reach the engine
        self.waiting_kv_bytes = 0  # exported KV of transfers not finished yet
        self.prefilled: set[str] = set()  # held requests whose first token is out (waiting for their hand-over)
        self.rate = PrefillRate()

    async def start_role(self) -> None:
        t = self.settings.kv_transfer_timeout_s
        self.handover.senders = self.connector.sender_pool(
            self.kv_layout(), self.settings.kv_transfer_secret, connect_timeout_s=t, request_timeout_s=t,
            peer_alive=self._decode_pod_alive)
        await self._ensure_group()
        self.tasks += [asyncio.create_task(self._consume()), asyncio.create_task(self._reclaim()),
                       asyncio.create_task(self._touch_loop())]

    async def _ensure_group(self) -> bool:
        return await ensure_group(self.redis, keys.PREFILL_STREAM, keys.PREFILL_GROUP)

    async def stop(self) -> None:
        for task in (*self.transfers, *self.admissions):
            task.cancel()
        await self.handover.close()
        await super().stop()

    def worker_stats(self) -> dict:
        stats = super().worker_stats()
        stats.update(kv_waiting_requests=len(self.handover.waiting), kv_waiting_bytes=self.waiting_kv_bytes)
        return stats

    def _to_prefill(self) -> list[int]:
        """Per held queue entry not prefilled yet, the tokens its prefill computes (prompt, and a resumed request's
        output); an entry whose first token is out waits only for its hand-over and costs the prefill tier nothing."""
        return [len(r.prompt_token_ids) + len(r.output_token_ids)
                for rid, (_, r) in self.inflight.items() if rid not in self.prefilled]

    def queued_prefill_tokens(self) -> int:
        """Tokens of the queue entries this worker holds and has not prefilled yet."""
        return sum(self._to_prefill())

    def pod_fields(self) -> dict:
        """What routers estimate this pod's TTFT from (``pd_policy.PrefillTier``): the tokens queued to prefill, those of
        long prompts (over ``long_prefill_token_threshold``: prefilled in chunks, one at a time, while shorter ones pass
        them), and the measured prefill rate."""
        if self.stats is not None:
            self.rate.add(time.monotonic(), self.stats.prompt_tokens_computed, self.stats.busy_seconds)
        threshold = self.settings.long_prefill_token_threshold
        queued = self._to_prefill()
        return {"queued_prefill_tokens": sum(queued),
                "queued_long_prefill_tokens": sum(n for n in queued if 0 < threshold < n),
                "long_prefill_token_threshold": threshold,
                "prefill_tokens_per_s": round(self.rate.tokens_per_s(), 1)}

    # queue
    async def _consume(self) -> None:
        """Read the queue while the engine steps: each batch read is admitted by a task of its own, since
        admitting waits for the current step, and an entry left unread meanwhile would be silent toward the router
        (no worker sends keep-alives for it) for as long as that step lasts."""
        while True:
            await self._slots.acquire()
            self._slots.release()
            # Finished prefills waiting for a full decode pod hold their KV here: past the cap, take no more
            # prompts (they wait in the queue, where another prefill pod may take them) instead of growing.
            cap = self.settings.max_waiting_kv_bytes
            while cap and self.waiting_kv_bytes > cap:
                await asyncio.sleep(0.1)
            # Every entry waiting, up to the free slots (less those delivered and not admitted yet) and one step's
            # sequences: each batch reaches the engine in one call (``_admit_batch``), and batches read during a
            # step are all added before the next one, which prefills them together up to the token budget.
            free = min(self._slots._value - len(self._delivered), self.settings.max_num_seqs)  # noqa: SLF001
            if free <= 0:
                await asyncio.sleep(0.05)
                continue
            try:
                entries = await self.redis.xreadgroup(keys.PREFILL_GROUP, self.settings.pod_id,
                                                      {keys.PREFILL_STREAM: ">"}, count=max(1, free), block=1000)
                self.set_fault("prefill queue", None)
            except (RedisError, OSError) as exc:
                self.set_fault("prefill queue", f"reading {keys.PREFILL_STREAM} failed: {exc}")
                if is_nogroup(exc):  # Redis lost its data: make it again
                    try:
                        await self._ensure_group()
                        logger.warning("the prefill queue's consumer group was gone (Redis lost its data?); "
                                       "made it again")
                        continue
                    except (RedisError, OSError) as again:
                        logger.warning("recreating the consumer group failed: %s", again)
                await asyncio.sleep(1.0)
                continue
            for _, messages in entries or []:
                now = time.time()
                self._delivered.update({msg_id: delivered_entry(fields, now) for msg_id, fields in messages})
                task = asyncio.create_task(self._admit_delivered(messages))
                self.admissions.add(task)
                task.add_done_callback(self.admissions.discard)
            try:
                self.metrics.queue_depth.set(await self.redis.xlen(keys.PREFILL_STREAM))
            except (RedisError, OSError) as exc:
                logger.warning("reading the queue's length failed (%s)", exc)

    async def _admit_delivered(self, messages: list) -> None:
        """``_admit_batch`` for entries ``_consume`` read; an error leaves them pending (reclaimed later)."""
        try:
            await self._admit_batch(messages)
        except (RedisError, OSError) as exc:  # unacked entries stay pending: reclaimed later
            logger.warning("admitting queue entries failed (%s)", exc)
        except Exception:  # a bug on one entry must not stop the others
            logger.exception("admitting queue entries failed")
        self.metrics.queue_tokens.set(self.queued_prefill_tokens())

    async def _reclaim(self) -> None:
        idle_ms = int(self.settings.claim_idle_s * 1000)
        while True:
            await asyncio.sleep(max(0.5, self.settings.claim_idle_s / 4))
            try:
                # Redis 6.2 answers [next id, entries], Redis 7 adds the deleted ids
                reply = await self.redis.xautoclaim(keys.PREFILL_STREAM, keys.PREFILL_GROUP,
                                                    self.settings.pod_id, idle_ms, "0-0", count=16)
                for msg_id, fields in reply[1]:
                    if fields:
                        logger.info("reclaimed queue entry %s from a dead prefill worker", msg_id)
                        await self._admit(msg_id, fields)
            except (RedisError, OSError) as exc:
                if not is_nogroup(exc):  # a lost group: the consumer loop makes it again
                    logger.warning("XAUTOCLAIM failed: %s", exc)
            except Exception:  # this loop is what recovers dead workers' entries: it must not die
                logger.exception("reclaiming queue entries failed")

    async def _touch_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.settings.claim_idle_s / 4))
            if self.engine_stalled() is None:  # a stuck engine's entries go idle: reclaimed or moved elsewhere
                await self._touch()

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

    def silent_requests(self, before: float) -> list[str]:
        """The requests held here silent since ``before`` (``Worker.silent_requests``), and those delivered to this
        worker but not admitted into its engine yet, delivered before ``before``."""
        return super().silent_requests(before) + [rid for rid, at in list(self._delivered.values())
                                                  if rid is not None and at < before]

    async def _decode_pod_alive(self, host: str, kv_port: int) -> bool:
        """Whether a decode pod with this KV address is in the registry (its heartbeat is fresh: the registry drops
        a pod ``--pod-ttl-s`` after its last beat, and a pod's beats stop when its engine is stuck). An unreachable
        registry is no evidence of life."""
        try:
            pods = await self.registry.list_pods("decode")
        except (RegistryError, OSError) as exc:
            logger.warning("asking the registry whether decode pod %s:%d is alive failed: %s", host, kv_port, exc)
            return False
        return any(p.host == host and p.kv_port == kv_port for p in pods)

    async def _ack(self, msg_id, retry_s: float = 60.0) -> None:
        """XACK + XDEL, retried with backoff while Redis is away (an entry left pending would be reclaimed and
        run twice)."""
        async def ack() -> None:
            try:
                await self.redis.xack(keys.PREFILL_STREAM, keys.PREFILL_GROUP, msg_id)
            except RedisError as exc:
                if not is_nogroup(exc):
                    raise
                return  # the group went with Redis's data, and the entry with it: nothing left to acknowledge
            await self.redis.xdel(keys.PREFILL_STREAM, msg_id)

        await retry_redis(ack, f"acknowledging {msg_id}", retry_s)

    async def _admit(self, msg_id, fields) -> None:
        await self._admit_batch([(msg_id, fields)])

    async def _admit_batch(self, messages: list) -> None:
        """Admit delivered queue entries ``[(entry id, fields)]``: each is checked (decoded, not a duplicate, not
        aborted), then every good one goes to the engine in one call between two steps, so the next step prefills
        them together (up to ``max_num_batched_tokens``) instead of one per step. Bad entries are answered and
        acknowledged here; good ones stay unacknowledged until their hand-over (``_transfer``)."""
        ready: list[tuple[object, PrefillRequest]] = []
        try:
            for msg_id, fields in messages:
                req = await self._check_entry(msg_id, fields)
                if req is not None:
                    ready.append((msg_id, req))
            await self._admit_new(ready)
        finally:
            for _, req in ready:
                self._admitting.pop(req.request_id, None)
            for msg_id, _ in messages:
                self._delivered.pop(msg_id, None)

    async def _check_entry(self, msg_id, fields) -> PrefillRequest | None:
        """The entry's request, now held in ``_admitting``; None when the entry was answered here (malformed, bad
        sampling params, a duplicate of a request running here) or is one this worker already holds."""
        try:
            req = PrefillRequest.decode(fields)
        except BadSamplingParams as exc:
            self.writer.route(exc.request_id, exc.router_id)
            await self._fail(msg_id, exc.request_id, str(exc), 400, "BadRequestError")
            return None
        except MessageError as exc:
            logger.error("dropping malformed queue entry %s: %s", msg_id, exc)
            await self._ack(msg_id)
            return None
        held = self.inflight[req.request_id][0] if req.request_id in self.inflight else \
            self._admitting.get(req.request_id)
        if held is not None:
            if held != msg_id:  # a second entry for a request running here (at-least-once): the first one answers
                logger.info("dropping queue entry %s: request %s is already running here", msg_id, req.request_id)
                await self._ack(msg_id)
            return None  # else our own reclaim loop delivered the entry we hold
        self._admitting[req.request_id] = msg_id  # no await between the check and this
        tracing.record("queue", req.traceparent, keys.enqueued_at(msg_id), time.time(), {
            "messaging.system": "redis", "messaging.destination.name": keys.PREFILL_STREAM,
            "pdserve.pod": self.settings.pod_id}, kind="consumer")
        return req

    async def _admit_new(self, ready: list[tuple[object, PrefillRequest]]) -> None:
        aborted = await self._aborted([req.request_id for _, req in ready])
        admitted = []
        for (msg_id, req), gone in zip(ready, aborted):
            if gone:
                await self._ack(msg_id)
                continue
            await self._slots.acquire()
            if req.request_id in self.aborted:  # aborted while it waited for a slot
                self._slots.release()
                await self._ack(msg_id)
                continue
            self.inflight[req.request_id] = (msg_id, req)
            span = tracing.start("prefill", req.traceparent, {"gen_ai.request.model": req.model,
                                                              "gen_ai.usage.input_tokens": req.prompt_tokens,
                                                              "pdserve.pod": self.settings.pod_id})
            self.track(req.request_id, Tracked(req.arrival_time, req.sampling_params.logprobs,
                                               admitted=time.time(), router_id=req.router_id, span=span))
            admitted.append((msg_id, req))
        if not admitted:
            return
        errors = await self.engine_thread.acall(self._add_requests, [req for _, req in admitted])
        for (msg_id, req), exc in zip(admitted, errors):
            if exc is None:
                continue
            self._forget(req.request_id)
            with logging_request(req.request_id):
                if isinstance(exc, (RequestRejected, ValueError)):
                    await self._fail(msg_id, req.request_id, str(exc), 400, "BadRequestError",
                                     getattr(exc, "param", None))
                else:  # a bug on one request must not leave it held here, nor stop the others
                    logger.error("adding request %s to the engine failed", req.request_id, exc_info=exc)
                    await self._fail(msg_id, req.request_id, f"prefill failed: {exc!r}", 500, "InternalServerError")

    def _add_requests(self, reqs: list[PrefillRequest]) -> list[Exception | None]:
        """Engine thread, between two steps: add every request; per request, None or the error that refused it."""
        errors: list[Exception | None] = []
        for req in reqs:
            if req.request_id not in self.requests:  # aborted while this call waited for the step: never prefilled
                errors.append(None)
                continue
            try:
                self.engine.add_request(req.request_id, req.prompt_token_ids, req.sampling_params,
                                        arrival_time=req.arrival_time, priority=req.priority, cache_salt=req.cache_salt,
                                        prefill_only=True, output_token_ids=req.output_token_ids,
                                        output_text_len=req.output_text_len)
                errors.append(None)
            except Exception as exc:  # handed back to the loop, which answers that request alone
                errors.append(exc)
        return errors

    async def _aborted(self, request_ids: list[str]) -> list[bool]:
        """Whether each request was aborted before it got here (its marker key exists): one round trip."""
        if not request_ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in request_ids:
                pipe.exists(keys.aborted_key(rid))
            return [bool(n) for n in await pipe.execute()]

    def _forget(self, request_id: str) -> None:
        self.prefilled.discard(request_id)
        if self.inflight.pop(request_id, None) is not None:
            self._slots.release()
        info = self.requests.pop(request_id, None)
        if info is not None:
            tracing.end(info.span, error="ended before its first token")

    async def _fail(self, msg_id, request_id: str, message: str, code: int, type_: str,
                    param: str | None = None) -> None:
        self.metrics.requests_failed.inc()
        logger.warning("request %s failed: %s", request_id, message)
        await publish(self.writer, self.redis, [error_event(request_id, message, code, type_, param)])
        await self._ack(msg_id)

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        self.handover.cancel_wait(request_id)  # waiting in line it holds no reservation yet: it just leaves
        entry = self.inflight.get(request_id)
        if entry is not None:
            self._forget(request_id)
            await self._ack(entry[0])

    # after each step
    def on_outputs_engine_thread(self, outputs):
        # export while the blocks are held, then let them go (they stay in the prefix cache)
        return self.engine.take_exports()

    async def handle_outputs(self, outputs, exported) -> None:
        tracked = {o.request_id: self.requests[o.request_id].span for o in outputs if o.request_id in self.requests}
        await self.publish_outputs(outputs)  # the first token: TTFT; failed requests are aborted (not in inflight)
        for out in outputs:
            span = tracked.get(out.request_id)
            tracing.event(span, "first_token")
            tracing.end(span, {"gen_ai.usage.cache_read.input_tokens": getattr(out, "num_cached_tokens", None)})
        for out in outputs:
            rid = out.request_id
            if rid not in tracked or rid not in self.inflight:
                continue
            msg_id, req = self.inflight[rid]
            self.prefilled.add(rid)
            if rid not in exported:  # finished by its first token
                self._forget(rid)
                await self._ack(msg_id)
                continue
            task = asyncio.create_task(self._transfer(msg_id, req, out, *exported[rid]))
            self.transfers.add(task)
            task.add_done_callback(self.transfers.discard)

    # KV transfer
    async def _mark(self, req: PrefillRequest, why: str | None) -> None:
        """Tell routers the decode pod's KV port failed (``why``), or works again (None)."""
        try:
            if why is None:
                await self.redis.hdel(keys.KV_UNREACHABLE, req.decode_pod_id)
                return
            cooldown = self.settings.kv_unreachable_cooldown_s
            logger.warning("decode pod %s (%s:%d) is unreachable for KV transfer (%s): routers avoid it for %g s",
                           req.decode_pod_id, req.decode_host, req.decode_kv_port, why, cooldown)
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(keys.KV_UNREACHABLE, req.decode_pod_id, time.time() + cooldown)
                pipe.expire(keys.KV_UNREACHABLE, max(1, int(cooldown) + 1))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            logger.warning("marking decode pod %s failed: %s", req.decode_pod_id, exc)

    async def _transfer(self, msg_id, req: PrefillRequest, out, block_hashes, kv) -> None:
        rid = req.request_id
        request_id.set(rid)  # this task's log lines (it runs in a context of its own)
        first_token = out.outputs[0].token_ids[-1]  # after any resumed output
        held = kv.numel() * kv.element_size()
        self.waiting_kv_bytes += held
        span = tracing.start("kv_transfer", req.traceparent, {"pdserve.decode_pod": req.decode_pod_id,
                                                              "pdserve.pod": self.settings.pod_id})
        try:
            if not await self.handover.hand_over(req, first_token, out.metrics.get("first_token_time"), block_hashes,
                                                 kv, span):  # a worker that died before its XACK handed it over already
                logger.info("request %s is already on decode pod %s; acknowledging the redelivered entry",
                            rid, req.decode_pod_id)
            self._forget(rid)
            await self._ack(msg_id)
            await self._mark(req, None)
        except asyncio.CancelledError:  # abort() while it waited in line, or stop()
            raise
        except RequestAborted:  # abort() acknowledged its entry already
            logger.info("request %s was aborted before its hand-over", rid)
        except (KVTransferError, HandshakeError, OSError, asyncio.TimeoutError) as exc:
            self._forget(rid)
            if await self.is_aborted(rid):
                await self._ack(msg_id)
                return
            why = describe(exc)
            if isinstance(exc, OSError) or getattr(exc, "unreachable", False):
                # the router moves the request to another decode pod when it sees this mark (503 + marked pod)
                await self._mark(req, why)
            await self._fail(msg_id, rid, f"KV transfer to decode pod {req.decode_pod_id} failed: {why}", 503,
                             "ServiceUnavailableError")
        finally:
            self.waiting_kv_bytes -= held
            tracing.end(span, error="KV transfer did not complete")  # no-op once ended above


def delivered_entry(fields, now: float) -> tuple[str | None, float]:
    """A delivered prefill queue entry's request id (None for an unreadable one: ``_check_entry`` reports it), and
    since when (unix s) its request has been silent: its arrival at the router, else ``now``."""
    try:
        req = PrefillRequest.decode(fields)
    except BadSamplingParams as exc:
        return exc.request_id, now
    except Exception:  # a malformed entry: dropped with a log line by _check_entry
        return None, now
    return req.request_id, min(now, req.arrival_time or now)


def describe(exc: BaseException) -> str:
    """The exception's message, or its repr when the message is empty (``TimeoutError()`` says nothing)."""
    return str(exc) or repr(exc)
