"""Chat template and tokenization equal the model's own tokenizer (HF ``transformers`` is the oracle)."""

from __future__ import annotations

import httpx
import pytest

from pdserve.services.router.errors import OpenAIError
from pdserve.services.router.schemas import ChatMessage

CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "What is the capital of France?"}],
    "system and user": [{"role": "system", "content": "You are terse."},
                        {"role": "user", "content": "Name a prime."}],
    "multi-turn": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
                   {"role": "user", "content": "Count to three.\nPlease."}],
    "unicode": [{"role": "user", "content": "Ça va? 日本語 🙂"}],
}


def oracle_ids(tokenizer, conversation, **kwargs) -> list[int]:
    out = tokenizer.apply_chat_template(conversation, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_chat_token_ids_equal_apply_chat_template(processor, name):
    conversation = CONVERSATIONS[name]
    messages = [ChatMessage.model_validate(m) for m in conversation]
    assert processor.chat_token_ids(messages) == oracle_ids(processor.tokenizer, conversation,
                                                            add_generation_prompt=True)


def test_continue_final_message_equals_the_oracle(processor):
    conversation = [{"role": "user", "content": "Finish: the sky is"}, {"role": "assistant", "content": "blue and"}]
    messages = [ChatMessage.model_validate(m) for m in conversation]
    ours = processor.chat_token_ids(messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == oracle_ids(processor.tokenizer, conversation, continue_final_message=True)
    assert processor.tokenizer.decode(ours).endswith("blue and")


def test_text_content_parts_join_with_newlines(processor):
    parts = [ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]})]
    assert processor.chat_token_ids(parts) == oracle_ids(processor.tokenizer, [{"role": "user", "content": "a\nb"}],
                                                         add_generation_prompt=True)


def test_completion_prompts_tokenize_like_the_tokenizer(processor):
    tok = processor.tokenizer
    assert processor.prompt_token_ids("Hello world") == [tok.encode("Hello world")]
    assert processor.prompt_token_ids(["a", "b c"]) == [tok.encode("a"), tok.encode("b c")]
    assert processor.prompt_token_ids([5, 6, 7]) == [[5, 6, 7]]
    assert processor.prompt_token_ids([[5], [6, 7]]) == [[5], [6, 7]]


def test_out_of_vocabulary_token_is_a_400_naming_prompt(processor):
    with pytest.raises(OpenAIError) as info:
        processor.prompt_token_ids([1, processor.vocab_size])
    assert (info.value.status, info.value.param) == (400, "prompt")


def test_tokenize_endpoint_with_messages_matches_the_oracle(router, processor):
    conversation = CONVERSATIONS["system and user"]
    body = httpx.post(router.url + "/tokenize", json={"model": "smollm2-135m-instruct", "messages": conversation},
                      timeout=30).json()
    expected = oracle_ids(processor.tokenizer, conversation, add_generation_prompt=True)
    assert body == {"count": len(expected), "max_model_len": 8192, "tokens": expected, "token_strs": None}


def test_tokenize_and_detokenize_a_prompt_round_trip(router, processor):
    body = httpx.post(router.url + "/tokenize", json={"model": "smollm2-135m-instruct", "prompt": "Hello there"},
                      timeout=30).json()
    assert body["tokens"] == processor.tokenizer.encode("Hello there")
    assert body["count"] == len(body["tokens"])
    back = httpx.post(router.url + "/detokenize", json={"model": "smollm2-135m-instruct", "tokens": body["tokens"]},
                      timeout=30).json()
    assert back == {"prompt": processor.tokenizer.decode(body["tokens"])}
