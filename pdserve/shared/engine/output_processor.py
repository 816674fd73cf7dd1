"""Outputs out: each user request's ``n`` choices, their text, logprobs and finish, as ``RequestOutput`` snapshots.

vLLM's ``OutputProcessor``: one ``RequestState`` per user request holds its choices (``Request``s) and an
incremental detokenizer each. ``append_token`` records a sampled token and says whether the choice finished
(stop token, stop string, length); ``take_outputs`` returns every request that progressed since the last call.
"""

from __future__ import annotations

import time

import torch

from pdserve.shared.engine.detokenizer import IncrementalDetokenizer, check_stop_token
from pdserve.shared.engine.model_runner import PromptLogits
from pdserve.shared.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pdserve.shared.engine.request import FINISH_REASONS, Request
from pdserve.shared.protocol.sampling_params import SamplingParams


class RequestState:
    """The ``n`` choices of one user request. ``new``: tokens per choice index since the last output."""

    __slots__ = ("request_id", "prompt", "params", "members", "detoks", "new")

    def __init__(self, request_id: str, prompt: str | None, params: SamplingParams) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.members: list[Request] = []
        self.detoks: list[IncrementalDetokenizer] = []
        self.new: dict[int, list[int]] = {}


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.states: dict[str, RequestState] = {}
        self._touched: dict[str, RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams, members: list[Request],
                    output_text_len: int = 0) -> None:
        """Track a user request's choices. ``output_text_len``: characters of a resumed choice's text its
        client already has (the rest was held back as a possible stop-string prefix)."""
        state = RequestState(request_id, prompt, params)
        for request in members:
            state.members.append(request)
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.sampling_params)
            if request.num_output_tokens:
                detok.resume(request.output_token_ids, output_text_len)
            state.detoks.append(detok)
        self.states[request_id] = state

    def pop(self, request_id: str) -> RequestState | None:
        self._touched.pop(request_id, None)
        return self.states.pop(request_id, None)

    def append_token(self, request: Request, token: int, lp, now: float | None = None) -> str | None:
        """Append a sampled token (``lp``: its ``SampleLogprobs`` or ``None``) to the choice; returns the finish
        reason (``"stop"`` | ``"length"``) or ``None`` while it runs."""
        request.append_output_token(token)
        if request.first_token_time is None:
            request.first_token_time = time.time() if now is None else now
        if lp is not None and request.logprobs is not None:
            entry = {tid: Logprob(val, rank + 1) for rank, (tid, val) in enumerate(lp.top)}
            entry[token] = Logprob(lp.logprob, lp.rank)
            request.logprobs.append(entry)
            request.cumulative_logprob += lp.logprob
        state = self.states[request.parent_id or request.request_id]
        self._touched[state.request_id] = state
        state.new.setdefault(request.index, []).append(token)
        # vLLM's order: a stop token, then a stop string, and only then the length limit, so a stop string that
        # the last allowed token completes finishes as "stop" (plain and speculative steps both come here).
        params = request.sampling_params
        stop_token = check_stop_token(token, params, self.eos_token_ids, request.num_output_tokens) == "stop"
        if stop_token and token in params.stop_token_ids:
            request.stop_reason = token
        stop_str = state.detoks[request.index].update([token], stop_terminated=stop_token)
        if stop_token:
            return "stop"
        if stop_str is not None:
            request.stop_reason = stop_str
            return "stop"
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def mark_sent(self, request: Request) -> None:
        """Drop the pending delta of ``request`` (its client has it already: a hand-over's first token)."""
        state = self.states[request.parent_id or request.request_id]
        state.new.pop(request.index, None)
        state.detoks[request.index].get_next_output_text(request.is_finished, delta=True)
        self._touched.pop(state.request_id, None)

    def take_outputs(self) -> list[RequestOutput]:
        """A snapshot of every request that progressed since the last call; finished ones are forgotten."""
        touched, self._touched = self._touched, {}
        return [self._make_output(state) for state in touched.values()]

    def _make_output(self, state: RequestState) -> RequestOutput:
        outputs = []
        for request, detok in zip(state.members, state.detoks):
            finished = request.is_finished
            new_ids = state.new.pop(request.index, [])
            new_text = detok.get_next_output_text(finished, delta=True)
            # A snapshot: workers format outputs on another thread while the next step appends to the
            # request's lists (sharing them let a logprob entry of step k+1 pair with a token of step k).
            outputs.append(CompletionOutput(
                index=request.index, text=detok.output_text, token_ids=list(request.output_token_ids),
                cumulative_logprob=request.cumulative_logprob,
                logprobs=None if request.logprobs is None else list(request.logprobs),
                finish_reason=FINISH_REASONS.get(request.status), stop_reason=request.stop_reason,
                new_text=new_text, new_token_ids=new_ids))
        first = state.members[0]
        done = all(r.is_finished for r in state.members)
        prompt_logprobs = first.prompt_logprobs
        if prompt_logprobs is not None and len(prompt_logprobs) < first.num_prompt_tokens:
            prompt_logprobs = None  # not computed here (a decode pod's committed request: the prefill pod has them)
        if done:
            self.states.pop(state.request_id, None)
        return RequestOutput(state.request_id, state.prompt, first.prompt_token_ids, outputs, done,
                             num_cached_tokens=max(first.num_cached_tokens, 0),
                             metrics={"arrival_time": first.arrival_time, "first_token_time": first.first_token_time,
                                      "num_preemptions": first.num_preemptions},
                             prompt_logprobs=prompt_logprobs)

    def record_prompt_logprobs(self, chunk: PromptLogits) -> None:
        """Append ``{token_id: Logprob}`` for each prompt position of ``chunk``: the prompt token (its rank
        counts the tokens strictly more likely) and the ``prompt_logprobs`` most likely tokens (ranks 1..k)."""
        request = chunk.request
        k = request.sampling_params.prompt_logprobs
        lp = torch.log_softmax(chunk.logits.float(), dim=-1)
        targets = torch.tensor(request.prompt_token_ids[chunk.first_target:chunk.first_target + lp.shape[0]],
                               device=lp.device)
        chosen = lp.gather(1, targets.unsqueeze(1))
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        top_vals, top_ids = lp.topk(max(k, 1), dim=-1)
        for token, value, rank, vals, ids in zip(targets.tolist(), chosen.squeeze(1).tolist(), ranks,
                                                 top_vals.tolist(), top_ids.tolist()):
            entry = {token: Logprob(value, rank)}  # the prompt token first, as vLLM orders them
            for r, (tid, val) in enumerate(zip(ids[:k], vals[:k])):
                entry.setdefault(tid, Logprob(val, r + 1))
            request.prompt_logprobs.append(entry)
