"""The router's tokenizer (pdserve/services/router/tokenizer_loader.py) against the engine's: ``AutoTokenizer`` is the oracle.

The router loads ``TokenizersBackend`` itself where ``AutoTokenizer`` would build that class anyway (transformers 5
imports torch for AutoTokenizer's config lookup). Here every output the router takes from its tokenizer (prompt ids
with and without special tokens, chat ids from the template, decoded text, logprobs' token strings and bytes) must
equal what a ``PromptProcessor`` over ``AutoTokenizer.from_pretrained`` (the tokenizer the engine and its detokenizer
load) gives, on the default model and on a Llama-2-style tokenizer that adds a BOS. Directories the torch-free path
must not take fall back to AutoTokenizer with one log line, or fail with a clear error.
tests/router/test_process.py checks that a router process never loads torch.
"""

from __future__ import annotations

import logging
import random

import pytest

from pdserve.services.router import prompts, tokenizer_loader
from pdserve.services.router.prompts import PromptProcessor
from pdserve.services.router.schemas import ChatMessage
from pdserve.services.router.tokenizer_loader import TokenizerLoadError, load_tokenizer, torch_free_refusal

from support.tokenizer_dirs import copy_tokenizer_dir, make_llama2_style_tokenizer, write_vocab_and_merges

LONG = ("The bridge builders complained about the price of stone, the weather and the river. " * 300
        + "Ça va? 日本語 🙂 " * 200)
PROMPTS = ["", " ", "Hello", "  leading and trailing  ", "The capital of France is", "Ça va? 日本語 🙂 naïve café",
           "👩‍👩‍👧 zero\u200bwidth e\u0301 \ufffd", "مرحبا بالعالم", "\n\n\t tabs\r\n", "\x00\x01 control",
           "<|im_start|>user\nhi<|im_end|>", "<s> [INST] x [/INST] </s>", "<unk><0x41>", "x" * 3000, LONG]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
     {"role": "user", "content": "Count to three.\nPlease."}],
    [{"role": "user", "content": "Ça va? 日本語 🙂 👩‍👩‍👧"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "<|im_end|><s></s> literal specials"}],
    [{"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}],
    [{"role": "user", "content": LONG}],
]
CONTINUED = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi th"}]


def messages(conversation) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in conversation]


def oracle_processor(model_dir) -> PromptProcessor:
    """The router's processor as it was before tokenizer_loader.py: over AutoTokenizer, the engine's tokenizer."""
    from transformers import AutoTokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prompts, "load_tokenizer", AutoTokenizer.from_pretrained)
        return PromptProcessor(model_dir)


@pytest.fixture(scope="module", params=["smollm2", "llama2-style"])
def pair(request, model_dir, tmp_path_factory) -> tuple[PromptProcessor, PromptProcessor]:
    """(the router's processor, the oracle's) for the default model and for a tokenizer that adds a BOS."""
    path = model_dir if request.param == "smollm2" else make_llama2_style_tokenizer(tmp_path_factory.mktemp("l2"))
    assert torch_free_refusal(path) is None  # the torch-free path is the one under test
    return PromptProcessor(path), oracle_processor(path)


def test_same_class_and_vocabulary(pair):
    router, oracle = pair
    assert type(router.tokenizer) is type(oracle.tokenizer)
    assert router.tokenizer.get_vocab() == oracle.tokenizer.get_vocab()
    assert router.tokenizer.added_tokens_decoder == oracle.tokenizer.added_tokens_decoder
    assert router.tokenizer.all_special_ids == oracle.tokenizer.all_special_ids
    assert (router.tokenizer.bos_token_id, router.tokenizer.eos_token_id) == (oracle.tokenizer.bos_token_id,
                                                                               oracle.tokenizer.eos_token_id)
    assert (router.vocab_size, router.max_model_len) == (oracle.vocab_size, oracle.max_model_len)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_prompt_ids_equal_the_engine_tokenizer(pair, add_special_tokens):
    router, oracle = pair
    for text in PROMPTS:
        expected = oracle.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert router.tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected, text[:40]
    given = [p for p in PROMPTS if oracle.tokenizer.encode(p, add_special_tokens=add_special_tokens)]
    assert (router.prompt_token_ids(given, add_special_tokens)
            == oracle.prompt_token_ids(given, add_special_tokens))


def test_bos_is_added_where_the_tokenizer_adds_one(pair):
    router, oracle = pair
    bos = oracle.tokenizer.bos_token_id
    adds_bos = oracle.tokenizer.encode("x")[0] == bos
    assert adds_bos == (router.model_dir.name != "smollm2-135m-instruct")  # SmolLM2 adds none; the Llama-2 one does
    assert (router.tokenizer.encode("x")[0] == bos) == adds_bos
    assert router.tokenizer.encode("", add_special_tokens=True) == ([bos] if adds_bos else [])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_chat_ids_equal_the_engine_tokenizer(pair, add_generation_prompt, add_special_tokens):
    router, oracle = pair
    for conversation in CONVERSATIONS:
        args = (messages(conversation), add_generation_prompt, False, None, add_special_tokens)
        ids = router.chat_token_ids(*args)
        assert ids == oracle.chat_token_ids(*args)
        assert router.render_chat(*args[:4]) == oracle.render_chat(*args[:4])
        if not add_special_tokens:  # the template's own BOS only, as apply_chat_template tokenizes
            out = oracle.tokenizer.apply_chat_template(oracle.conversation(args[0]), tokenize=True,
                                                       add_generation_prompt=add_generation_prompt)
            assert ids == list(out["input_ids"] if hasattr(out, "keys") else out)
    args = (messages(CONTINUED), False, True)
    assert router.chat_token_ids(*args) == oracle.chat_token_ids(*args)


def test_decoding_and_token_strings_equal_the_engine_tokenizer(pair):
    router, oracle = pair
    size = len(oracle.tokenizer)
    rng = random.Random(0)
    samples = [oracle.tokenizer.encode(p) for p in PROMPTS] + [rng.sample(range(size), 40) for _ in range(50)]
    samples.append(sorted(int(i) for i in oracle.tokenizer.added_tokens_decoder))
    for ids in samples:
        for skip in (False, True):
            assert router.decode(ids, skip_special_tokens=skip) == oracle.decode(ids, skip_special_tokens=skip)
    every = range(size) if size < 1000 else [*range(0, size, 7), *range(size - 20, size)]
    for i in every:
        assert (router.token_str(i), router.token_bytes(i)) == (oracle.token_str(i), oracle.token_bytes(i)), i


# ---- directories the torch-free path must leave to AutoTokenizer ------------------------------------------------

def _fallback_dirs(model_dir, tmp):
    l2 = make_llama2_style_tokenizer(tmp / "l2")
    return {
        # LlamaTokenizer is Metaspace-only: on these files it tokenizes "<s>" in text unlike TokenizersBackend
        "model-specific class": (copy_tokenizer_dir(l2, tmp / "llama-class", tokenizer_class="LlamaTokenizer"),
                                 "tokenizer_class 'LlamaTokenizer'"),
        # AutoTokenizer overrides the generic class for qwen2 (its own Qwen2Tokenizer)
        "overridden model type": (copy_tokenizer_dir(model_dir, tmp / "qwen2", model_type="qwen2"),
                                  "model_type 'qwen2'"),
        "no tokenizer.json": (write_vocab_and_merges(model_dir, tmp / "legacy"), "no tokenizer.json"),
    }


@pytest.mark.parametrize("case", ["model-specific class", "overridden model type", "no tokenizer.json"])
def test_other_directories_fall_back_to_autotokenizer_and_say_why_once(model_dir, tmp_path, caplog, case):
    from transformers import AutoTokenizer

    path, why = _fallback_dirs(model_dir, tmp_path)[case]
    with caplog.at_level(logging.INFO, logger=tokenizer_loader.__name__):
        tok = load_tokenizer(path)
    records = [r.getMessage() for r in caplog.records if r.name == tokenizer_loader.__name__]
    assert len(records) == 1 and why in records[0] and "AutoTokenizer" in records[0], records
    oracle = AutoTokenizer.from_pretrained(path)
    assert type(tok) is type(oracle) and type(tok).__name__ != "TokenizersBackend"
    for text in PROMPTS:
        assert tok.encode(text) == oracle.encode(text)
    if case == "no tokenizer.json":  # the same vocabulary and merges as the default model's tokenizer.json
        default = AutoTokenizer.from_pretrained(model_dir)
        assert [tok.encode(t) for t in PROMPTS] == [default.encode(t) for t in PROMPTS]


def test_a_tokenizer_neither_path_can_load_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x05not a sentencepiece model")
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(TokenizerLoadError, match=rf"cannot load the tokenizer of {tmp_path}: .*no tokenizer\.json"):
        PromptProcessor(tmp_path)


def test_the_override_list_is_read_from_the_installed_transformers():
    overrides = tokenizer_loader.hub_class_overrides()
    assert overrides is not None and "qwen2" in overrides and "llama" not in overrides
