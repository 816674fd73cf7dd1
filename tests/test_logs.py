"""Every log line names the request being handled (``pdserve/shared/logs.py``), across awaits and the tasks it starts,
and only while it is handled."""

from __future__ import annotations

import asyncio
import logging

from pdserve.shared.logs import logging_request

from support.log_capture import captured_log


def test_log_lines_carry_the_request_id_inside_a_request_and_its_tasks_only():
    log = logging.getLogger("pdserve.test_logs")

    async def child() -> None:
        log.info("in a task it started")

    async def handle(rid: str) -> None:
        with logging_request(rid):
            await asyncio.sleep(0.01)  # the other request runs meanwhile
            log.info("admitted")
            await asyncio.create_task(child())
        log.info("done")

    async def main() -> None:
        await asyncio.gather(handle("cmpl-1-0"), handle("cmpl-2-0"))

    with captured_log("pdserve.test_logs") as stream:
        asyncio.run(main())
    lines = sorted(stream.getvalue().splitlines())
    assert lines == sorted([
        "INFO pdserve.test_logs [cmpl-1-0]: admitted", "INFO pdserve.test_logs [cmpl-1-0]: in a task it started",
        "INFO pdserve.test_logs [cmpl-2-0]: admitted", "INFO pdserve.test_logs [cmpl-2-0]: in a task it started",
        "INFO pdserve.test_logs [-]: done", "INFO pdserve.test_logs [-]: done"])
