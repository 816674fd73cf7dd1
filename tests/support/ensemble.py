"""A client of the ensemble end-to-end tests start (``pdserve.loadtest.cluster.Cluster``)."""

from __future__ import annotations

import httpx

from pdserve.loadtest.cluster import Cluster


def stream_completion(ensemble: Cluster, body: dict, on_text=None, timeout_s: float = 300) -> tuple[str, str | None]:
    """Stream ``POST /v1/completions`` through the ensemble's router, read with the strict SSE rule
    (``pdserve/loadtest/sse.py``); returns the text and the last finish reason. ``on_text(text so far)`` runs after every
    chunk that carried text (a test kills a process mid-stream there). An error chunk fails the test."""
    from pdserve.loadtest.sse import read_chunks

    text, finish = "", None
    with httpx.Client(timeout=timeout_s) as http:
        with http.stream("POST", f"{ensemble.router_url}/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            for data in read_chunks(resp.iter_lines()):
                assert "error" not in data, data
                for choice in data["choices"]:
                    text += choice.get("text") or ""
                    finish = choice.get("finish_reason") or finish
                if on_text is not None and text:
                    on_text(text)
    return text, finish
