"""The prefill queue's backlog, read from Redis: entries and prompt tokens waiting or in prefill.

The queue is the stream ``pdserve:{q-prefill}:queue`` with consumer group ``prefill`` (pdserve/shared/protocol/keys.py). An
entry is *waiting* when it comes after the group's last-delivered id, and *in prefill* while it is pending
(delivered, not yet acknowledged). Each entry carries a plain ``prompt_tokens`` field (pdserve/shared/protocol/
messages.py: ``PrefillRequest.encode``), so the tokens are summed without unpacking payloads. Redis 7
reports the group's ``lag`` in XINFO GROUPS; Redis 6.2 does not, so the waiting entries are counted by
reading them (at most ``max_entries``; beyond that their count is XLEN less the pending entries, and their
tokens are extrapolated from the mean of those read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.shared.protocol.keys import PREFILL_GROUP, PREFILL_STREAM


@dataclass(slots=True, frozen=True)
class Backlog:
    waiting_entries: int
    pending_entries: int
    waiting_tokens: int
    pending_tokens: int
    stream_length: int

    @property
    def tokens(self) -> int:
        """Prompt tokens the prefill tier still has to compute."""
        return self.waiting_tokens + self.pending_tokens

    @property
    def entries(self) -> int:
        return self.waiting_entries + self.pending_entries


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _tokens(fields: dict[Any, Any]) -> int:
    raw = fields.get(b"prompt_tokens", fields.get("prompt_tokens"))
    try:
        return int(_s(raw)) if raw is not None else 0
    except ValueError:
        return 0


def _group_info(client: Any, stream: str, group: str) -> dict[str, Any] | None:
    for info in client.xinfo_groups(stream):
        info = {_s(k): v for k, v in info.items()}
        if _s(info["name"]) == group:
            return info
    return None


def read_backlog(client: Any, stream: str = PREFILL_STREAM, group: str = PREFILL_GROUP, max_entries: int = 10_000) -> Backlog:
    """The backlog of ``group`` on ``stream`` through a redis-py client (sync). No stream or group: empty."""
    if not client.exists(stream):
        return Backlog(0, 0, 0, 0, 0)
    length = int(client.xlen(stream))
    info = _group_info(client, stream, group)
    if info is None:
        # Nobody consumes yet: the whole stream waits.
        entries = client.xrange(stream, "-", "+", count=max_entries)
        tokens = sum(_tokens(f) for _, f in entries)
        waiting = length
        if length > len(entries) and entries:
            tokens = round(tokens * length / len(entries))
        return Backlog(waiting, 0, tokens, 0, length)

    last_id = _s(info["last-delivered-id"])
    waiting_list = client.xrange(stream, f"({last_id}", "+", count=max_entries)
    waiting_tokens = sum(_tokens(f) for _, f in waiting_list)
    pending = int(info["pending"])
    lag = info.get("lag")
    if lag is not None:
        waiting = int(lag)
    elif len(waiting_list) < max_entries:
        waiting = len(waiting_list)
    else:
        # Redis < 7 and more waiting than read: the workers delete what they acknowledge, so what is in the
        # stream and not pending is waiting.
        waiting = max(len(waiting_list), length - pending)
    if waiting > len(waiting_list) and waiting_list:
        waiting_tokens = round(waiting_tokens * waiting / len(waiting_list))

    pending_tokens = 0
    if pending:
        ids = [e["message_id"] for e in client.xpending_range(stream, group, "-", "+", min(pending, max_entries))]
        pipe = client.pipeline(transaction=False)
        for mid in ids:
            pipe.xrange(stream, mid, mid)
        found = [r[0][1] for r in pipe.execute() if r]  # an entry may be trimmed while still pending
        pending_tokens = sum(_tokens(f) for f in found)
        if pending > len(found) and found:
            pending_tokens = round(pending_tokens * pending / len(found))
    return Backlog(waiting, pending, waiting_tokens, pending_tokens, length)
