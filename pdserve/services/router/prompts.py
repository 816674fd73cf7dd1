"""Prompts to token ids: the model's chat template and tokenizer (HF ``transformers``, loaded as
``AutoTokenizer`` would load it but without torch where possible: tokenizer_loader.py), plus token strings.

The chat path renders the template to text (``add_generation_prompt=True`` by default) and tokenizes it without
adding special tokens again, as vLLM does; the result equals ``tokenizer.apply_chat_template(...,
tokenize=True)``. Errors are 400s naming the request field.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from .errors import bad_request
from .schemas import ChatMessage
from .tokenizer_loader import load_tokenizer


def _message_text(message: ChatMessage, index: int) -> str | None:
    if message.content is None or isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages[{index}]: content part of type {part.type!r} is not supported "
                              "(only 'text')", "messages")
        texts.append(part.text)
    # vLLM's "string" content format joins text parts with newlines.
    return "\n".join(texts)


def _template_call(call: Any, index: int) -> dict[str, Any]:
    """An assistant message's tool call as templates read it: ``arguments`` decoded to an object (vLLM does the
    same; HF templates iterate or ``tojson`` it)."""
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as exc:
        raise bad_request(f"messages[{index}]: tool_calls arguments are not valid JSON: {exc}", "messages") from exc
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def read_chat_template(path: str | None) -> str | None:
    """The text of ``--chat-template``'s file (None: the model's own template)."""
    return Path(path).read_text() if path else None


def prompt_count(prompt: Any) -> int:
    """How many prompts a completions ``prompt`` holds: 1 for a string or one list of token ids, else the list's
    length (counted before tokenizing, so an oversized list is refused cheaply)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


class PromptProcessor:
    """Chat template, tokenization and detokenization for one model.

    ``max_model_len`` is the context length the router enforces: the given value or the model config's
    ``max_position_embeddings``.
    """

    def __init__(self, model_dir: Path, max_model_len: int | None = None, chat_template: str | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.chat_template = chat_template  # Jinja text used instead of the model's (--chat-template)
        self.tokenizer = load_tokenizer(self.model_dir)  # AutoTokenizer's tokenizer, without torch where it can
        config = json.loads((self.model_dir / "config.json").read_text())
        model_max = config.get("max_position_embeddings") or config.get("max_seq_len") or 2048
        self.max_model_len = int(max_model_len or model_max)
        self.vocab_size = max(len(self.tokenizer), int(config.get("vocab_size") or 0))
        self._token_str = functools.lru_cache(maxsize=65536)(self._render_one)
        self.token_bytes = functools.lru_cache(maxsize=65536)(self._bytes_one)
        self._byte_decoder = _byte_level_decoder(self.tokenizer)
        self._added = {int(i) for i in self.tokenizer.added_tokens_decoder}

    # ---- chat ----------------------------------------------------------------------------

    def conversation(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        if not messages:
            raise bad_request("messages must contain at least one message", "messages")
        out = []
        for i, m in enumerate(messages):
            item: dict[str, Any] = {"role": m.role, "content": _message_text(m, i) or ""}
            if m.name:
                item["name"] = m.name
            if m.tool_calls:
                item["tool_calls"] = [_template_call(call, i) for call in m.tool_calls]
            if m.tool_call_id is not None:
                item["tool_call_id"] = m.tool_call_id
            out.append(item)
        return out

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> str:
        conversation = self.conversation(messages)
        if continue_final_message and conversation[-1]["role"] != "assistant":
            raise bad_request("continue_final_message requires the last message to be from the assistant",
                              "continue_final_message")
        try:
            return self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools or None,
                chat_template=self.chat_template, **(chat_template_kwargs or {}))
        except Exception as exc:  # jinja raises TemplateError and friends for conversations it refuses
            raise bad_request(f"The chat template could not render these messages: {exc}", "messages") from exc

    def chat_token_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       chat_template_kwargs: dict[str, Any] | None = None,
                       add_special_tokens: bool = False,
                       tools: list[dict[str, Any]] | None = None) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, continue_final_message, chat_template_kwargs,
                                tools)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # ---- completions -----------------------------------------------------------------------

    def prompt_token_ids(self, prompt: Any, add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids for each prompt of a completions request (string, strings, ids, or lists of ids)."""
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        elif isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        out = []
        for p in prompts:
            if isinstance(p, str):
                ids = self.tokenizer.encode(p, add_special_tokens=add_special_tokens)
            else:
                ids = list(p)
                self.check_token_ids(ids, "prompt")
            if not ids:
                raise bad_request("prompt must not be empty", "prompt")
            out.append(ids)
        return out

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"Token id {bad[0]} is out of vocabulary (size {self.vocab_size})", param)

    # ---- output -----------------------------------------------------------------------------

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _bytes_one(self, token_id: int) -> bytes:
        """The token's own bytes, from the tokenizer's byte mapping (GPT-2 byte-level pieces, or sentencepiece's
        ``<0xNN>`` byte-fallback pieces); the output text's bytes are these bytes joined."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._added:  # added and special tokens are literal text
            return piece.encode("utf-8")
        if self._byte_decoder is not None:
            try:
                return bytes(self._byte_decoder[ch] for ch in piece)
            except KeyError:
                pass
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        if "\u2581" in piece:  # sentencepiece's word boundary
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def _render_one(self, token_id: int) -> str:
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:  # part of a character: OpenAI's and vLLM's "bytes:\xNN" form
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def token_str(self, token_id: int) -> str:
        """The text of one token as OpenAI's logprobs show it: its text, or ``bytes:\\xf0\\x9f`` (backslash escapes)
        for a token that is only part of a UTF-8 character."""
        return self._token_str(token_id)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder(tokenizer) -> dict[str, int] | None:
    """Piece character -> byte for a byte-level BPE tokenizer (GPT-2's table, which the ``tokenizers``
    ByteLevel decoder uses); None for other tokenizers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or "ByteLevel" not in json.dumps(json.loads(backend.to_str()).get("decoder")):
        return None
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:  # older transformers
        from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
    return {ch: b for b, ch in bytes_to_unicode().items()}
