"""N-gram (prompt lookup) proposer: continue the most recent earlier match of the sequence's own suffix.

Prompt lookup decoding (Saxena 2023; vLLM's ``NgramProposer``): for n from ``prompt_lookup_max`` down to
``prompt_lookup_min``, look for an earlier occurrence of the last n tokens in the request's tokens (prompt
and output); the first n that matches wins (the longest), and its most recent occurrence proposes the up to
k tokens that followed it. No match: no proposal (the request decodes plainly this step).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        assert 1 <= prompt_lookup_min <= prompt_lookup_max
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens following the longest suffix n-gram's latest earlier match ([] if none)."""
        total = len(token_ids)
        if k <= 0 or total < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = tokens[total - n:]
            # windows starting at 0..total-n-1: every n-gram that ends before the suffix's last token
            windows = sliding_window_view(tokens[:total - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start:start + k]
        return []
