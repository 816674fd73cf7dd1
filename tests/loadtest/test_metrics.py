"""Metric definitions (vLLM bench serve) on synthetic timelines with hand-computed answers."""

from __future__ import annotations

import pytest

from pdserve.loadtest.metrics import compute_metrics, good_fraction, output_len, request_tpot
from pdserve.loadtest.timeline import RequestRecord, StreamTimeline


def cmpl(text, finish=None, usage=None):
    d = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        d["usage"] = {"prompt_tokens": 10, "completion_tokens": usage}
    return d


def chat(content=None, role=False):
    delta = {"role": "assistant", "content": ""} if role else {"content": content}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def usage_only(n, prompt=None):
    u = {"completion_tokens": n}
    if prompt is not None:
        u["prompt_tokens"] = prompt
    return {"choices": [], "usage": u}


def play(events, *, index=0, send=0.0, prompt_len=0):
    rec = RequestRecord(index=index, prompt_len=prompt_len, actual_send=send, dispatch=send, intended_send=send)
    tl = StreamTimeline(rec, start=100.0)
    for t, data in events:
        tl.on_chunk(100.0 + t, data)
    return tl.finish()


def empty_first_chunk_and_usage_only_final():
    # empty first chunk (no content, no token count), three text chunks, an empty finish chunk, usage-only chunk
    return play([(0.1, cmpl("")), (0.5, cmpl("Hel")), (0.7, cmpl("lo wo")), (1.0, cmpl("rld")),
                 (1.0, cmpl("", "length")), (1.1, usage_only(6, prompt=12))], send=0.0, prompt_len=99)


def multi_token_chunks():
    # continuous usage stats: running counts 2, 5, 6 -> chunks carried 2, 3, 1 tokens
    return play([(0.2, cmpl("ab", usage=2)), (0.4, cmpl("cde", usage=5)), (0.9, cmpl("f", usage=6))],
                index=1, send=0.5, prompt_len=10)


def single_token():
    return play([(0.3, cmpl("x")), (0.35, usage_only(1))], index=2, send=1.2, prompt_len=4)


def failed():
    rec = RequestRecord(index=3, prompt_len=7)
    return StreamTimeline(rec, 0.0).fail("500", "boom")


def test_ttft_skips_empty_first_chunk_and_e2el_ends_at_last_content_chunk():
    rec = empty_first_chunk_and_usage_only_final()
    assert rec.success and rec.status == "200"
    assert rec.ttft == pytest.approx(0.5)
    assert rec.itl == pytest.approx([0.2, 0.3])
    assert rec.latency == pytest.approx(1.0)  # not the usage chunk at 1.1
    assert rec.output_tokens == 6 and rec.usage_prompt_tokens == 12
    assert rec.generated_text == "Hello world"
    # 3 chunks but N = 6 and no per-chunk counts: the split is unknown, not guessed
    assert rec.chunk_tokens == [None, None, None]
    assert request_tpot(rec, output_len(rec)) == pytest.approx(0.5 / 5)


def test_multi_token_chunks_are_counted_from_continuous_usage():
    rec = multi_token_chunks()
    assert rec.chunk_tokens == [2, 3, 1]
    assert rec.itl == pytest.approx([0.2, 0.5])
    assert output_len(rec) == 6
    assert request_tpot(rec, 6) == pytest.approx(0.7 / 5)


def test_one_token_per_chunk_is_recorded_when_totals_agree():
    rec = play([(0.1, cmpl("a")), (0.2, cmpl("b")), (0.3, usage_only(2))])
    assert rec.chunk_tokens == [1, 1]


def test_single_token_request_has_no_tpot():
    rec = single_token()
    assert rec.success and output_len(rec) == 1
    assert request_tpot(rec, 1) is None


def test_chat_role_chunk_does_not_count_as_first_token():
    rec = play([(0.01, chat(role=True)), (0.4, chat("Hi")), (0.6, chat(" there")), (0.7, usage_only(2))])
    assert rec.ttft == pytest.approx(0.4)
    assert rec.itl == pytest.approx([0.2])
    assert rec.generated_text == "Hi there"


def test_token_only_chunk_without_text_counts_as_content():
    # a special token with no text still is a token: vLLM counts any choices chunk; we count token-bearing ones
    d = {"choices": [{"index": 0, "text": "", "token_ids": [7]}]}
    rec = play([(0.2, d), (0.3, cmpl("a", usage=None)), (0.4, usage_only(2))])
    assert rec.ttft == pytest.approx(0.2)


def test_stream_without_content_and_stream_errors_fail():
    rec = play([(0.1, chat(role=True)), (0.2, usage_only(0))])
    assert not rec.success and rec.status == "no_content"
    rec = play([(0.1, cmpl("a")), (0.2, {"error": {"message": "engine died", "code": 500}})])
    assert not rec.success and rec.status == "stream_error" and rec.error == "engine died"


def test_aggregate_metrics_match_hand_computed_values():
    recs = [empty_first_chunk_and_usage_only_final(), multi_token_chunks(), single_token(), failed()]
    m = compute_metrics(recs, 2.0, percentiles=[50, 99], goodput_slos_ms={"ttft": 400, "tpot": 130})
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["failed_by_status"] == {"500": 1}
    assert m["total_output_tokens"] == 6 + 6 + 1
    # usage.prompt_tokens (12) wins over the dataset's count (99); the failed request adds no input
    assert m["total_input_tokens"] == 12 + 10 + 4
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(6.5)
    assert m["total_token_throughput"] == pytest.approx(19.5)
    assert m["mean_ttft_ms"] == pytest.approx(1000 / 3)
    assert m["median_ttft_ms"] == pytest.approx(300)
    assert m["std_ttft_ms"] == pytest.approx(124.7219, rel=1e-5)
    # TPOT: only N > 1 requests
    assert m["mean_tpot_ms"] == pytest.approx(120)
    assert m["p99_tpot_ms"] == pytest.approx(139.6)
    # ITL: one sample per chunk gap, across requests
    assert m["mean_itl_ms"] == pytest.approx(300)
    assert m["median_itl_ms"] == pytest.approx(250)
    assert m["p99_itl_ms"] == pytest.approx(494)
    assert m["p50_itl_ms"] == pytest.approx(250)
    assert m["mean_e2el_ms"] == pytest.approx(2200 / 3)
    # goodput: only the single-token request meets TTFT <= 400 and TPOT <= 130 (TPOT 0 when N <= 1)
    assert m["request_goodput"] == pytest.approx(0.5)
    assert m["slo_attainment"] == pytest.approx(0.25)
    assert m["output_lens"] == [6, 6, 1, 0]
    assert m["max_concurrent_requests"] == 2
    # second 0: 2+2 tokens of request 0 (N=6 spread over 3 chunks) + 2+3 of request 1
    assert m["max_output_tokens_per_s"] == pytest.approx(9)
    assert good_fraction(recs, {"ttft": 400, "tpot": 130}) == pytest.approx(0.25)


def test_empty_sample_gives_zero_like_vllm():
    m = compute_metrics([failed()], 1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0 and m["p99_itl_ms"] == 0
    assert m["request_goodput"] is None


def test_client_lag_is_reported_and_warned_about():
    from pdserve.loadtest.results import build_result
    from pdserve.loadtest.runner import RunOutcome

    recs = [play([(0.1, cmpl("a")), (0.2, cmpl("b"))], index=i, send=i * 0.1) for i in range(10)]
    for i, r in enumerate(recs):
        r.intended_send = i * 0.1
        r.dispatch = r.intended_send + (0.050 if i == 9 else 0.001)  # the last one went out 50 ms late
        r.actual_send = r.dispatch
    outcome = RunOutcome(records=recs, duration_s=2.0, started_at=0.0, loop_lag_ms=[0.1], client_cpu_s=0.2)
    kw = dict(percentile_metrics=["ttft"], percentiles=[99.0], goodput_slos_ms=None, lag_warning_ms=10.0)
    res = build_result(outcome, meta={"request_rate": 5.0}, **kw)
    assert res["max_send_lag_ms"] == pytest.approx(50.0)
    assert res["p99_send_lag_ms"] == pytest.approx(1.0 + 0.91 * 49.0)
    assert res["client_lag_warning"].startswith("client lag: p99 45.6 ms (max 50.0 ms)")
    assert res["intended_send_times"] == pytest.approx([i * 0.1 for i in range(10)])
    assert build_result(outcome, meta={"request_rate": "inf"}, **kw)["client_lag_warning"] is None
    for r in recs:
        r.dispatch = r.actual_send = r.intended_send
    assert build_result(outcome, meta={"request_rate": 5.0}, **kw)["client_lag_warning"] is None
