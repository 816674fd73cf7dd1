"""``pdserve bench serve`` end to end over real HTTP against the mock server in its own process."""

from __future__ import annotations

import csv
import json
import sys

import pytest
from click.testing import CliRunner

from pdserve.loadtest.arrivals import arrival_times
from pdserve.loadtest.cli import bench
from pdserve.loadtest.procs import free_port

from loadtest_support import STANDIN, TOKENIZER

pytestmark = pytest.mark.slow

VLLM_KEYS = [
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts",
    "itls", "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests", "date",
    "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
] + [f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")]
EXTRA_KEYS = ["failed_by_status", "itl_chunk_tokens", "intended_send_times", "actual_send_times",
              "p99_send_lag_ms", "client_lag_warning", "p99_client_loop_lag_ms", "client_overhead", "slo_attainment"]


def serve(*args: str):
    return CliRunner().invoke(bench, ["serve", "--disable-tqdm", *args], catch_exceptions=False)


def test_serve_writes_every_key_with_values_the_mock_implies(mock, tmp_path):
    out = tmp_path / "run.json"
    before = mock.generation_requests()
    r = serve("--base-url", mock.url, "--model", "mock-model", "--tokenizer", TOKENIZER, "--num-prompts", "12",
              "--random-input-len", "32", "--random-output-len", "8", "--request-rate", "40",
              "--goodput", "ttft:10000", "tpot:10000", "--metric-percentiles", "50,99",
              "--save-result", str(out), "--save-detailed", "--plot", str(tmp_path / "run.png"))
    assert r.exit_code == 0, r.output
    assert "Serving Benchmark Result" in r.output
    res = json.loads(out.read_text())
    assert [k for k in VLLM_KEYS + EXTRA_KEYS if k not in res] == []
    assert mock.generation_requests() - before == 12
    assert res["completed"] == 12 and res["failed"] == 0 and res["failed_by_status"] == {}
    # prompt lengths aligned through the server's /tokenize, output lengths from max_tokens
    assert res["input_lens"] == [32] * 12 and res["total_input_tokens"] == 384
    assert res["output_lens"] == [8] * 12 and res["total_output_tokens"] == 96
    # the mock cannot answer faster than it was told: TTFT >= 50 ms, E2EL >= 50 + 7 * 10 ms
    assert min(res["ttfts"]) >= 0.050
    assert res["mean_e2el_ms"] >= 120.0 and res["p50_ttft_ms"] >= 50.0
    assert all(len(itl) == 7 for itl in res["itls"])
    assert res["itl_chunk_tokens"] == [[1] * 8] * 12
    # every request met the generous SLOs: goodput equals throughput
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    assert res["output_throughput"] == pytest.approx(96 / res["duration"])
    assert res["request_rate"] == 40.0 and res["burstiness"] == 1.0
    # requests went out on the gamma schedule of the seed, never before their intended time
    assert res["intended_send_times"] == pytest.approx(list(arrival_times(12, 40.0, 1.0, seed=0)))
    assert all(a >= i for a, i in zip(res["actual_send_times"], res["intended_send_times"]))
    ov = res["client_overhead"]
    assert ov["configured_ttft_ms"] == 50.0 and ov["configured_itl_ms"] == pytest.approx(10.0)
    assert ov["mean_ttft_overhead_ms"] == pytest.approx(res["mean_ttft_ms"] - 50.0)
    lines = (tmp_path / "run.requests.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    assert len(rows) == 12 and all(row["output_len"] == 8 and row["status"] == "200" for row in rows)
    with open(tmp_path / "run.requests.csv") as f:
        assert len(list(csv.DictReader(f))) == 12
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"


def test_failed_requests_are_counted_by_status_and_multi_token_chunks_recorded(flaky_mock, tmp_path):
    out = tmp_path / "flaky.json"
    r = serve("--base-url", flaky_mock.url, "--api-key", "sesame", "--tokenizer", TOKENIZER, "--num-prompts", "9",
              "--random-input-len", "8", "--random-output-len", "8", "--num-warmups", "0", "--save-result", str(out))
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["model_id"] == "mock-model"  # the first model the server lists
    assert res["completed"] == 6 and res["failed"] == 3
    assert res["failed_by_status"] == {"500": 3}
    assert res["errors"].count("injected failure (--fail-every)") == 3
    ok = [c for c, s in zip(res["itl_chunk_tokens"], res["statuses"]) if s == "200"]
    assert ok == [[3, 3, 2]] * 6
    assert res["total_output_tokens"] == 48
    assert "by status: 500: 3" in r.output


def test_chat_multi_turn_sends_later_turns_with_earlier_ones(mock, tmp_path):
    out = tmp_path / "chat.json"
    r = serve("--base-url", mock.url, "--model", "mock-model", "--tokenizer", TOKENIZER, "--endpoint", "chat",
              "--dataset", "multi-turn", "--multi-turn-turns", "3", "--num-prompts", "6",
              "--random-input-len", "16", "--random-output-len", "4", "--request-rate", "inf",
              "--save-result", str(out), "--save-detailed")
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (tmp_path / "chat.requests.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(row["success"] for row in rows)
    for s in (0, 1):
        turns = sorted((row for row in rows if row["session_id"] == s), key=lambda row: row["turn"])
        assert [t["turn"] for t in turns] == [0, 1, 2]
        usage = [t["usage_prompt_tokens"] for t in turns]
        assert usage[0] < usage[1] < usage[2]  # each turn carries the ones before it, answers included
        # turn k is sent only after turn k-1 finished
        for a, b in zip(turns, turns[1:]):
            assert b["actual_send_s"] >= a["actual_send_s"] + a["e2el_ms"] / 1000.0
    res = json.loads(out.read_text())
    assert res["backend"] == "openai-chat"
    # the mock's empty role chunk arrives at once; TTFT is the first content chunk, after 50 ms
    assert min(res["ttfts"]) >= 0.050


def test_shared_prefix_and_sharegpt_datasets_run(mock, tmp_path):
    path = tmp_path / "sg.json"
    conv = [{"conversations": [{"from": "human", "value": f"Tell me about the number {i} in some detail."},
                               {"from": "gpt", "value": "It is a number that comes after the one before it."}]}
            for i in range(5)]
    path.write_text(json.dumps(conv))
    # no --tokenizer: found through the "root" that /v1/models reports
    r = serve("--base-url", mock.url, "--dataset", "sharegpt", "--dataset-path",
              str(path), "--num-prompts", "4", "--save-result", str(tmp_path / "sg-out.json"))
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "sg-out.json").read_text())["completed"] == 4
    r = serve("--base-url", mock.url, "--tokenizer", TOKENIZER, "--dataset", "shared-prefix",
              "--shared-prefix-groups", "2", "--shared-prefix-len", "24", "--shared-prefix-suffix-len", "8",
              "--random-output-len", "2", "--num-prompts", "4", "--save-result", str(tmp_path / "sp.json"))
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "sp.json").read_text())["input_lens"] == [32] * 4


def _bad_cases(tmp_path, url):
    not_json = tmp_path / "bad.json"
    not_json.write_text("{not json")
    no_conv = tmp_path / "noconv.json"
    no_conv.write_text(json.dumps([{"id": 1}]))
    dead = f"http://127.0.0.1:{free_port()}"
    return [
        (["--base-url", dead], f"Error: cannot reach {dead}: connection refused"),
        (["--base-url", url, "--model", "nope"], f"Error: model 'nope' is not served by {url} (served: mock-model)"),
        (["--base-url", url, "--request-rate", "-1"], "Error: --request-rate must be a positive number or inf, got -1"),
        (["--base-url", url, "--num-prompts", "0"], "Error: --num-prompts must be at least 1, got 0"),
        (["--base-url", url, "--max-concurrency", "0"], "Error: --max-concurrency must be at least 1, got 0"),
        (["--base-url", url, "--burstiness", "0"], "Error: --burstiness must be a positive number, got 0"),
        (["--base-url", url, "--dataset", "sharegpt", "--dataset-path", str(not_json)],
         f"Error: malformed dataset file {not_json}: not valid JSON (Expecting property name enclosed in double "
         "quotes: line 1 column 2 (char 1))"),
        (["--base-url", url, "--dataset", "sharegpt", "--dataset-path", str(no_conv)],
         f"Error: malformed dataset file {no_conv}: entry 0 has no 'conversations' list"),
        (["--base-url", url, "--dataset", "sharegpt"], "Error: --dataset sharegpt needs --dataset-path FILE"),
        (["--base-url", url, "--goodput", "ttft:5", "foo:3"],
         "Error: --goodput: expected KEY:MS with KEY in ttft, tpot, e2el, got 'foo:3'"),
        (["--base-url", "localhost:8000"], "Error: --base-url must start with http:// or https://, got 'localhost:8000'"),
        (["--base-url", url, "--random-input-len", "4000", "--random-output-len", "200"],
         "Error: 2 of 2 requests exceed the server's max_model_len 4096 (longest: 4000 prompt + 200 output tokens); "
         "use shorter lengths"),
        (["--base-url", url, "--save-detailed"],
         "Error: --save-detailed needs --save-result PATH (the per-request files go beside it)"),
    ]


def test_bad_input_is_one_line_error_and_sends_no_request(mock, tmp_path):
    before = mock.generation_requests()
    for args, expected in _bad_cases(tmp_path, mock.url):
        r = serve("--tokenizer", TOKENIZER, "--num-prompts", "2", "--random-input-len", "8", *args)
        assert r.exit_code == 1, (args, r.output)
        assert r.output.splitlines() == [expected], args
    assert mock.generation_requests() == before


def test_missing_api_key_is_a_one_line_error(flaky_mock):
    before = flaky_mock.generation_requests()
    for args in ([], ["--api-key", "wrong"]):
        r = serve("--base-url", flaky_mock.url, "--tokenizer", TOKENIZER, "--num-prompts", "2", *args)
        assert r.exit_code == 1
        assert r.output.splitlines() == [
            f"Error: {flaky_mock.url} refused the API key (HTTP 401): pass --api-key or set OPENAI_API_KEY"]
    assert flaky_mock.generation_requests() == before


def test_warmup_requests_are_sent_but_not_measured(mock, tmp_path):
    out = tmp_path / "warm.json"
    before = mock.generation_requests()
    r = serve("--base-url", mock.url, "--tokenizer", TOKENIZER, "--num-prompts", "3", "--num-warmups", "2",
              "--random-input-len", "8", "--random-output-len", "2", "--save-result", str(out))
    assert r.exit_code == 0, r.output
    assert mock.generation_requests() - before == 5
    res = json.loads(out.read_text())
    assert res["completed"] == 3 and len(res["ttfts"]) == 3 and res["num_warmups"] == 2


def test_queue_wait_for_a_concurrency_slot_is_printed_beside_ttft_and_e2el(mock, tmp_path):
    """8 requests at once through one slot: each waits for the ones before it. TTFT and E2EL start at the send
    and hide that wait; the queue-inclusive latencies count it."""
    out = tmp_path / "queued.json"
    r = serve("--base-url", mock.url, "--model", "mock-model", "--tokenizer", TOKENIZER, "--num-prompts", "8",
              "--random-input-len", "8", "--random-output-len", "4", "--request-rate", "inf",
              "--max-concurrency", "1", "--save-result", str(out))
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    # request i waits for the i before it, each at least the mock's 50 ms TTFT + 3 x 10 ms ITL
    assert res["mean_queue_wait_ms"] >= 3.5 * 80.0
    assert res["mean_e2el_incl_queue_ms"] == pytest.approx(res["mean_queue_wait_ms"] + res["mean_e2el_ms"])
    assert res["mean_ttft_incl_queue_ms"] == pytest.approx(res["mean_queue_wait_ms"] + res["mean_ttft_ms"])
    assert res["p99_e2el_incl_queue_ms"] > res["p99_e2el_ms"]
    printed = {line.split(":")[0]: float(line.split()[-1]) for line in r.output.splitlines()
               if "incl. queue" in line or "queue wait" in line}
    assert printed["Mean queue wait (ms)"] == pytest.approx(res["mean_queue_wait_ms"], abs=0.01)
    assert printed["Mean E2EL incl. queue (ms)"] == pytest.approx(res["mean_e2el_incl_queue_ms"], abs=0.01)
    assert printed["P99 TTFT incl. queue (ms)"] == pytest.approx(res["p99_ttft_incl_queue_ms"], abs=0.01)


def test_serve_compare_sends_the_same_requests_to_each_server_in_turns(mock, tmp_path):
    out = tmp_path / "cmp.json"
    before = mock.generation_requests()
    r = CliRunner().invoke(bench, [
        "serve-compare", "--model", "mock-model", "--tokenizer", TOKENIZER, "--server", f"attached={mock.url}",
        "--server", f"standin={sys.executable} {STANDIN} {{port}}", "--dataset", "random", "--num-prompts", "3",
        "--random-input-len", "16", "--random-output-len", "4", "--ignore-eos", "--request-rates", "inf",
        "--disable-tqdm", "--save-result", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    runs = {run["server"]: run["result"] for run in res["runs"]}
    assert runs["attached"]["completed"] == 3 and runs["attached"]["output_lens"] == [4] * 3
    assert mock.generation_requests() - before == 3
    # the attached server's tree is the process listening on its port; 12 tokens from the mock may cost under one
    # clock tick of CPU (0.0), so the tree CPU's size is checked against a busy engine child in test_serve_compare.py
    assert runs["attached"]["server_pid"] == mock.pid and runs["attached"]["server_processes"] >= 1
    cpu = runs["attached"]["server_cpu_s"]
    assert cpu >= 0
    assert runs["attached"]["output_tokens_per_cpu_s"] == (pytest.approx(12 / cpu) if cpu else None)
    # the stand-in answers with one JSON body, not a stream: strict SSE fails its requests, the run goes on
    assert runs["standin"]["failed"] == 3 and runs["standin"]["completed"] == 0
    assert set(runs["standin"]["failed_by_status"]) == {"stream_error"}
    assert "| attached | 1 |" in r.output and "attached: " in r.output and "x attached" in r.output


def test_serve_compare_gives_every_turn_its_own_prompts_and_every_server_the_same(mock, tmp_path, monkeypatch):
    # a server keeps the previous turn's prompts in its prefix cache (pdserve and vLLM both do): a turn that repeated
    # them would skip their prefill; the turns' own datasets come from --seed + 1, + 2, ... and the warm-ups from --seed
    from pdserve.loadtest import serve_compare

    seen = []
    real = serve_compare.measured_turn

    def recording(opts, info, requests, server, rate):
        seen.append((server.name, rate, tuple(r.prompt for r in requests)))
        return real(opts, info, requests, server, rate)

    monkeypatch.setattr(serve_compare, "measured_turn", recording)
    r = CliRunner().invoke(bench, [
        "serve-compare", "--model", "mock-model", "--tokenizer", TOKENIZER, "--server", f"a={mock.url}",
        "--server", f"b={mock.url}", "--dataset", "random", "--num-prompts", "2", "--random-input-len", "16",
        "--random-output-len", "2", "--ignore-eos", "--request-rates", "1000,inf", "--rounds", "2", "--num-warmups", "1",
        "--disable-tqdm"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert [(name, rate) for name, rate, _ in seen] == [(n, x) for _ in range(2) for x in (1000, float("inf"))
                                                          for n in "ab"]
    turns = [prompts for name, _, prompts in seen if name == "a"]
    assert [prompts for name, _, prompts in seen if name == "b"] == turns  # the same requests for every server
    assert len({p for prompts in turns for p in prompts}) == 4 * 2  # no prompt repeats across the four turns
