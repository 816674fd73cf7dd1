"""A stand-in for the prefill and decode workers, speaking their Redis protocol to the router under test.

It stands in for the real workers (they have their own tests, with the real engine): it reads
``PrefillRequest``s from the prefill queue (group ``prefill``) and from its decode pods' own streams (group
``decode``), and answers each with a scripted completion written as ``OutputEvent``s, one token per event,
honouring ``max_tokens`` and ``logprobs``; it listens on ``pdserve:abort`` and stops a request when told.
Prompts that mention France are answered " The capital of France is Paris." then EOS; others get a
repeating sentence (so long ``max_tokens`` finish by length); ``replies`` scripts other texts (tool calls, say).
A prompt containing ``TRIGGER_WORKER_ERROR`` gets an error event; one containing ``TRIGGER_OUTPUT_GAP`` loses the event of its third token (as a worker whose
publish failed would).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import redis

from pdserve.shared.protocol import keys
from pdserve.shared.protocol.messages import OutputEvent, PrefillRequest, TokenLogprob
from pdserve.shared.worker.output_writer import OutputWriter

PARIS = " The capital of France is Paris."
FILLER = " The quick brown fox jumps over the lazy dog."


@dataclass
class Received:
    stream: str
    request: PrefillRequest


class StandInWorker:
    def __init__(self, redis_url: str, tokenizer, pod_ids: list[str], delay_s: float = 0.0,
                 prefill_s: float = 0.0) -> None:
        self.redis_url = redis_url
        self.tokenizer = tokenizer
        self.pod_ids = pod_ids
        self.delay_s = delay_s  # between tokens
        self.prefill_s = prefill_s  # before the first token (the prompt's prefill)
        self.received: list[Received] = []
        self.aborted: set[str] = set()
        self.abort_seen = threading.Event()
        self.finished: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._eos = tokenizer.eos_token_id
        # scripted model texts: a prompt containing the key is answered with the value, then EOS
        self.replies: dict[str, str] = {}

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        r = redis.Redis.from_url(self.redis_url)
        for stream, group in self._streams():
            try:
                r.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        r.close()
        # one pooled client for the requests' writers (a client per request paid a connection and its handshake)
        self._redis = redis.Redis.from_url(self.redis_url)
        self._pubsub_ready = threading.Event()
        self._reader_ids: dict[threading.Thread, int] = {}
        # one reader per consumer group, blocked in XREADGROUP until an entry arrives (polling the three streams
        # in turn cost up to ~60 ms before a request was picked up); ``stop`` wakes them with CLIENT UNBLOCK
        groups = {keys.PREFILL_GROUP: [keys.PREFILL_STREAM],
                  keys.DECODE_GROUP: [keys.decode_stream(p) for p in self.pod_ids]}
        ready = threading.Barrier(len(groups) + 1)
        readers = [threading.Thread(target=self._read_loop, args=(group, streams, ready), daemon=True)
                   for group, streams in groups.items()]
        for t in [*readers, threading.Thread(target=self._abort_loop, daemon=True)]:
            t.start()
            self._threads.append(t)
        ready.wait(5)
        self._pubsub_ready.wait(5)

    def stop(self) -> None:
        self._stop.set()
        # a reader blocked in XREADGROUP wakes only when an entry arrives or its block times out: CLIENT UNBLOCK
        # wakes it at once (tried until it has left, in case it was between two reads)
        r = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + 10
        for t in self._threads:  # the readers may still add a request's thread
            while t.is_alive() and time.monotonic() < deadline:
                if t in self._reader_ids:
                    r.client_unblock(self._reader_ids[t])
                t.join(0.01)
        r.close()
        self._redis.close()

    def _streams(self) -> list[tuple[str, str]]:
        return [(keys.PREFILL_STREAM, keys.PREFILL_GROUP)] + [
            (keys.decode_stream(p), keys.DECODE_GROUP) for p in self.pod_ids]

    # ---- loops -------------------------------------------------------------------------------

    def _abort_loop(self) -> None:
        r = redis.Redis.from_url(self.redis_url)
        pubsub = r.pubsub()
        pubsub.subscribe(keys.ABORT_CHANNEL)
        self._pubsub_ready.set()
        while not self._stop.is_set():
            msg = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
            if msg and msg["type"] == "message":
                self.aborted.add(msg["data"].decode())
                self.abort_seen.set()
        pubsub.close()
        r.close()

    def _read_loop(self, group: str, streams: list[str], ready: threading.Barrier) -> None:
        r = redis.Redis.from_url(self.redis_url, single_connection_client=True)
        self._reader_ids[threading.current_thread()] = r.client_id()
        ready.wait(5)
        while not self._stop.is_set():
            reply = r.xreadgroup(group, "stand-in", dict.fromkeys(streams, ">"), count=16, block=1000)
            for stream, entries in reply or []:
                stream = stream.decode()
                for entry_id, fields in entries:
                    req = PrefillRequest.decode(fields)
                    self.received.append(Received(stream, req))
                    r.xack(stream, group, entry_id)
                    r.xdel(stream, entry_id)
                    t = threading.Thread(target=self._serve, args=(req,), daemon=True)
                    t.start()
                    self._threads.append(t)
        r.close()

    # ---- one request -------------------------------------------------------------------------

    def script(self, req: PrefillRequest) -> list[int]:
        prompt = self.tokenizer.decode(req.prompt_token_ids)
        found = [(prompt.rfind(marker), text) for marker, text in self.replies.items() if marker in prompt]
        if found:  # the reply to the marker latest in the prompt (the conversation's last turn)
            return self.tokenizer.encode(max(found)[1], add_special_tokens=False) + [self._eos]
        if "France" in prompt:
            return self.tokenizer.encode(PARIS, add_special_tokens=False) + [self._eos]
        ids = self.tokenizer.encode(FILLER, add_special_tokens=False)
        return ids * (req.sampling_params.max_tokens // len(ids) + 1)

    def _serve(self, req: PrefillRequest) -> None:
        r = self._redis
        writer = OutputWriter(r, pod_id="stand-in")
        writer.route(req.request_id, req.router_id)  # as a worker does when it takes a request: to its router

        def emit(event: OutputEvent) -> bool:
            return bool(writer.write(event))

        if r.exists(keys.aborted_key(req.request_id)):
            return
        prompt_text = self.tokenizer.decode(req.prompt_token_ids)
        if "TRIGGER_WORKER_ERROR" in prompt_text:
            emit(OutputEvent(req.request_id, req.choice_index, prompt_tokens=len(req.prompt_token_ids),
                             error={"message": "the stand-in worker failed", "type": "InternalServerError",
                                    "code": 500}))
            return
        params = req.sampling_params.to_dict()
        script = self.script(req)
        generated: list[int] = []
        text_so_far = ""
        k = params.get("logprobs")
        if self.prefill_s:
            time.sleep(self.prefill_s)
        for token in script[: params["max_tokens"]]:
            if req.request_id in self.aborted or self._stop.is_set():
                return
            generated.append(token)
            is_eos = token == self._eos and not params.get("ignore_eos")
            visible = [t for t in generated if t != self._eos]
            text = self.tokenizer.decode(visible, skip_special_tokens=True)
            delta, text_so_far = text[len(text_so_far):], text
            done = is_eos or len(generated) == params["max_tokens"]
            logprobs = None
            if k is not None:
                top = [(token, -0.25), (token + 1, -1.5), (token + 2, -3.0)][:k]
                logprobs = [TokenLogprob(token, -0.25, top)]
            event = OutputEvent(req.request_id, req.choice_index, [token], delta,
                                ("stop" if is_eos else "length") if done else None, logprobs,
                                prompt_tokens=len(req.prompt_token_ids), completion_tokens=len(generated))
            if "TRIGGER_OUTPUT_GAP" in prompt_text and len(generated) == 3 and not done:
                continue  # this event is lost on its way
            if not emit(event):
                return
            if done:
                self.finished.append(req.request_id)
                return
            if self.delay_s:
                time.sleep(self.delay_s)
