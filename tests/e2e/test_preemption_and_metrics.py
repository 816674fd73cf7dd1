"""Preemption and the ensemble's counters, through ``pdserve up`` (real redis-server, registry, router, one prefill
and one decode worker) with a decode KV pool small enough that an ``n=8`` request beside a greedy one preempts.

Oracles: the offline ``LLM`` with room to spare (no preemption) for the seeded and greedy texts; for
the counters, what the API returned to the clients: every counter summed over every pod's ``/metrics`` must equal
the sum of the responses' usage and finish reasons, and a preempted request's recompute
never counts as a prefix-cache hit (17.2) nor does one cached token count on two tiers (17.3).
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.loadtest.cluster import Cluster

MODEL = "smollm2-135m-instruct"
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # one fp32 KV block of the default model
POOL_BLOCKS = 32
# top_k keeps a draw away from candidate boundaries that float noise of another batch shape could move
SEEDED = {"n": 8, "seed": 7, "temperature": 0.8, "top_k": 8, "max_tokens": 48, "ignore_eos": True}
GREEDY = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}


@pytest.fixture(scope="module", params=["recompute"])  # swap: verified offline (tests/engine/test_preemption_seeded.py); add it here once its run is timed
def ensemble(request, tmp_path_factory):
    env = {"PDSERVE_KV_CACHE_MEMORY": str(POOL_BLOCKS * BLOCK_BYTES), "PDSERVE_PREEMPTION_MODE": request.param,
           "PDSERVE_ENABLE_PROMPT_TOKENS_DETAILS": "true"}
    with Cluster("--prefill", "1", "--decode", "1", "--dtype", "float32", env=env,
                 log_dir=tmp_path_factory.mktemp(f"up-{request.param}"), process=True) as ens:
        ens.mode = request.param
        yield ens


@pytest.fixture(scope="module")
def offline():
    from pdserve import LLM

    return LLM(MODEL, dtype="float32")


def pod_urls(ens: Cluster) -> list[str]:
    pods = ens.pods("prefill") + ens.pods("decode")
    return [ens.router_url] + [f"http://{p['host']}:{p['http_port']}" for p in pods]


def counters(ens: Cluster) -> Counter:
    """Every counter sample (``*_total``) summed over every pod, keyed by name and its labels other than the pod's."""
    out: Counter = Counter()
    for url in pod_urls(ens):
        text = httpx.get(f"{url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            if family.type != "counter":
                continue
            for s in family.samples:
                if s.name.endswith("_total"):
                    labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("pod", "role", "model_name")))
                    out[(s.name, labels)] += s.value
    return out


def total(c: Counter, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in c.items() if n == name and want <= set(lab))


def post(ens: Cluster, path: str, body: dict) -> dict:
    """One request; a stream is folded into ``{"choices": [{index, text, finish_reason}], "usage"}``."""
    body = {"model": MODEL, **body}
    with httpx.Client(timeout=300) as http:
        if not body.get("stream"):
            r = http.post(f"{ens.router_url}{path}", json=body)
            assert r.status_code == 200, r.text
            return r.json()
        body["stream_options"] = {"include_usage": True}
        choices: dict[int, dict] = {}
        usage = None
        with http.stream("POST", f"{ens.router_url}{path}", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line.removeprefix("data: "))
                assert "error" not in data, data
                usage = data.get("usage") or usage
                for c in data.get("choices") or []:
                    ch = choices.setdefault(c["index"], {"index": c["index"], "text": "", "finish_reason": None})
                    ch["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                    ch["finish_reason"] = c.get("finish_reason") or ch["finish_reason"]
        return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


def texts(resp: dict) -> list[str]:
    return [c.get("text", (c.get("message") or {}).get("content")) for c in sorted(resp["choices"], key=lambda c: c["index"])]


@pytest.mark.slow
def test_seeded_and_greedy_output_survive_preemption(ensemble, offline, prompt_of):
    from pdserve import SamplingParams

    seeded_prompt, greedy_prompt = prompt_of(60), prompt_of(50, offset=40)
    want_seeded = [c.text for c in offline.generate([seeded_prompt], SamplingParams(**SEEDED))[0].outputs]
    want_greedy = offline.generate([greedy_prompt], SamplingParams(**GREEDY))[0].outputs[0].text
    decode = ensemble.pods("decode")[0]
    before = ensemble.stats(decode)
    with ThreadPoolExecutor(2) as pool:
        seeded = pool.submit(post, ensemble, "/v1/completions", {"prompt": seeded_prompt, **SEEDED})
        greedy = pool.submit(post, ensemble, "/v1/completions", {"prompt": greedy_prompt, "stream": True, **GREEDY})
        assert texts(seeded.result()) == want_seeded
        assert texts(greedy.result()) == [want_greedy]
    stats = ensemble.stats(decode)
    assert stats["preemption_mode"] == ensemble.mode
    assert stats["num_preemptions"] > before["num_preemptions"], "the pool was meant to force preemption"
    assert stats["cpu_swap_blocks_used"] == 0 and stats["num_requests_swapped"] == 0  # every swapped block came back
    swapped = stats["kv_blocks_swapped_out"] - before["kv_blocks_swapped_out"]
    assert stats["kv_blocks_swapped_in"] - before["kv_blocks_swapped_in"] == swapped
    assert (swapped > 0) == (ensemble.mode == "swap")
    metrics = httpx.get(f"http://{decode['host']}:{decode['http_port']}/metrics", timeout=10).text
    assert f'preemption_mode="{ensemble.mode}"' in metrics and "pdserve:cache_config_info{" in metrics
    for name in ("pdserve:cpu_swap_blocks_used", "pdserve:cpu_swap_blocks_total", "pdserve:cpu_cache_usage_perc",
                 "pdserve:num_requests_swapped", "pdserve:num_preemptions_total", "pdserve:kv_blocks_swapped_out_total"):
        assert f"\n{name}{{" in metrics, name


@pytest.mark.slow
def test_counters_summed_over_pods_equal_what_clients_got(ensemble, prompt_of):
    shared = prompt_of(64)
    requests = [  # (path, body, n)
        ("/v1/completions", {"prompt": shared + prompt_of(5, offset=80), "max_tokens": 12, "temperature": 0}, 1),
        ("/v1/completions", {"prompt": shared + prompt_of(7, offset=90), "max_tokens": 12, "temperature": 0,
                             "stream": True}, 1),
        ("/v1/completions", {"prompt": prompt_of(40, offset=30), "n": 3, "seed": 1, "temperature": 0.8,
                             "max_tokens": 16, "stream": True}, 3),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                  "max_tokens": 32, "temperature": 0}, 1),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colours."}],
                                  "max_tokens": 6, "temperature": 0, "stream": True}, 1),
    ]
    before = counters(ensemble)
    responses = [post(ensemble, path, body) for path, body, _ in requests[:1]]  # the shared prefix is cached first
    with ThreadPoolExecutor(4) as pool:
        responses += list(pool.map(lambda r: post(ensemble, r[0], r[1]), requests[1:]))
    after = counters(ensemble)
    d = after - before

    prompt = sum(r["usage"]["prompt_tokens"] for r in responses)
    completion = sum(r["usage"]["completion_tokens"] for r in responses)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses)
    reasons = Counter(c["finish_reason"] for r in responses for c in r["choices"])
    choice_prompt = sum(n * r["usage"]["prompt_tokens"] for (_, _, n), r in zip(requests, responses))
    assert cached >= 64 and reasons["stop"] >= 1 and reasons["length"] >= 1

    # client-side usage: counted by the router alone, so the ensemble-wide sum is the API's sum
    assert total(d, "pdserve:prompt_tokens_total") == prompt
    assert total(d, "pdserve:generation_tokens_total") == completion
    assert total(d, "pdserve:prompt_tokens_cached_total") == cached
    for reason, count in reasons.items():
        assert total(d, "pdserve:request_success_total", finished_reason=reason) == count, reason
    assert total(d, "pdserve:request_success_total") == sum(reasons.values())
    # engine work, counted where it happens: every token sampled once (the prefill pod samples the first)
    assert total(d, "pdserve:sampled_tokens_total") == completion
    # every choice's prompt was looked up once, and each token was either found or computed (a recompute after
    # preemption counts under prefix_cache_preempted_* / prompt_tokens_recomputed, never here)
    queries, hits = total(d, "pdserve:prefix_cache_queries_total"), total(d, "pdserve:prefix_cache_hits_total")
    assert queries == choice_prompt
    assert hits + total(d, "pdserve:prompt_tokens_computed_total") == queries
    assert hits >= cached  # the n=3 request's later choices hit the first one's blocks, which usage does not show
    # KV transfer: each block counted once by the sender and once, under another name, by the receiver
    assert total(d, "pdserve:kv_transfer_sent_blocks_total") == total(d, "pdserve:kv_transfer_received_blocks_total")


# ---- the chart's dashboard and alerts, evaluated by a real Prometheus scraping this ensemble (docs/runbooks.md) ----

def _prometheus(ens: Cluster, rules_path, tmp_path):
    """A real Prometheus (Debian's package; CI installs it) scraping router, registry and pods every second, with the
    chart's rules loaded; job names as the chart's ServiceMonitor gives them (``<fullname>-<tier>``)."""
    import os
    import shutil
    import subprocess

    import yaml

    from support.observability import FULL
    from support.redis_server import free_port

    binary = shutil.which("prometheus")
    if binary is None and not os.environ.get("CI"):  # CI installs it (.ci/run): there a missing binary fails
        pytest.skip("prometheus not installed (apt-get install prometheus; CI installs it)")
    jobs = {"router": [ens.router_url], "registry": [ens.registry_url],
            **{role: [f"http://{p['host']}:{p['http_port']}" for p in ens.pods(role)] for role in ("prefill", "decode")}}
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(rules_path)],
              "scrape_configs": [{"job_name": f"{FULL}-{tier}", "static_configs": [
                  {"targets": [u.removeprefix("http://") for u in urls]}]} for tier, urls in jobs.items()]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    return proc, f"http://127.0.0.1:{port}", sum(len(u) for u in jobs.values())


def _query(url: str, expr: str) -> list:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


@pytest.mark.slow
def test_a_real_prometheus_evaluates_every_dashboard_query_and_rule(ensemble, prompt_of, tmp_path):
    import time

    import yaml

    from support.chart_render import helm
    from support.chart_render import CHART
    from support.observability import dashboard_queries, render_observability, rule_file, rules

    with helm.Chart.load(CHART) as chart:
        dashboards, prometheus_rule = render_observability(chart)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_file(prometheus_rule)))
    proc, url, num_targets = _prometheus(ensemble, tmp_path / "rules.yaml", tmp_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if len([s for s in _query(url, "up") if s["value"][1] == "1"]) == num_targets:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"Prometheus never scraped all {num_targets} targets: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
        # a short load while it scrapes: a prompt long enough for the P/D hand-over, streamed (TTFT, ITL, TPOT)
        for offset in (0, 100):
            post(ensemble, "/v1/completions", {"prompt": prompt_of(120, offset=offset), "max_tokens": 8,
                                               "temperature": 0, "stream": True})
        time.sleep(3)  # three more scrapes and rule evaluations
        empty = [(title, expr) for title, expr in dashboard_queries(dashboards) if not _query(url, expr)]
        empty += [(r["record"], r["expr"]) for r in rules(prometheus_rule, "record") if not _query(url, r["expr"])]
        assert not empty, f"queries that returned no series: {empty}"
        for alert in rules(prometheus_rule, "alert"):
            _query(url, alert["expr"])  # evaluates (a healthy ensemble fires none: see below)
        groups = httpx.get(f"{url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        evaluated = [r for g in groups for r in g["rules"]]
        assert len(evaluated) == len(rules(prometheus_rule, "record")) + len(rules(prometheus_rule, "alert"))
        assert all(r["health"] == "ok" for r in evaluated), [(r["name"], r.get("lastError")) for r in evaluated]
        firing = [r["name"] for r in evaluated if r.get("state") == "firing"]
        assert not firing, firing
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_every_name_a_running_ensemble_exports_is_documented(ensemble):
    # the docs are generated from the declaration tables (tests/test_metric_docs.py); this checks the tables are
    # what the processes really export: a metric made outside a table would show up here undocumented
    from pdserve.services import metric_docs

    # a family's samples: the name itself, or it (a counter: less "_total") with a histogram's or counter's suffix
    forms = {name.removesuffix("_total") if kind else name for name in metric_docs.exposed_names()
             for kind in (False, True)}
    documented = forms | {f + suffix for f in forms for suffix in ("_bucket", "_sum", "_count", "_created")}
    scraped = {sample.name for url in pod_urls(ensemble)
               for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
               for sample in family.samples if sample.name.startswith("pdserve:")}
    assert scraped and scraped <= documented, sorted(scraped - documented)
