"""A stand-in for ``LLMEngine`` on a decode pod, for the control-plane bench (``control_plane.py``): no model.

Every ``step_s`` seconds (on a fixed schedule, as a GPU's decode steps come) each running request gets one token,
up to ``max_num_seqs`` requests in the batch; a request added between two steps gets its first token at the next
one (its prefill costs nothing). Token ``i`` of a completion is ``TOKEN_BASE + i`` with the text ``token_text(i)``,
so a client can check what it got; with ``stamp``, each token's text ends in ``@`` and the wall-clock time of its
step (``stamped``), so a client on the same host measures how long the token took from the step to it. A request ends at its ``max_tokens`` (16 when None) with ``length``.

The KV events are the real engine's kinds: a request's full prompt blocks (hashed as the engine hashes them) are
``stored`` when it starts and ``removed`` when it ends, so the registry's index sees one batch of each per request.
Everything else a decode worker asks of its engine (``owns``, ``abort_request``, ``get_stats``, reservations for a
hand-over) is answered from the same small table. ``step_lateness`` records how late each step started against its
schedule: on a busy machine the stand-in pods themselves run late, which is not the control plane's doing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from pdserve.shared.engine.block_pool import KVCacheEvent
from pdserve.shared.engine.outputs import CompletionOutput, RequestOutput
from pdserve.shared.engine.stats import EngineStats
from pdserve.shared.protocol.block_hash import compute_block_hashes

TOKEN_BASE = 1000


def token_text(i: int) -> str:
    return f" w{i}"


def stamp_of(text: str) -> float | None:
    """The wall-clock time of the step of a chunk's last stamped token (None: no stamp)."""
    _, sep, tail = text.rpartition("@")
    return float(tail) if sep else None


@dataclass(slots=True)
class StubSequence:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    block_hashes: list[bytes]
    num_out: int = 0
    first_token_time: float | None = None
    token_ids: list[int] = field(default_factory=list)


class StubEngine:
    """The engine facade a ``DecodeWorker`` calls, answered without a model (see the module doc)."""

    tp = None
    step_log = None

    def __init__(self, step_s: float, max_num_seqs: int = 256, block_size: int = 16, num_blocks: int = 100_000,
                 max_model_len: int = 32768, enable_kv_events: bool = True, stamp: bool = False) -> None:
        self.step_s = step_s
        self.stamp = stamp
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.config = SimpleNamespace(enable_kv_events=enable_kv_events, tensor_parallel_size=1)
        self.kv_spec = SimpleNamespace(block_size=block_size, dtype=torch.bfloat16, num_layers=32, num_kv_heads=8,
                                       head_dim=128)
        self.waiting: dict[str, StubSequence] = {}
        self.running: dict[str, StubSequence] = {}
        self.reserved: dict[str, list[int]] = {}
        self._events: list[KVCacheEvent] = []
        self._lock = threading.Lock()  # owns() and stats are read from the worker's loop
        self._next_step = 0.0
        self.num_steps = 0
        self.generation_tokens = 0
        self.step_lateness: list[float] = []  # seconds each step started after its scheduled time

    # requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params=None, *, arrival_time=None,
                    output_token_ids=None, **_: object) -> None:
        if self.owns(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = (params.max_tokens if params is not None and params.max_tokens is not None else 16)
        seq = StubSequence(request_id, list(prompt_token_ids), max_tokens, arrival_time or time.time(),
                           compute_block_hashes(prompt_token_ids, self.kv_spec.block_size))
        if output_token_ids:  # a migrated request resumes where its client is
            seq.token_ids, seq.num_out = list(output_token_ids), len(output_token_ids)
        with self._lock:
            self.waiting[request_id] = seq

    def abort_request(self, request_id: str) -> bool:
        with self._lock:
            waiting = self.waiting.pop(request_id, None)
            running = self.running.pop(request_id, None)
            reserved = self.reserved.pop(request_id, None)
        if running is not None:
            self._removed(running)
        return waiting is not None or running is not None or reserved is not None

    def owns(self, request_id: str) -> bool:
        return request_id in self.waiting or request_id in self.running or request_id in self.reserved

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # a hand-over from a prefill pod
    def reserve(self, request_id: str, prompt_token_ids: list[int], cache_salt: str | None = None):
        self.reserved[request_id] = list(prompt_token_ids)
        return -(-len(prompt_token_ids) // self.kv_spec.block_size), 0

    def write_kv(self, request_id: str, first_block: int, data) -> None:
        pass

    def commit(self, request_id: str, first_token_id: int, params, *, arrival_time=None, output_token_ids=None,
               **_: object) -> None:
        prompt = self.reserved.pop(request_id)
        self.add_request(request_id, prompt, params, arrival_time=arrival_time,
                         output_token_ids=output_token_ids or [first_token_id])

    def release_reservation(self, request_id: str) -> None:
        self.reserved.pop(request_id, None)

    # the step
    def step(self) -> list[RequestOutput]:
        now = time.monotonic()
        if self._next_step <= now - self.step_s:  # idle meanwhile: a new schedule starts now
            self._next_step = now
        elif self._next_step > now:
            time.sleep(self._next_step - now)
        self.step_lateness.append(max(0.0, time.monotonic() - self._next_step))
        self._next_step += self.step_s
        with self._lock:
            while self.waiting and len(self.running) < self.max_num_seqs:
                rid, seq = next(iter(self.waiting.items()))
                del self.waiting[rid]
                self.running[rid] = seq
                self._stored(seq)
            batch = list(self.running.values())
        wall = time.time()
        outputs = [self._advance(seq, wall) for seq in batch]
        self.num_steps += 1
        self.generation_tokens += len(batch)
        return outputs

    def _advance(self, seq: StubSequence, wall: float) -> RequestOutput:
        i = seq.num_out
        token = TOKEN_BASE + i
        seq.token_ids.append(token)
        seq.num_out += 1
        if seq.first_token_time is None:
            seq.first_token_time = wall
        finish = "length" if seq.num_out >= seq.max_tokens else None
        if finish is not None:
            with self._lock:
                self.running.pop(seq.request_id, None)
            self._removed(seq)
        text = f"{token_text(i)}@{wall:.6f}" if self.stamp else token_text(i)
        completion = CompletionOutput(0, "", list(seq.token_ids), finish_reason=finish, new_text=text,
                                      new_token_ids=[token])
        return RequestOutput(seq.request_id, None, seq.prompt_token_ids, [completion], finish is not None,
                             metrics={"first_token_time": seq.first_token_time})

    # the prefix cache, for the block registry
    def _stored(self, seq: StubSequence) -> None:
        if self.config.enable_kv_events and seq.block_hashes:
            self._events.append(KVCacheEvent("stored", list(seq.block_hashes)))

    def _removed(self, seq: StubSequence) -> None:
        if self.config.enable_kv_events and seq.block_hashes:
            self._events.append(KVCacheEvent("removed", list(seq.block_hashes)))

    def kv_events(self) -> list:
        events, self._events = self._events, []
        return events

    def cached_block_hashes(self) -> list[bytes]:
        with self._lock:
            return [h for seq in self.running.values() for h in seq.block_hashes]

    def offloaded_block_hashes(self) -> dict[str, list[bytes]]:
        return {}

    # stats
    def get_stats(self) -> EngineStats:
        with self._lock:
            used = sum(-(-(len(s.prompt_token_ids) + s.num_out) // self.kv_spec.block_size)
                       for s in self.running.values())
            return EngineStats(kv_blocks_total=self.num_blocks, kv_blocks_used=used,
                               kv_cache_usage=used / self.num_blocks, num_running=len(self.running),
                               num_waiting=len(self.waiting), block_size=self.kv_spec.block_size,
                               max_model_len=self.max_model_len, generation_tokens=self.generation_tokens,
                               num_steps=self.num_steps)
