"""``Admission``: the limits on requests in flight and on choices not decoding yet, with the exact refusals
clients get (429 with Retry-After to come back, 400 for a request no wait would admit)."""

from __future__ import annotations

import pytest

from pdserve.services.router.admission import Admission
from pdserve.services.router.errors import OpenAIError


def refusal(admission: Admission, prompt_lens: list[int], n: int = 1) -> tuple[int, dict, dict | None]:
    with pytest.raises(OpenAIError) as exc:
        admission.check(prompt_lens, n)
    return exc.value.status, exc.value.body()["error"], exc.value.headers


def test_no_limits_admit_everything():
    admission = Admission()
    for _ in range(100):
        admission.check([5000] * 10, 8)
        admission.admit({i: 5000 for i in range(80)})
    assert (admission.active, admission.queued, admission.queued_tokens) == (100, 8000, 40_000_000)


def test_concurrency_limit_refuses_the_next_request_until_one_is_released():
    admission = Admission(max_concurrent_requests=2, retry_after_s=0)
    first, second = {0: 3}, {0: 4}
    admission.admit(first)
    admission.admit(second)
    assert refusal(admission, [3]) == (429, {
        "message": "The server is serving its limit of 2 concurrent requests; retry later",
        "type": "RateLimitError", "param": None, "code": 429}, {"Retry-After": "1"})
    admission.release(first)
    admission.check([3], 1)
    assert (admission.active, admission.queued, admission.queued_tokens) == (1, 1, 4)


def test_queue_limits_count_every_choice_until_it_is_decoding():
    admission = Admission(max_queued_requests=4, max_queued_prompt_tokens=100, retry_after_s=3)
    assert refusal(admission, [10, 10, 10], n=2) == (400, {
        "message": "This request has 6 choices (3 prompts x n=2); the server queues at most 4 at once "
                   "(--max-queued-requests): send fewer prompts or a smaller n",
        "type": "BadRequestError", "param": "prompt", "code": 400}, None)
    waiting = {0: 30, 1: 30, 2: 30}
    admission.admit(waiting)
    assert refusal(admission, [10], n=2)[:2] == (429, {
        "message": "3 requests are waiting for prefill or a decode slot (limit 4); retry later",
        "type": "RateLimitError", "param": None, "code": 429})
    assert refusal(admission, [11])[1]["message"] == \
        "90 prompt tokens are waiting for prefill or a decode slot (limit 100); retry later"
    admission.dequeue(waiting, (1,))  # choice 1 is decoding now
    assert waiting == {0: 30, 2: 30} and (admission.queued, admission.queued_tokens) == (2, 60)
    admission.check([10], n=2)
    admission.release(waiting)
    assert (admission.active, admission.queued, admission.queued_tokens, waiting) == (0, 0, 0, {})


def test_the_token_limit_never_refuses_a_request_when_nothing_waits():
    admission = Admission(max_queued_prompt_tokens=100)
    admission.check([5000], 1)  # alone it may exceed the limit: else a long prompt could never run
