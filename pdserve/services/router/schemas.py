"""Request bodies shaped like OpenAI's and vLLM's (fields, types, ranges).

Types and single-field ranges are checked here by pydantic (FastAPI turns failures into a 400 naming the
field); rules that involve several fields or the tokenizer live in ``params.py``. Unknown fields are
accepted and ignored, as vLLM does, so clients that send newer OpenAI fields keep working; known fields that
would change the output and that pdserve does not implement (``best_of``, ``tools``, ...)
are declared here and refused in ``params.check_cross_field``. Every string must be valid Unicode.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator
from pydantic_core import PydanticCustomError

# vLLM's default --max-logprobs.
MAX_LOGPROBS = 20
MAX_N = 128
_INT64 = 2**63 - 1

# Client-chosen request ids end up in Redis key names and logs.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"

TokenId = Annotated[int, Field(ge=0)]


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a string anywhere in ``value`` (keys included) is not valid Unicode text.

    JSON's ``\\ud800`` escapes decode to lone UTF-16 surrogates, which cannot be encoded as UTF-8: the
    tokenizer, msgpack and the response encoder all fail on them (a 500) unless they are refused here.
    """
    stack = [value]  # iterative: a deeply nested body must not exhaust the interpreter's recursion limit
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # Before field validation, so the error names the top-level field whatever its type.
        # ``errors.describe_validation_error`` reads ``param`` from the context (the location is the body).
        if isinstance(data, dict):
            for key, value in data.items():
                if _has_lone_surrogate(key) or _has_lone_surrogate(value):
                    param = key if not _has_lone_surrogate(key) else None
                    raise PydanticCustomError(
                        "invalid_unicode",
                        "Invalid value for '{param}': a string contains a lone UTF-16 surrogate, which is not "
                        "valid Unicode (UTF-8) text" if param else
                        "A field name contains a lone UTF-16 surrogate, which is not valid Unicode (UTF-8) text",
                        {"param": param})
        return data


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to one of them


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]  # OpenAI's rule
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: StrictBool | None = None


class ChatCompletionTool(BaseModel):
    """One entry of ``tools`` (OpenAI's ``ChatCompletionToolParam``): only functions."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class _SamplingFields(_Body):
    """Sampling fields common to both endpoints (OpenAI + vLLM extensions). ``model`` is required, as OpenAI
    requires it (vLLM defaults it to the served model; a missing one here is a 400 naming ``model``)."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Annotated[int, Field(ge=-_INT64 - 1, le=_INT64)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    ignore_eos: StrictBool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    request_id: Annotated[str, Field(pattern=REQUEST_ID_PATTERN)] | None = None
    # Logits processors (``params.build_sampling_params`` checks them against the vocabulary). OpenAI's
    # logit_bias is a JSON object, so its token ids arrive as string keys.
    logit_bias: dict[str, Any] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[StrictStr] | None = None
    # Declared so it is refused (``params.check_cross_field``) rather than ignored: it changes the output.
    best_of: Annotated[int, Field(ge=1)] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: StrictBool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # tool_calls.py: tool_choice none | auto | required | {"type": "function", "function": {"name"}}
    tools: list[ChatCompletionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = True
    functions: list[dict[str, Any]] | None = None  # OpenAI's deprecated form of tools
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's: prepend the last message's content to the answer when that message's role is the answer's
    echo: StrictBool = False
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


Prompt = Union[StrictStr, list[StrictStr], list[TokenId], list[list[TokenId]]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: str | None = None
    add_special_tokens: StrictBool = True
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: score the prompt only (with echo)
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # vLLM's extension


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]
