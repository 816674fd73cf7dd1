"""From a validated request body to engine sampling parameters: cross-field rules and context-length checks.

Rules follow vLLM's OpenAI server: ``max_completion_tokens`` wins over ``max_tokens``; an unset
``max_tokens`` means "up to the context length" (``max_model_len - prompt_len``); a prompt that leaves no room
for one token is rejected naming the prompt field, a prompt + ``max_tokens`` beyond the context naming
``max_tokens``. Fields the request leaves unset take the model's ``generation_config.json`` defaults (vLLM's
``--generation-config auto``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pdserve.shared.protocol.sampling_params import (SamplingParams, SamplingParamsError,
                                                     normalise_structured_outputs)

from .errors import OpenAIError, bad_request
from .schemas import ChatCompletionRequest, CompletionRequest
from .tool_calls import ToolPlan

# generation_config.json key -> SamplingParams field (vLLM's get_diff_sampling_param).
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def generation_defaults(model_dir: Path) -> dict[str, Any]:
    """Sampling defaults the model ships in ``generation_config.json`` (empty when it has none)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    config = json.loads(path.read_text())
    out = {}
    for key, field_name in _GENERATION_DEFAULTS.items():
        if config.get(key) is not None:
            out[field_name] = config[key]
    if out.get("top_k") == 0:
        out["top_k"] = -1
    return out


@dataclass(slots=True)
class RequestPlan:
    """What the router enqueues for one OpenAI request: for each prompt, ``n`` choices.

    ``sampling[i]`` is ``SamplingParams.to_dict()`` for prompt ``i`` with ``n`` = 1 (the router fans out);
    choice ``j`` of a seeded request uses ``seed + j`` so the n choices differ but stay reproducible.
    """

    prompts: list[list[int]]
    sampling: list[dict[str, Any]]
    n: int
    tools: ToolPlan | None = None  # chat: how the output is read for tool calls (tool_calls.py)

    def choice_params(self, prompt_index: int, choice: int) -> SamplingParams:
        """Choice ``choice``'s params; raises ``OpenAIError`` 400 when ``seed + choice`` leaves the seed range."""
        params = dict(self.sampling[prompt_index])
        if params.get("seed") is not None and choice:
            params["seed"] = params["seed"] + choice
        try:
            return SamplingParams.from_dict(params)
        except SamplingParamsError as exc:
            raise OpenAIError(400, str(exc), exc.param) from exc


# vLLM's extra request fields that change the output and that pdserve does not implement; the schemas keep
# unknown fields (OpenAI clients send new ones), so these are named to be refused rather than ignored.
UNSUPPORTED_EXTENSIONS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                          "use_beam_search", "logits_processors")


def check_cross_field(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Rules pydantic cannot express per field; raise a 400 naming the field."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:
        # vLLM's rule and wording
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    extra = req.model_extra or {}
    for name in UNSUPPORTED_EXTENSIONS:
        if extra.get(name) not in (None, False, [], {}, ""):
            raise bad_request(f"{name} is not supported", name)
    # Fields that change the output and that pdserve does not implement are refused unless they hold the no-op
    # default: ignoring them would return something other than what was asked for.
    if req.best_of not in (None, 1, req.n):  # best_of == n returns every sample: plain n
        # vLLM V1 refuses best_of > 1 too ("vLLM V1 does not yet support best_of").
        raise bad_request("best_of is not supported (only null, 1 or equal to n)", "best_of")
    if isinstance(req, ChatCompletionRequest):
        if req.functions:
            raise bad_request("functions is not supported (no tool-call parser)", "functions")
        if req.function_call not in (None, "none", "auto"):
            raise bad_request("function_call other than 'none' or 'auto' is not supported (no tool-call parser)",
                              "function_call")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if req.add_generation_prompt and req.continue_final_message:
            raise bad_request("continue_final_message cannot be combined with add_generation_prompt "
                              "(set add_generation_prompt to false)", "continue_final_message")
    else:
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo, to score the prompt)", "max_tokens")
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")


def structured_outputs_of(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any] | None:
    """The request's ``SamplingParams.structured_outputs``: OpenAI's ``response_format`` (``json_object``, or
    ``json_schema`` with its ``schema``; ``strict`` is accepted, the grammar is always strict) or vLLM's extra
    field ``structured_outputs``. Raises a 400 naming the field for a malformed value or a JSON schema that is
    not a valid schema (its meta-schema, by ``jsonschema``); what the grammar compiler does not support is the
    engine's 400."""
    extra = req.model_extra or {}
    raw, field = extra.get("structured_outputs"), "structured_outputs"
    response_format = getattr(req, "response_format", None) or extra.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise bad_request("response_format must be an object", "response_format")
        kind = response_format.get("type", "text")
        if kind != "text" and raw is not None:
            raise bad_request("response_format and structured_outputs cannot both be set", "response_format")
        if kind == "json_object":
            raw, field = {"json_object": True}, "response_format"
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise bad_request("response_format json_schema must be an object with a 'schema' object",
                                  "response_format")
            # OpenAI's default schema when none is given: any JSON object
            raw, field = {"json": spec.get("schema") or {"type": "object"}}, "response_format"
        elif kind != "text":
            raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                              "response_format")
    try:
        value = normalise_structured_outputs(raw)
    except SamplingParamsError as exc:
        raise bad_request(str(exc).replace("structured_outputs", field, 1), field) from exc
    if value is not None and "json" in value:
        check_json_schema(json.loads(value["json"]), field)
    return value


def check_json_schema(schema: Any, field: str) -> None:
    """400 naming ``field`` when ``schema`` is not valid under its own meta-schema (draft 2020-12 unless its
    ``$schema`` says otherwise)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise bad_request(f"{field} holds an invalid JSON schema{' at ' + where if where else ''}: "
                          f"{exc.message}", field) from exc


def echo_prefixes(req: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]],
                  decode: Callable[[list[int]], str]) -> list[tuple[str, list[int]]] | None:
    """What each prompt's choices start with under ``echo`` (``ResponseBuilder``'s ``echo``), None without it.

    Completions: the prompt as sent (token-id prompts decoded) and its token ids. Chat (vLLM's rule): the last
    message's content when its role is the answer's (``assistant``, or with ``add_generation_prompt`` false the
    last message's own role), else nothing to echo.
    """
    if not req.echo:
        return None
    if isinstance(req, ChatCompletionRequest):
        role = "assistant" if req.add_generation_prompt else req.messages[-1].role
        last = req.messages[-1]
        if last.role != role:
            return None
        content = last.content if isinstance(last.content, str) or last.content is None else \
            "\n".join(part.text or "" for part in last.content)  # as prompts.py joins text parts
        return [(content or "", [])]
    raw = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else list(req.prompt)
    return [(text if isinstance(text, str) else decode(ids), ids) for text, ids in zip(raw, prompts)]


def requested_max_tokens(req: ChatCompletionRequest | CompletionRequest) -> tuple[int | None, str]:
    """The caller's token limit and the field it came from. ``echo`` with ``max_tokens=0`` (scoring the prompt)
    runs with 1, as vLLM does; the response leaves that token out (``echo_only``)."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    if echo_only(req):
        return 1, "max_tokens"
    return req.max_tokens, "max_tokens"


def echo_only(req: ChatCompletionRequest | CompletionRequest) -> bool:
    """A completions request that scores its prompt and generates nothing (``echo`` and ``max_tokens=0``)."""
    return isinstance(req, CompletionRequest) and req.echo and req.max_tokens == 0


def engine_prompt_logprobs(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many top tokens the engine computes per prompt position: ``prompt_logprobs``, and for completions
    with ``echo`` the ``logprobs`` the echoed prompt shows (vLLM's rule), the larger of the two."""
    wanted = [req.prompt_logprobs]
    if isinstance(req, CompletionRequest) and req.echo:
        wanted.append(req.logprobs)
    wanted = [k for k in wanted if k is not None]
    return max(wanted) if wanted else None


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                  prompt_param: str, max_tokens_param: str) -> int:
    """Return the effective ``max_tokens``; raise 400 when prompt and completion do not fit the context."""
    what = "messages" if prompt_param == "messages" else "prompt"
    if prompt_len == 0:
        raise bad_request(f"The {what} is empty (0 tokens); at least one prompt token is required", prompt_param)
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens in the {what}, which leaves no room for output. "
            f"Please reduce the length of the {what}.", prompt_param)
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} for the completion). "
            f"Please reduce the length of the {what} or {max_tokens_param}.", max_tokens_param)
    return max_tokens


def logit_bias_by_id(bias: dict[str, Any] | None) -> dict[int, Any] | None:
    """OpenAI's ``logit_bias`` (a JSON object: token ids as string keys) keyed by int; 400 for a key that is
    not a token id. The values are checked by ``SamplingParams``."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit():
            raise bad_request(f"logit_bias keys must be token ids (decimal integers), got {key!r}", "logit_bias")
        out[int(key)] = value
    return out


def with_structured_outputs(values: dict[str, Any], structured: dict[str, Any] | None, param: str) -> None:
    """Put guided decoding's ``structured_outputs`` (vLLM's ``StructuredOutputsParams`` shape, e.g.
    ``{"json": schema}``) into the sampling values; a 400 naming ``param`` when the request already asked for
    another grammar (``response_format`` or ``structured_outputs``)."""
    if structured is None:
        return
    if values.get("structured_outputs") is not None:
        # one grammar per request: a forced tool call's schema and the client's own format cannot both hold
        raise bad_request(f"{param} cannot be combined with response_format or structured_outputs", param)
    values["structured_outputs"] = structured


def build_sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int,
                          defaults: dict[str, Any], tokenizer: Any = None, vocab_size: int | None = None,
                          structured: tuple[dict[str, Any], str] | None = None) -> dict[str, Any]:
    """Validated ``SamplingParams.to_dict()`` for one choice (n = 1) of ``req``. ``tokenizer`` turns
    ``bad_words`` into token ids; ``vocab_size`` bounds every token id of the logits processors;
    ``structured``: guided decoding's ``structured_outputs`` and the request field that asked for it."""
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    values: dict[str, Any] = dict(defaults)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            values[name] = value
    if values.get("top_k") == 0:  # vLLM and OpenAI-compatible clients use 0 for "disabled" as well
        values["top_k"] = -1
    values.update(
        n=1,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=engine_prompt_logprobs(req),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        logit_bias=logit_bias_by_id(req.logit_bias),
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        structured_outputs=structured_outputs_of(req),
    )
    if structured is not None:
        with_structured_outputs(values, *structured)
    try:
        params = SamplingParams.from_dict(values)
        if tokenizer is not None:
            params.update_from_tokenizer(tokenizer)
        if vocab_size is not None:
            params.check_vocabulary(vocab_size)
        return params.to_dict()
    except SamplingParamsError as exc:
        param = exc.param
        if param == "max_tokens" and isinstance(req, ChatCompletionRequest) and req.max_completion_tokens:
            param = "max_completion_tokens"
        if param == "logprobs" and isinstance(req, ChatCompletionRequest):
            param = "top_logprobs"
        raise OpenAIError(400, str(exc), param) from exc
