"""OpenAI bodies and chunks from output events, without HTTP (``ResponseBuilder`` and the logprob formats)."""

from __future__ import annotations

from pdserve.services.router.responses import ResponseBuilder, completion_logprobs
from pdserve.shared.protocol.messages import OutputEvent, TokenLogprob

TOKENS = {1: "Hel", 2: "lo", 3: "!", 4: " x"}


def builder(kind="chat", n=1, prompt_lens=(5,), **kw) -> ResponseBuilder:
    return ResponseBuilder(kind, "id-1", "smol", 1000, TOKENS.__getitem__, list(prompt_lens), n,
                           want_logprobs=kw.pop("want_logprobs", False), **kw)


def ev(i, tokens, text, done=None, total=0, lps=None) -> OutputEvent:
    return OutputEvent(f"r{i}", i, tokens, text, done, lps, prompt_tokens=5, completion_tokens=total)


def test_chat_chunks_open_with_the_role_and_close_with_the_finish_reason():
    b = builder(include_usage=True)
    opening, first = b.stream_chunks(0, ev(0, [1], "Hel", total=1))  # the role goes out with the first token
    assert opening == {"id": "id-1", "object": "chat.completion.chunk", "created": 1000, "model": "smol",
                       "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}], "usage": None}
    assert first["choices"][0]["delta"] == {"content": "Hel"}
    assert b.stream_chunks(0, ev(0, [9], "", total=2)) == []  # nothing to show yet (held-back text)
    last = b.on_event(0, ev(0, [2], "lo", "stop", total=3))
    assert last["choices"][0] == {"index": 0, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": "stop",
                                  "stop_reason": None}
    assert b.usage_chunk() == {"id": "id-1", "object": "chat.completion.chunk", "created": 1000, "model": "smol",
                               "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3,
                                                        "total_tokens": 8}}


def test_final_event_without_text_has_an_empty_delta():
    b = builder()
    b.on_event(0, ev(0, [1], "Hel", total=1))
    assert b.on_event(0, ev(0, [2], "", "length", total=2))["choices"][0]["delta"] == {}


def test_n_choices_usage_counts_each_prompt_once():
    b = builder(kind="completion", n=2, prompt_lens=(5, 7))
    for i, total in enumerate([3, 1, 2, 4]):
        b.on_event(i, ev(i, [1], "x", "length", total=total))
    body = b.response()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 10, "total_tokens": 22}
    assert body["object"] == "text_completion"


def test_continuous_usage_stats_ride_on_every_chunk():
    b = builder(include_usage=True, continuous_usage=True)
    chunk = b.on_event(0, ev(0, [1], "Hel", total=1))
    assert chunk["usage"] == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}


def test_whole_chat_response_joins_the_deltas_and_formats_logprobs():
    b = builder(want_logprobs=True)
    b.on_event(0, ev(0, [1], "Hel", total=1, lps=[TokenLogprob(1, -0.5, [(1, -0.5), (4, -2.0)])]))
    b.on_event(0, ev(0, [2], "lo", "stop", total=2, lps=[TokenLogprob(2, float("-inf"), [])]))
    body = b.response()
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello"}
    assert choice["logprobs"] == {"content": [
        {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108], "top_logprobs": [
            {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
            {"token": " x", "logprob": -2.0, "bytes": [32, 120]}]},
        {"token": "lo", "logprob": -9999.0, "bytes": [108, 111], "top_logprobs": []}]}  # -inf is not JSON


def test_streamed_completion_logprob_offsets_continue_across_chunks():
    b = builder(kind="completion", want_logprobs=True)
    b.on_event(0, ev(0, [1], "Hel", total=1, lps=[TokenLogprob(1, -0.1, [])]))
    chunk = b.on_event(0, ev(0, [2, 3], "lo!", "stop", total=3,
                             lps=[TokenLogprob(2, -0.2, []), TokenLogprob(3, -0.3, [(3, -0.3)])]))
    assert chunk["choices"][0]["logprobs"] == {"tokens": ["lo", "!"], "token_logprobs": [-0.2, -0.3],
                                               "top_logprobs": [None, {"!": -0.3}], "text_offset": [3, 5]}
    assert completion_logprobs(TOKENS.__getitem__, [TokenLogprob(4, -1.0, [])], 10)["text_offset"] == [10]


def test_stream_json_gives_the_chunks_stream_chunks_gives_through_the_text_template():
    """The template fast path against the dict path as oracle: same chunks, same order, for chat and completions,
    n = 2, usage, text with quotes, escapes and non-ASCII, a held-back (empty) delta, logprobs and the finish."""
    import json

    texts = ["Hel", 'say "hi"\n', "", "caf\u00e9 \u2603", "\\end"]
    for kind in ("chat", "completion"):
        for kw in ({}, {"include_usage": True}, {"want_logprobs": True}):
            fast, slow = builder(kind, n=2, **kw), builder(kind, n=2, **kw)
            got, want = [], []
            for step, text in enumerate(texts):
                for i in (0, 1):
                    lps = [TokenLogprob(1, -0.5, [(1, -0.5)])] if kw.get("want_logprobs") and step == 1 else None
                    done = "length" if step == len(texts) - 1 else None
                    got += [json.loads(c) for c in fast.stream_json(i, ev(i, [1], text, done, step + 1, lps))]
                    want += slow.stream_chunks(i, ev(i, [1], text, done, step + 1, lps))
            assert got == want, (kind, kw)
            assert fast.usage() == slow.usage()
