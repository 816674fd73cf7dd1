"""Fixtures for the chart tests: the loaded chart, and its rendering for each shipped values file."""

from __future__ import annotations

from typing import Any

import pytest

from chart_render import CHART, VALUES_FILES, helm, load_values, render_docs


@pytest.fixture(scope="session")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


@pytest.fixture(scope="session", params=list(VALUES_FILES))
def rendered(request, chart) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render_docs(chart, load_values(request.param))
