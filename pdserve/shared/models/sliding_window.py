"""Which layers attend over a sliding window, and how wide: transformers' rules, read from a model's config.

Source: transformers 5's configs and masks. Mistral sets ``sliding_window`` for every layer; Qwen2 and Qwen3 set
``layer_types`` (``"sliding_attention"`` from layer ``max_window_layers`` on, when ``use_sliding_window``); a layer
with window ``W`` lets query position ``q`` see key position ``k`` when ``q - W < k <= q``
(``masking_utils.sliding_window_overlay``).
"""

from __future__ import annotations


def layer_sliding_windows(config) -> list[int | None]:
    """Per layer (``config.num_hidden_layers`` entries): its window in tokens, or None for full attention."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * n
    if getattr(config, "use_sliding_window", True) is False:
        return [None] * n
    types = getattr(config, "layer_types", None)
    if types is None:
        return [int(window)] * n
    return [int(window) if t == "sliding_attention" else None for t in types]


def block_freeing_window(config, engine_config=None) -> int | None:
    """The window past which a request's KV blocks may be freed: the widest layer window when every layer has
    one (Mistral), else None (a full-attention layer reads every position, so no block may go). None too with a
    draft model (``speculative_config.method == "draft_model"``): its own KV shares the target's block tables
    and may attend over every position."""
    spec = getattr(engine_config, "speculative_config", None)
    if spec is not None and getattr(spec, "method", None) == "draft_model":
        return None
    windows = layer_sliding_windows(config)
    return max(windows) if windows and all(windows) else None
