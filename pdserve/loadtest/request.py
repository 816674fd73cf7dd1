"""A request the benchmark will send, made offline by a dataset."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SampleRequest:
    """One prompt and its output budget.

    ``prompt`` is the text for ``/v1/completions`` (and the user message for chat). Multi-turn
    requests carry ``session_id``/``turn``: the runner sends turn k only after turn k-1 finished and
    prepends that session's earlier turns, answers included. ``label`` groups requests in reports
    (for example ``short``/``long``).
    """

    prompt: str
    prompt_len: int
    expected_output_len: int
    label: str = ""
    session_id: int | None = None
    turn: int | None = None
