"""The chart tests' rendering helpers, which live in tests/support/chart_render.py (the e2e Prometheus test uses them
too); this name stays so tests/helm imports them as before."""

from support.chart_render import *  # noqa: F401,F403
from support.chart_render import _LOADER  # noqa: F401
