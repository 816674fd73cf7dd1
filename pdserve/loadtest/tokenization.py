"""Tokenizers for building prompts of exact token lengths.

Prompts are made from the model's own tokenizer (``transformers``); their length is then checked and
corrected with the server's ``POST /tokenize`` (vLLM's and pdserve's router: body ``{"model",
"prompt"}`` -> ``{"tokens", "count", "max_model_len"}``) when the server has one, because decoding
random token ids and encoding the text again rarely gives back the same count, and only the server
knows what it will add (BOS and the like).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from pdserve.loadtest.errors import LoadTestError

Counter = Callable[[str], Awaitable[int]]


class FastTokenizer:
    """The few calls the suite needs, on the ``tokenizers`` library alone (loads in milliseconds;
    importing ``transformers`` takes seconds). Same method names as a HF tokenizer."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.all_special_ids = sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


def _load_local(name_or_path: str):
    path = name_or_path
    try:
        from pdserve.shared.models.resolve import resolve_model

        path = str(resolve_model(name_or_path))
    except (ImportError, FileNotFoundError):
        pass
    if (Path(path) / "tokenizer.json").is_file():
        return FastTokenizer(Path(path) / "tokenizer.json")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@lru_cache(maxsize=8)
def load_tokenizer(*candidates: str):
    """A tokenizer for the first candidate that has one: a pdserve model name, a local model directory,
    or a hub id (the local Hugging Face cache first, then the hub for the first candidate).

    A directory with ``tokenizer.json`` is read with ``tokenizers`` directly; anything else goes through
    ``transformers.AutoTokenizer``. Raises :class:`LoadTestError` when none can be loaded.
    """
    names = [c for c in dict.fromkeys(candidates) if c]
    for name in names:
        try:
            return _load_local(name)
        except Exception:  # transformers raises OSError/ValueError/HF errors for a missing tokenizer
            continue
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(names[0])
    except Exception as exc:
        raise LoadTestError(
            f"cannot load a tokenizer for {' or '.join(map(repr, names))} ({type(exc).__name__}); "
            "pass --tokenizer DIR"
        ) from None


def local_counter(tokenizer) -> Counter:
    async def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return count


def server_counter(session, base_url: str, model: str) -> Counter:
    """Counts tokens with the server's ``/tokenize`` (an ``aiohttp.ClientSession``)."""
    url = base_url.rstrip("/") + "/tokenize"

    async def count(text: str) -> int:
        async with session.post(url, json={"model": model, "prompt": text}) as resp:
            resp.raise_for_status()
            data = await resp.json()
        return int(data["count"]) if "count" in data else len(data["tokens"])

    return count


def sampling_vocab(tokenizer) -> np.ndarray:
    """Token ids safe to sample: the whole vocabulary minus special tokens."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


@dataclass(slots=True)
class PromptMaker:
    """Makes random-token prompts whose length, as ``count`` measures it, is exactly the target."""

    tokenizer: object
    count: Counter
    vocab: np.ndarray
    max_rounds: int = 12

    def decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)  # type: ignore[attr-defined]

    async def make(self, rng: np.random.Generator, target: int, prefix: str = "") -> tuple[str, int]:
        """Text ``prefix + suffix`` whose count is ``target`` (best effort after ``max_rounds``), and that count."""
        base = await self.count(prefix) if prefix else 0
        ids = rng.choice(self.vocab, size=max(target - base, 0))
        text = prefix + self.decode(ids)
        n = await self.count(text)
        for _ in range(self.max_rounds):
            if n == target:
                break
            if n > target:
                ids = ids[: max(len(ids) - (n - target), 0)]
            else:
                ids = np.concatenate([ids, rng.choice(self.vocab, size=target - n)])
            text = prefix + self.decode(ids)
            n = await self.count(text)
        return text, n


async def gather_limited(coros, limit: int = 16):
    """``asyncio.gather`` with at most ``limit`` coroutines running (keeps /tokenize traffic polite)."""
    sem = asyncio.Semaphore(limit)

    async def run(c):
        async with sem:
            return await c

    return await asyncio.gather(*(run(c) for c in coros))
