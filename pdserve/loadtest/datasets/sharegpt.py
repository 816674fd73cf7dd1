"""ShareGPT-format conversation files (the format vLLM's ``--dataset-name sharegpt`` reads).

The file is a JSON list of ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
"value": ...}, ...]}``. Each entry's first two turns give a prompt and a reference completion whose
token count becomes the output budget (or ``--sharegpt-output-len``). Pairs are filtered as vLLM does
(prompt or completion under 4 tokens, prompt over 1024, both over 2048 are dropped) and sampled with the
seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pdserve.loadtest.errors import LoadTestError
from pdserve.loadtest.request import SampleRequest
from pdserve.loadtest.tokenization import PromptMaker


def load_pairs(path: str | None) -> list[tuple[str, str]]:
    """(prompt, completion) pairs of a ShareGPT file; :class:`LoadTestError` names what is wrong."""
    if not path:
        raise LoadTestError("--dataset sharegpt needs --dataset-path FILE")
    p = Path(path)
    if not p.is_file():
        raise LoadTestError(f"dataset file not found: {path}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise LoadTestError(f"malformed dataset file {path}: not valid JSON ({exc})") from None
    if not isinstance(data, list):
        raise LoadTestError(f"malformed dataset file {path}: expected a JSON list of conversations")
    pairs = []
    for i, entry in enumerate(data):
        conv = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(conv, list):
            raise LoadTestError(f"malformed dataset file {path}: entry {i} has no 'conversations' list")
        if len(conv) < 2:
            continue
        try:
            prompt, completion = str(conv[0]["value"]), str(conv[1]["value"])
        except (TypeError, KeyError):
            raise LoadTestError(f"malformed dataset file {path}: entry {i} has a turn without 'value'") from None
        pairs.append((prompt, completion))
    if not pairs:
        raise LoadTestError(f"dataset file {path} has no conversation with two turns")
    return pairs


async def build(spec, maker: PromptMaker) -> list[SampleRequest]:
    pairs = load_pairs(spec.path)
    order = np.random.default_rng([spec.seed, 30]).permutation(len(pairs))
    tok = maker.tokenizer
    out: list[SampleRequest] = []
    for j in order:
        prompt, completion = pairs[j]
        plen = len(tok.encode(prompt, add_special_tokens=False))  # type: ignore[attr-defined]
        olen = spec.sharegpt_output_len or len(tok.encode(completion, add_special_tokens=False))  # type: ignore[attr-defined]
        if plen < 4 or (spec.sharegpt_output_len is None and olen < 4) or plen > 1024 or plen + olen > 2048:
            continue
        out.append(SampleRequest(prompt=prompt, prompt_len=plen, expected_output_len=olen, label=spec.label))
        if len(out) == spec.num_prompts:
            break
    if len(out) < spec.num_prompts:
        raise LoadTestError(
            f"dataset file {spec.path} has only {len(out)} usable conversations, --num-prompts is {spec.num_prompts}"
        )
    return out
