"""``SpecDecoder``: the engine's speculative-decoding step hooks (propose before scheduling, verify after).

Before ``Scheduler.schedule`` it sets ``spec_token_ids`` on every decoding request (``num_computed_tokens
== num_tokens - 1``): up to k proposals, trimmed so that positions stay below ``max_model_len`` and no
more than ``max_tokens`` can be emitted. The n-gram proposer fills them there; the draft model needs the
slots the scheduler allocates, so it gets k placeholders and ``fill_drafts`` (after scheduling, before the
target's pass) overwrites the ones the scheduler kept with the draft model's guesses. After the forward pass
it verifies each request's rows with the ``RejectionSampler`` (a grammar request's rows masked by its grammar
after the drafts before them: structured_output.py), appends the tokens it accepts, rolls the rest back, the
grammar's matcher too (``verify_and_append``) and keeps vLLM's counters (``spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pdserve.shared.engine.kv_cache_manager import KVCacheManager
from pdserve.shared.engine.request import Request
from pdserve.shared.engine.scheduler import SchedulerOutput
from pdserve.shared.engine.spec_decode.config import SpeculativeConfig
from pdserve.shared.engine.spec_decode.draft_model import DraftModelProposer
from pdserve.shared.engine.spec_decode.ngram_proposer import NgramProposer
from pdserve.shared.engine.spec_decode.policy import SpecPolicy
from pdserve.shared.engine.spec_decode.rejection_sampler import RejectionSampler, VerifyOutput, spec_metadata

# (request, its draft token ids, index of its first logits row)
Verifying = tuple[Request, list[int], int]


def split_logits_rows(sampling: Sequence[Request], spec_token_ids: dict[str, list[int]]
                      ) -> tuple[list[Request], list[int], list[Verifying]]:
    """The step's logits rows per request: one row for a plain request, ``1 + k`` for one verifying ``k`` drafts.
    Returns ``(plain requests, their rows, verifying requests)``."""
    plain, rows, verifying, row = [], [], [], 0
    for request in sampling:
        draft = spec_token_ids.get(request.request_id)
        if draft:
            verifying.append((request, draft, row))
            row += len(draft) + 1
        else:
            plain.append(request)
            rows.append(row)
            row += 1
    return plain, rows, verifying


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, generator: torch.Generator, eos_token_ids: frozenset[int],
                 vocab_size: int, max_model_len: int, draft: DraftModelProposer | None = None) -> None:
        """``draft``: the loaded draft model (``DraftModelProposer.load``), required for method draft_model."""
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError(f"speculative_config.method {config.method!r} needs a draft model exactly when it is "
                             "'draft_model'")
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) if draft is None else None
        self.draft = draft
        self._draft_probs: dict[str, torch.Tensor | None] = {}
        self.policy = SpecPolicy(self.k, config.adaptive, config.disable_by_batch_size)
        self.rejection_sampler = RejectionSampler(generator)
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.k

    @classmethod
    def for_engine(cls, engine) -> SpecDecoder | None:
        """The engine's speculative decoder (``None`` without a ``speculative_config``), its draft model loaded
        on the engine's backend, dtype and block count for method draft_model."""
        sc = engine.config.speculative_config
        if sc is None:
            return None
        draft = DraftModelProposer.load(engine, sc.model) if sc.method == "draft_model" else None
        return cls(sc, engine.sampler.generator, engine.eos_token_ids, engine.vocab_size, engine.max_model_len, draft)

    def propose(self, running: Sequence[Request]) -> None:
        """Set ``spec_token_ids`` on each running request (``[]`` where it does not speculate this step)."""
        budget = self.policy.step_budget(len(running))
        if len(self.policy.ema) > 2 * len(running) + 64:  # forget finished requests
            live = {r.request_id for r in running}
            self.policy.ema = {rid: v for rid, v in self.policy.ema.items() if rid in live}
        candidates = []
        for request in running:
            request.spec_token_ids = []
            if request.num_computed_tokens == request.num_tokens - 1 and not request.prefill_only:
                candidates.append(request)
        for i, request in enumerate(candidates):
            if budget <= 0:
                break
            k = min(self.policy.num_draft_tokens(request.request_id), self.policy.share(budget, len(candidates) - i),
                    request.max_tokens - request.num_output_tokens - 1,
                    self.max_model_len - request.num_tokens - 1)
            if k > 0:
                request.spec_token_ids = [0] * k if self.draft else self.proposer.propose(request.all_token_ids, k)
                budget -= len(request.spec_token_ids)

    def fill_drafts(self, out: SchedulerOutput) -> None:
        """Draft model only: replace the placeholders the scheduler kept (in ``out.spec_token_ids``, the same
        lists as the requests') with the draft model's guesses, keeping ``q`` for ``verify``."""
        self._draft_probs = {}
        if self.draft is None or not out.spec_token_ids:
            return
        requests = [r for r, _ in out.scheduled if r.request_id in out.spec_token_ids]
        drafts = [out.spec_token_ids[r.request_id] for r in requests]
        for r, q in zip(requests, self.draft.propose(requests, drafts)):
            self._draft_probs[r.request_id] = q

    def verify(self, logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[list[int]]) -> VerifyOutput:
        """``logits``: ``[sum(len(d) + 1), V]``, request i's rows in order. Returns tokens to append per request."""
        md = spec_metadata([r.sampling_params for r in requests], [r.prompt_token_ids for r in requests],
                           [r.output_token_ids for r in requests], drafts, self.eos_token_ids, self.vocab_size,
                           [r.grammar for r in requests])
        result = self.rejection_sampler(logits, drafts, md, [r.generator for r in requests],
                                        [self._draft_probs.get(r.request_id) for r in requests])
        self.policy.record_step(sum(len(d) for d in drafts), sum(result.num_accepted))
        for request, draft, accepted in zip(requests, drafts, result.num_accepted):
            self.policy.record(request.request_id, len(draft), accepted)
            self.num_drafts += 1
            self.num_draft_tokens += len(draft)
            self.num_accepted_tokens += accepted
            for pos in range(accepted):
                self.num_accepted_tokens_per_pos[pos] += 1
        return result

    def verify_and_append(self, logits: torch.Tensor, verifying: Sequence[Verifying],
                          append_token: Callable[[Request, int, object], None], kv: KVCacheManager) -> None:
        """The speculative step's second half: append each request's accepted drafts and its recovered/bonus token
        in order through ``append_token(request, token, logprobs)`` (a stop, EOS or max_tokens ends the run; later
        tokens are dropped), then roll ``num_computed_tokens`` back to the verified tokens and free the blocks that
        held only rejected drafts (``KVCacheManager.trim``). ``logits``: the whole step's rows."""
        idx = [r for _, draft, start in verifying for r in range(start, start + len(draft) + 1)]
        requests = [request for request, _, _ in verifying]
        result = self.verify(logits[torch.tensor(idx)], requests, [draft for _, draft, _ in verifying])
        for request, tokens, lps in zip(requests, result.token_ids, result.logprobs):
            request.spec_token_ids = []
            for token, lp in zip(tokens, lps):
                append_token(request, token, lp)
                if request.is_finished:
                    break
            if not request.is_finished:
                request.num_computed_tokens = request.num_tokens - 1
                kv.trim(request, request.num_computed_tokens)

    def get_stats(self) -> dict:
        """vLLM's counters, plus ``spec_decode_acceptance_rate`` (accepted / draft tokens) and
        ``spec_decode_mean_accepted_length`` (tokens emitted per verification: accepted + 1)."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": tuple(self.num_accepted_tokens_per_pos),
            "spec_decode_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "spec_decode_mean_accepted_length": 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0,
        }
