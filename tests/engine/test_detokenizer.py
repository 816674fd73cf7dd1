from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.shared.engine.detokenizer import IncrementalDetokenizer, check_stop_token
from pdserve.shared.protocol.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"
TEXTS = [
    "The capital of France is Paris.",
    "Hello 世界! 你好，欢迎使用。日本語のテキストも大丈夫です。",
    "Emoji: 🎉🚀👩‍👩‍👧‍👦 🇫🇷 ❤️‍🔥 done",
    "naïve café — Ærøskøbing, Ελληνικά, Русский, עברית, العربية",
    "Math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√∞ and combining: e\u0301 a\u0308",
    "def f(x):\n    return x  # tabs\tand  spaces   \n\n\n",
    "<|im_start|>literal special-looking text<|im_end|> after",
]


@pytest.fixture(scope="module")
def chat_prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text)


def byte_token_ids(tokenizer) -> list[int]:
    """Ids of the 256 single-byte tokens of a GPT-2 style byte-level BPE (bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = tokenizer.get_vocab()
    # SmolLM2 lacks bytes that never occur in UTF-8 (C0, C1, F5-FF) and a few control bytes.
    ids = [vocab[chars[b]] for b in range(256) if chars[b] in vocab]
    assert len(ids) > 200
    return ids


def stream(tokenizer, prompt, ids, params, chunks=None, stop_terminated=False):
    """Feed ids (one at a time or in the given chunk sizes); return deltas, final text, stop string."""
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    deltas, stop, pos = [], None, 0
    sizes = chunks or [1] * len(ids)
    for n in sizes:
        if pos >= len(ids):
            break
        piece = ids[pos:pos + n]
        pos += n
        last = pos >= len(ids)
        stop = detok.update(piece, stop_terminated=stop_terminated and last)
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
    if stop is None:
        deltas.append(detok.get_next_output_text(finished=True, delta=True))
    final = detok.get_next_output_text(finished=True, delta=False)
    return deltas, final, stop


def assert_never_retracted(deltas, final):
    acc = ""
    for d in deltas:
        acc += d
        assert final.startswith(acc)
    assert acc == final


# ---- detokenization --------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_equals_full_decode_for_real_texts(tokenizer, chat_prompt, text, skip_special_tokens):
    ids = tokenizer.encode(text)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    deltas, final, _ = stream(tokenizer, chat_prompt, ids, params)
    assert "".join(deltas) == final == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any(REPLACEMENT in d for d in deltas)


def test_multibyte_characters_are_split_across_tokens_in_these_texts(tokenizer):
    # Guards the test above: it only means something if tokens really split UTF-8 sequences.
    ids = tokenizer.encode(TEXTS[2])
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)


def test_prompt_ending_inside_a_character_does_not_leak_into_output(tokenizer):
    ids = tokenizer.encode("🚀🚀")
    split = next(i for i in range(1, len(ids)) if REPLACEMENT in tokenizer.decode(ids[:i]))
    deltas, final, _ = stream(tokenizer, ids[:split], ids[split:], SamplingParams())
    assert final == tokenizer.decode(ids[split:])


def test_stop_token_text_is_not_added_unless_asked(tokenizer, chat_prompt):
    ids = tokenizer.encode("Paris.") + [tokenizer.eos_token_id]
    shown = SamplingParams(skip_special_tokens=False)
    _, final, _ = stream(tokenizer, chat_prompt, ids, shown, stop_terminated=True)
    assert final == "Paris."
    kept = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    _, final, _ = stream(tokenizer, chat_prompt, ids, kept, stop_terminated=True)
    assert final == "Paris." + tokenizer.eos_token


_SEQUENCES = {}


def token_sequences(tokenizer):
    if id(tokenizer) in _SEQUENCES:
        return _SEQUENCES[id(tokenizer)]
    byte_ids = byte_token_ids(tokenizer)
    high_bytes = [i for i in byte_ids if tokenizer.decode([i]) == REPLACEMENT]
    assert len(high_bytes) > 100
    specials = tokenizer.all_special_ids
    vocab = len(tokenizer)
    one = st.one_of(
        st.sampled_from(high_bytes),  # UTF-8 lead and continuation bytes: split characters
        st.sampled_from(byte_ids),
        st.integers(0, vocab - 1),
        st.sampled_from(specials),
    )
    _SEQUENCES[id(tokenizer)] = st.lists(one, min_size=1, max_size=40)
    return _SEQUENCES[id(tokenizer)]


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_token_streams_concatenate_to_full_decode(tokenizer, data):
    seqs = token_sequences(tokenizer)
    ids = data.draw(seqs, label="output")
    prompt = data.draw(st.one_of(st.just([]), seqs), label="prompt")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    chunks = data.draw(st.one_of(st.none(), st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids))))
    deltas, final, _ = stream(tokenizer, prompt, ids, SamplingParams(skip_special_tokens=skip), chunks)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == final == full
    # A U+FFFD is only ever emitted when the full decode has one too (a truly invalid sequence).
    if REPLACEMENT not in full:
        assert not any(REPLACEMENT in d for d in deltas)
    assert_never_retracted(deltas, final)


def test_decoding_work_per_token_is_bounded(tokenizer, chat_prompt):
    """O(new text) per step: every decode call sees a short window, however long the output."""

    class Spy:
        def __init__(self, inner):
            self.inner, self.lengths = inner, []

        def decode(self, ids, skip_special_tokens):
            self.lengths.append(len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    class Wrapped:
        backend_tokenizer = Spy(tokenizer.backend_tokenizer)

    ids = tokenizer.encode(" ".join(TEXTS) * 40)
    assert len(ids) > 2000
    detok = IncrementalDetokenizer(Wrapped(), chat_prompt, SamplingParams())
    for i in ids:
        detok.update([i])
    assert detok.get_next_output_text(finished=True, delta=False) == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(Wrapped.backend_tokenizer.lengths) <= 16
    assert len(Wrapped.backend_tokenizer.lengths) <= 2 * len(ids) + 2


# ---- stop strings ----------------------------------------------------------------------------

STOP_CASES = [
    ("The capital of France is Paris. It is big.", ". It"),
    ("The capital of France is Paris. It is big.", "Paris"),
    ("The capital of France is Paris. It is big.", "s P"),
    ("Hello 世界! 你好，欢迎使用。", "界!"),
    ("Emoji: 🎉🚀 done", "🚀"),
    ("line one\n\nline two\n\nline three", "\n\n"),
    ("abcabcabd", "abd"),
]


@pytest.mark.parametrize(("text", "stop"), STOP_CASES)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_cuts_where_find_says(tokenizer, chat_prompt, text, stop, include):
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    deltas, final, matched = stream(tokenizer, chat_prompt, ids, params)
    at = full.find(stop)
    assert matched == stop
    assert final == (full[: at + len(stop)] if include else full[:at])
    assert_never_retracted(deltas, final)


def test_stop_string_spanning_a_token_boundary_is_found(tokenizer, chat_prompt):
    text = "The capital of France is Paris. It is big."
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert ". It" not in pieces and "." in pieces  # really spans tokens
    _, final, matched = stream(tokenizer, chat_prompt, ids, SamplingParams(stop=". It"))
    assert (final, matched) == ("The capital of France is Paris", ". It")


def test_text_that_may_become_a_stop_string_is_held_back_then_released(tokenizer, chat_prompt):
    detok = IncrementalDetokenizer(tokenizer, chat_prompt, SamplingParams(stop=["END!"]))
    detok.update(tokenizer.encode("The"))
    assert detok.get_next_output_text(False, True) == "The"
    detok.update(tokenizer.encode(" END"))
    assert detok.get_next_output_text(False, True) == " "  # "END" may start "END!"
    assert detok.output_text == "The "
    detok.update(tokenizer.encode("ing"))
    assert detok.get_next_output_text(False, True) == "ENDing"  # can no longer match
    detok.update(tokenizer.encode(" EN"))
    assert detok.get_next_output_text(False, True) == " "
    assert detok.get_next_output_text(True, True) == "EN"  # finish releases the held tail
    assert detok.output_text == "The ENDing EN"


def test_include_stop_str_holds_nothing_back(tokenizer, chat_prompt):
    detok = IncrementalDetokenizer(tokenizer, chat_prompt, SamplingParams(stop="END!", include_stop_str_in_output=True))
    detok.update(tokenizer.encode("The END"))
    assert detok.get_next_output_text(False, True) == "The END"
    assert detok.update(tokenizer.encode("! more")) == "END!"
    assert detok.get_next_output_text(True, True) == "!"


def test_earliest_of_several_stop_strings_wins(tokenizer, chat_prompt):
    ids = tokenizer.encode("one two three four")
    _, final, matched = stream(tokenizer, chat_prompt, ids, SamplingParams(stop=["four", "two", "three"]))
    assert (final, matched) == ("one ", "two")


def test_stop_strings_wait_for_min_tokens(tokenizer, chat_prompt):
    ids = tokenizer.encode("a b a b a b")
    assert len(ids) == 6
    # "b" completes at tokens 2, 4, 6; with min_tokens=3 the first that counts is token 4's.
    _, final, matched = stream(tokenizer, chat_prompt, ids, SamplingParams(stop=" b", min_tokens=3))
    assert (final, matched) == ("a b a", " b")


def test_tokens_after_a_stop_string_are_ignored(tokenizer, chat_prompt):
    detok = IncrementalDetokenizer(tokenizer, chat_prompt, SamplingParams(stop="STOP"))
    assert detok.update(tokenizer.encode("go STOP and more")) == "STOP"
    assert detok.finished
    assert detok.update(tokenizer.encode(" extra")) == "STOP"
    assert detok.get_next_output_text(True, False) == "go "


stop_alphabet = st.sampled_from(list("ab \n.世🎉é"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(stop_alphabet, min_size=1, max_size=40),
    stops=st.lists(st.text(stop_alphabet, min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    chunk=st.integers(1, 3),
)
def test_random_stop_strings(tokenizer, chat_prompt, text, stops, include, chunk):
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    deltas, final, matched = stream(tokenizer, chat_prompt, ids, params, chunks=[chunk] * len(ids))
    assert_never_retracted(deltas, final)
    found = [s for s in stops if s in full]
    if not found:
        assert matched is None and final == full
        return
    assert matched in found
    if len(stops) == 1:
        at = full.find(matched)
    else:
        at = len(final) - (len(matched) if include else 0)
        assert full.startswith(matched, at)
        # No other stop string lies wholly before the match's end while starting earlier.
        for s in stops:
            j = full.find(s)
            assert j == -1 or j >= at or j + len(s) > at + len(matched)
    assert final == full[: at + (len(matched) if include else 0)]


# ---- stop tokens -----------------------------------------------------------------------------

EOS = 2


@pytest.mark.parametrize(
    ("token", "kwargs", "n", "reason"),
    [
        (EOS, {}, 1, "stop"),
        (EOS, {"ignore_eos": True}, 1, None),
        (EOS, {"ignore_eos": True, "max_tokens": 1}, 1, "length"),
        (7, {"stop_token_ids": [7]}, 3, "stop"),
        (7, {"stop_token_ids": [7], "ignore_eos": True}, 3, "stop"),
        (8, {"stop_token_ids": [7]}, 3, None),
        (EOS, {"min_tokens": 3}, 3, None),
        (EOS, {"min_tokens": 3}, 4, "stop"),
        (7, {"min_tokens": 3, "stop_token_ids": [7]}, 2, None),
        (5, {"max_tokens": 4}, 4, "length"),
        (5, {"max_tokens": 4}, 3, None),
        (EOS, {"max_tokens": 4}, 4, "stop"),  # stop wins over length, as vLLM
        (5, {"max_tokens": None}, 10**6, None),
    ],
)
def test_check_stop_token(token, kwargs, n, reason):
    assert check_stop_token(token, SamplingParams(**kwargs), {EOS}, n) == reason
