"""The click options ``bench serve`` and ``bench sweep`` share, and their parsing into :class:`BenchOptions`."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import click

from pdserve.loadtest.benchmark import BenchOptions
from pdserve.loadtest.client import ENDPOINTS, ClientConfig
from pdserve.loadtest.datasets import DATASETS, DatasetSpec
from pdserve.loadtest.errors import LoadTestError
from pdserve.loadtest.metrics import SLO_KEYS
from pdserve.loadtest.runner import RunConfig

GREEDY = ("--goodput", "--slo")


class GreedyCommand(click.Command):
    """Lets ``--goodput ttft:500 tpot:50`` take several values, as vLLM's argparse ``nargs='+'`` does."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        out: list[str] = []
        opt: str | None = None
        needs_value = False
        for a in args:
            name = a.split("=", 1)[0]
            if name in GREEDY:
                opt, needs_value = name, "=" not in a
                out.append(a)
            elif opt and not a.startswith("-"):
                out.extend([a] if needs_value else [opt, a])
                needs_value = False
            else:
                opt = None
                out.append(a)
        return super().parse_args(ctx, out)


def parse_slos(values: tuple[str, ...], flag: str = "--goodput") -> dict[str, float]:
    """``("ttft:500", "tpot:50,e2el:2000")`` -> ``{"ttft": 500.0, ...}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in [p for v in values for p in v.replace(",", " ").split()]:
        key, sep, ms = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise LoadTestError(f"{flag}: expected KEY:MS with KEY in {', '.join(SLO_KEYS)}, got {item!r}")
        try:
            value = float(ms)
        except ValueError:
            raise LoadTestError(f"{flag}: {key} must be a number of milliseconds, got {ms!r}") from None
        if not value > 0 or math.isinf(value):
            raise LoadTestError(f"{flag}: {key} must be a positive number of milliseconds, got {ms}")
        slos[key] = value
    return slos


def parse_floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise LoadTestError(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def common_options(f: Callable) -> Callable:
    opts = [
        click.option("--base-url", default="http://127.0.0.1:8000", show_default=True,
                     help="Server root (without /v1)."),
        click.option("--model", default=None, help="Model id; default: the first one in GET /v1/models."),
        click.option("--tokenizer", default=None, help="Tokenizer (pdserve model name, HF dir); default: --model."),
        click.option("--endpoint", type=click.Choice(sorted(ENDPOINTS)), default="completions", show_default=True,
                     help="completions = /v1/completions, chat = /v1/chat/completions."),
        click.option("--api-key", envvar="OPENAI_API_KEY", default=None, help="Bearer token (env OPENAI_API_KEY)."),
        click.option("--dataset", "dataset_name", type=click.Choice(DATASETS), default="random", show_default=True),
        click.option("--dataset-path", default=None, help="ShareGPT-format JSON file for --dataset sharegpt."),
        click.option("--num-prompts", type=int, default=1000, show_default=True,
                     help="Requests to send (turns, for multi-turn)."),
        click.option("--burstiness", type=float, default=1.0, show_default=True,
                     help="Gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier, >1 steadier."),
        click.option("--max-concurrency", type=int, default=None, help="Cap on requests in flight."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--num-warmups", type=int, default=0, show_default=True,
                     help="Requests sent and discarded before the measured run."),
        click.option("--random-input-len", type=int, default=1024, show_default=True),
        click.option("--random-output-len", type=int, default=128, show_default=True),
        click.option("--random-range-ratio", type=float, default=0.0, show_default=True,
                     help="Lengths uniform in [len*(1-r), len*(1+r)]."),
        click.option("--random-prefix-len", type=int, default=0, show_default=True,
                     help="Tokens of one prefix shared by every random prompt."),
        click.option("--shared-prefix-groups", type=int, default=8, show_default=True),
        click.option("--shared-prefix-len", type=int, default=512, show_default=True),
        click.option("--shared-prefix-suffix-len", type=int, default=128, show_default=True),
        click.option("--multi-turn-turns", type=int, default=4, show_default=True, help="Turns per session."),
        click.option("--sharegpt-output-len", type=int, default=None,
                     help="Fixed output budget instead of each reference answer's length."),
        click.option("--goodput", multiple=True,
                     help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 [e2el:MS] (milliseconds)."),
        click.option("--percentile-metrics", default="ttft,tpot,itl,e2el", show_default=True),
        click.option("--metric-percentiles", default="99", show_default=True,
                     help="Comma-separated percentiles, e.g. 50,90,99."),
        click.option("--temperature", type=float, default=0.0, show_default=True),
        click.option("--ignore-eos", is_flag=True, help="Send ignore_eos so every request decodes its full budget."),
        click.option("--continuous-usage-stats/--no-continuous-usage-stats", default=True, show_default=True,
                     help="Ask for a running token count per chunk (servers that reject the field: turn off)."),
        click.option("--extra-body", default=None, help="JSON object merged into every request body."),
        click.option("--request-timeout", type=float, default=600.0, show_default=True,
                     help="Seconds without data before a request counts as failed (timeout)."),
        click.option("--server-tokenize/--no-server-tokenize", default=True, show_default=True,
                     help="Align prompt lengths with the server's POST /tokenize when it has one."),
        click.option("--lag-warning-ms", type=float, default=10.0, show_default=True,
                     help="Warn when p99 client send lag exceeds this."),
        click.option("--label", default=None, help="Free-text label stored in the result."),
        click.option("--disable-tqdm", is_flag=True, help="No live progress bar."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def to_options(kw: dict, request_rate: float) -> BenchOptions:
    """Turn the parsed click values into :class:`BenchOptions` (raises :class:`LoadTestError`)."""
    extra = {}
    if kw["extra_body"]:
        try:
            extra = json.loads(kw["extra_body"])
        except ValueError:
            raise LoadTestError("--extra-body must be a JSON object") from None
        if not isinstance(extra, dict):
            raise LoadTestError("--extra-body must be a JSON object")
    client = ClientConfig(
        base_url=kw["base_url"], model=kw["model"] or "", endpoint=kw["endpoint"], api_key=kw["api_key"],
        temperature=kw["temperature"], ignore_eos=kw["ignore_eos"],
        continuous_usage_stats=kw["continuous_usage_stats"], request_timeout_s=kw["request_timeout"],
        extra_body=extra,
    )
    run = RunConfig(request_rate=request_rate, burstiness=kw["burstiness"], max_concurrency=kw["max_concurrency"],
                    seed=kw["seed"], show_progress=not kw["disable_tqdm"], num_warmups=kw["num_warmups"])
    dataset = DatasetSpec(
        name=kw["dataset_name"], num_prompts=kw["num_prompts"], seed=kw["seed"],
        input_len=kw["random_input_len"], output_len=kw["random_output_len"], range_ratio=kw["random_range_ratio"],
        prefix_len=kw["shared_prefix_len"] if kw["dataset_name"] == "shared-prefix" else kw["random_prefix_len"],
        num_groups=kw["shared_prefix_groups"], suffix_len=kw["shared_prefix_suffix_len"],
        turns=kw["multi_turn_turns"], path=kw["dataset_path"], sharegpt_output_len=kw["sharegpt_output_len"],
    )
    metrics = tuple(m.strip() for m in kw["percentile_metrics"].split(",") if m.strip())
    return BenchOptions(
        client=client, run=run, dataset=dataset, tokenizer=kw["tokenizer"], percentile_metrics=metrics,
        percentiles=parse_floats(kw["metric_percentiles"], "--metric-percentiles"),
        goodput_slos_ms=parse_slos(kw["goodput"]), lag_warning_ms=kw["lag_warning_ms"], label=kw["label"],
        use_server_tokenize=kw["server_tokenize"],
    )
