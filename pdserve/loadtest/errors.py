"""The one error type the load-test suite raises for bad input, turned into a one-line CLI error."""

from __future__ import annotations


class LoadTestError(Exception):
    """Bad input found before any load is sent: the message is one line naming what to fix."""
