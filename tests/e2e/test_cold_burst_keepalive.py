"""The first burst after start completes under a short silence bound: keep-alives never wait for an engine step.

Real processes: ``pdserve up`` (redis-server, registry, router, one prefill and one decode worker, the real model)
with the issue's shrunken KV pools (45 MiB each: 1,024 fp32 tokens of this model, so the burst below oversubscribes
both pods: prompts wait for the prefill pod's blocks, finished prefills for the decode pod's, and decodes are
preempted), the router's bound at 4 s and the workers' keep-alive interval at 2 s (the shortest pair the router
accepts). Eight streams of long prompts start together on the fresh ensemble, so requests queue behind its cold
first steps. Before, requests queued during a step were not read until it ended and got no keep-alive meanwhile;
the issue measured 6 of 8 ``504 No output for 8 s`` with an 8 s bound. Oracle: every stream ends with its last token
(``length``, ``ignore_eos``), no error chunk, and the router logged no 504."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from support.ensemble import Ensemble

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 48
STORY = "Once upon a time in a city of bridges, each painted a different colour by its guild. "
ENV = {"PDSERVE_REQUEST_TIMEOUT_S": "4", "PDSERVE_OUTPUT_KEEPALIVE_S": "2", "PDSERVE_DTYPE": "float32"}


async def stream_one(client: httpx.AsyncClient, url: str, i: int) -> dict:
    body = {"model": MODEL, "prompt": f"Story {i}: " + STORY * 12, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    finish, errors, usage = None, [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"status": resp.status_code, "body": (await resp.aread()).decode()}
        async for line in resp.aiter_lines():
            if not line or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                errors.append(chunk["error"])
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    return {"status": 200, "finish": finish, "errors": errors,
            "completion_tokens": usage and usage["completion_tokens"]}


def test_a_cold_start_burst_under_a_short_bound_completes_every_request(tmp_path):
    with Ensemble("--prefill", "1", "--decode", "1", "--kv-cache-memory", "47185920", log_dir=tmp_path,
                  env=ENV) as ens:
        async def burst():
            async with httpx.AsyncClient(timeout=600) as client:
                return await asyncio.gather(*[stream_one(client, ens.router_url, i) for i in range(8)])

        results = asyncio.run(burst())
        router_log = (tmp_path / "router.log").read_text()
    expected = {"status": 200, "finish": "length", "errors": [], "completion_tokens": MAX_TOKENS}
    assert results == [expected] * 8, results
    assert "No output for" not in router_log
