"""Prometheus metrics declared once: each service lists its metrics as a table of ``Metric`` rows, builds them from
that table, and ``docs/metrics.md`` "Every metric" is generated from the same tables
(``python -m pdserve.services.metric_docs``; ``tests/test_metric_docs.py`` checks the page is current).

Adding a metric is one row; a worker metric that follows an ``EngineStats`` field names it in ``stat`` and is
updated from every stats snapshot with no further code.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric. ``name`` is the family name (a counter is exposed with ``_total`` added); ``labels`` are the
    labels beyond the service's base labels (or all of them when ``base`` is False); ``stat`` the ``EngineStats``
    field a worker gauge is set to, or a worker counter advances with; ``roles`` the worker roles that export it
    (None: every role); ``buckets`` a histogram's upper bounds in seconds."""

    attr: str
    kind: str
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    base: bool = True
    buckets: tuple[float, ...] | None = None
    stat: str | None = None
    roles: tuple[str, ...] | None = None

    @property
    def exposed_name(self) -> str:
        """The name a scrape shows: counters end in ``_total``."""
        return self.name + "_total" if self.kind == "counter" and not self.name.endswith("_total") else self.name

    def label_names(self, base_labels: Iterable[str]) -> list[str]:
        return [*(base_labels if self.base else ()), *self.labels]


def build(table: Iterable[Metric], registry: CollectorRegistry, base_labels: dict[str, str] | None = None,
          role: str | None = None) -> dict[str, object]:
    """The table's metrics for ``role``, registered in ``registry``, by ``attr``. A row with only the base labels is
    returned bound to ``base_labels`` (ready to ``inc``/``set``/``observe``); any other row unbound.

    Raises ValueError on a row of unknown ``kind``; prometheus_client raises on a duplicate name."""
    base_labels = base_labels or {}
    out: dict[str, object] = {}
    for row in table:
        if row.roles is not None and role not in row.roles:
            continue
        if row.kind not in KINDS:
            raise ValueError(f"metric {row.name}: kind must be one of {sorted(KINDS)}, not {row.kind!r}")
        kwargs = {"buckets": row.buckets} if row.buckets is not None else {}
        metric = KINDS[row.kind](row.name, row.doc, row.label_names(base_labels), registry=registry, **kwargs)
        bound = row.base and base_labels and not row.labels
        out[row.attr] = metric.labels(**base_labels) if bound else metric
    return out


def markdown_rows(tables: dict[str, Iterable[Metric]], base_labels: dict[str, tuple[str, ...]]) -> list[str]:
    """One markdown table row per exposed name: name, type, and per service that exports it, its labels and help
    text. ``tables`` maps a service name to its table; ``base_labels`` a service name to its base labels."""
    seen: dict[str, tuple[str, list[str]]] = {}
    for service, table in tables.items():
        for row in table:
            kind, where = seen.setdefault(row.exposed_name, (row.kind, []))
            roles = f" ({', '.join(row.roles)})" if row.roles else ""
            labels = ",".join(row.label_names(base_labels.get(service, ())))
            where.append(f"{service}{roles} `{{{labels}}}`: {row.doc}" if labels else f"{service}{roles}: {row.doc}")
    return [f"| `{name}` | {kind} | {'; '.join(where)} |" for name, (kind, where) in sorted(seen.items())]
