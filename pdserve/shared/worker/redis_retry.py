"""Retrying one Redis operation through an outage (a Redis restart), for work that must not be lost."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import RedisError

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def retry_redis(operation: Callable[[], Awaitable[T]], what: str, retry_s: float = 60.0) -> T:
    """``await operation()``, called again on ``RedisError``/``OSError`` with exponential backoff (0.1 s .. 2 s)
    for up to ``retry_s`` seconds; then the last error is raised. ``what`` names the operation in the warning
    logged for each retry. The operation may run more than once: it must be safe to repeat."""
    delay, deadline = 0.1, time.monotonic() + retry_s
    while True:
        try:
            return await operation()
        except (RedisError, OSError) as exc:
            if time.monotonic() + delay > deadline:
                raise
            logger.warning("%s failed (%s); retrying in %.1f s", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)
