"""Datasets made offline with fixed seeds: random tokens, shared-prefix, multi-turn, ShareGPT files."""

from __future__ import annotations

from pdserve.loadtest.datasets.spec import DATASETS, DatasetSpec, build_dataset

__all__ = ["DATASETS", "DatasetSpec", "build_dataset"]
