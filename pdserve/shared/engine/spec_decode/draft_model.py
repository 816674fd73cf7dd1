"""Draft-model proposer: a smaller model with the target's tokenizer guesses k tokens autoregressively.

The draft keeps its own paged KV cache (its own ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``
tensor) on the target's block schedule: the same block ids, block tables and slot mapping, so it needs no
allocator of its own and a block freed by the target (finished, preempted, trimmed after a rejection) is
free for the draft too. The engine schedules a draft request with k placeholder drafts; the scheduler
allocates k + 1 slots (positions ``n - 1 .. n + k - 1`` for a request of n tokens), then ``propose`` runs
k draft steps in those slots and overwrites the placeholders with the real guesses before the target's
verify pass:

- step 0 feeds every token the draft has not computed yet, up to the last known one (usually one token; the
  whole sequence the first time, see below) and samples d1; step j feeds d_j at position n - 1 + j.
- after verification the draft's valid prefix is clamped to the target's ``num_computed_tokens``: the KV
  of accepted drafts is right (they are the tokens it was computed from), the rest is overwritten later.

The draft never reuses the target's prefix-cache hits, a KV handover or swapped blocks: a request whose
draft state is unknown (new, handed over from a prefill pod, resumed after a migration, preempted by
recompute or swap) first runs a **draft prefill** of its whole sequence in step 0. On a decode pod that is one
extra draft prefill per handed-over request (the prompt's draft KV is computed there, not transferred).

Sampled requests draw each draft token from the draft's distribution ``q`` (the request's own sampling
parameters applied to the draft logits), which the rejection sampler needs; seeded requests draw it from a
generator of their own (seed-derived), so their drafts do not depend on batch neighbours. Greedy requests
take the draft's argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.kernels.attention_metadata import AttentionMetadata
from pdserve.shared.engine.kv_cache import KVCache, KVCacheSpec
from pdserve.shared.engine.request import Request
from pdserve.shared.engine.sampler import SamplingMetadata, exponential_, process_logits, sampling_probs

_DRAFT_SEED_OFFSET = 0x5EED_D4AF  # a seeded request's draft generator: seed + index + this (mod 2**64)


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int, draft: str) -> None:
    """Raise ``ValueError`` unless the draft's tokenizer maps every token as the target's does and both models
    have the same vocabulary size (a draft token id must mean the target's token)."""
    if target_vocab != draft_vocab:
        raise ValueError(f"speculative_config.model {draft!r} has a vocabulary of {draft_vocab} tokens, the target "
                         f"model {target_vocab}: a draft model must share the target's tokenizer")
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(f"speculative_config.model {draft!r} has a different tokenizer vocabulary from the target "
                         "model: a draft model must share the target's tokenizer")


def draft_kv_bytes_per_block(speculative_config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block of a draft model's KV takes (0 without a draft model): its pool shares the engine's
    memory budget, block for block with the target's."""
    if speculative_config is None or speculative_config.method != "draft_model":
        return 0
    from pdserve.shared.models.loader import load_config
    from pdserve.shared.models.resolve import resolve_model

    mc = load_config(resolve_model(speculative_config.model))
    return KVCacheSpec.from_model_config(mc, block_size, dtype).bytes_per_block


class DraftModelProposer:
    """``model``: the draft (the loader's ``LlamaForCausalLM``); ``kv_cache``: its own pool with the target's
    number of blocks; ``kv_manager``: the target's (block ids per request); ``vocab_size``: shared."""

    def __init__(self, model, kv_cache: KVCache, kv_manager, vocab_size: int, eos_token_ids: frozenset[int],
                 fallback_generator: torch.Generator, device: str) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_caches = [kv_cache.layer(i) for i in range(kv_cache.spec.num_layers)]
        self.kv_manager = kv_manager
        self.block_size = kv_cache.spec.block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.fallback = fallback_generator
        self.device = device
        # request id -> (the request, draft tokens computed, its num_preemptions then, its draft generator)
        self.state: dict[str, tuple[Request, int, int, torch.Generator | None]] = {}
        self.num_prefill_tokens = 0  # tokens fed to catch up (draft prefills), for the cost figure

    @classmethod
    def load(cls, engine, draft: str) -> DraftModelProposer:
        """Load ``draft`` (a name or directory, as ``LLM(model)``) with the engine's backend, dtype, device and
        block count. Raises ``ValueError`` when its vocabulary differs from the target's."""
        from transformers import AutoTokenizer

        from pdserve.shared.models.loader import load_config, load_model
        from pdserve.shared.models.resolve import resolve_model

        draft_dir = resolve_model(draft)
        mc = load_config(draft_dir)
        check_same_vocabulary(engine.tokenizer, AutoTokenizer.from_pretrained(draft_dir), engine.vocab_size,
                              mc.vocab_size, draft)
        device = engine.config.device
        model = load_model(draft_dir, mc, engine.backend, engine.dtype, device, engine.max_model_len)
        spec = KVCacheSpec.from_model_config(mc, engine.kv_spec.block_size, engine.dtype)
        kv_cache = KVCache(spec, engine.kv_cache.num_blocks, 0, device)
        return cls(model, kv_cache, engine.kv_manager, engine.vocab_size, engine.eos_token_ids,
                   engine.sampler.generator, device)

    def _computed(self, request: Request) -> int:
        """Tokens whose draft KV is valid now (0 when unknown: new, moved, preempted)."""
        state = self.state.get(request.request_id)
        if state is None or state[0] is not request or state[2] != request.num_preemptions:
            return 0
        return min(state[1], request.num_computed_tokens)

    def _generator(self, request: Request) -> torch.Generator | None:
        state = self.state.get(request.request_id)
        if state is not None and state[0] is request:
            return state[3]
        seed = request.sampling_params.seed
        if seed is None:
            return None
        return torch.Generator().manual_seed((seed + request.index + _DRAFT_SEED_OFFSET) % 2**64)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], drafts: Sequence[list[int]]) -> list[torch.Tensor | None]:
        """Overwrite each ``drafts[i]`` (placeholders, length k_i >= 1, slots already allocated) in place with
        the draft's k_i guesses for ``requests[i]`` (decoding: ``num_computed_tokens == num_tokens - 1``).
        Returns per request the draft distributions ``[k_i, V]`` float32 (random rows) or ``None`` (greedy)."""
        self._forget_finished()
        starts = [self._computed(r) for r in requests]
        gens = [self._generator(r) for r in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        # step 0: catch up to the last known token; step j: feed draft j - 1
        feeds = [r.all_token_ids[s:] for r, s in zip(requests, starts)]
        self.num_prefill_tokens += sum(len(f) - 1 for f in feeds)
        for j in range(max(len(d) for d in drafts)):
            live = [i for i, d in enumerate(drafts) if len(d) > j]
            seqs = [(feeds[i] if j == 0 else [drafts[i][j - 1]],
                     starts[i] if j == 0 else requests[i].num_tokens - 1 + j) for i in live]
            logits = self._forward([requests[i] for i in live], seqs)
            tokens, q = self._sample(logits, [requests[i] for i in live], [drafts[i][:j] for i in live],
                                     [gens[i] for i in live])
            for row, i in enumerate(live):
                drafts[i][j] = tokens[row]
                if q[row] is not None:
                    probs[i].append(q[row])
        for i, r in enumerate(requests):
            # draft KV now holds positions up to n - 2 + k_i (the last draft was sampled, never fed)
            self.state[r.request_id] = (r, r.num_tokens - 1 + len(drafts[i]), r.num_preemptions, gens[i])
        return [torch.stack(p) if p else None for p in probs]

    def _forward(self, requests: Sequence[Request], seqs: Sequence[tuple[list[int], int]]) -> torch.Tensor:
        """One draft pass: ``seqs[i] = (tokens, first position)`` over request i's blocks; returns the logits
        ``[len(requests), vocab]`` of each sequence's last position."""
        bs, dev = self.block_size, self.device
        ids, pos, slots, tables, seq_lens, query_lens, last = [], [], [], [], [], [], []
        for request, (tokens, start) in zip(requests, seqs):
            blocks = self.kv_manager.get_block_ids(request.request_id)
            end = start + len(tokens)
            ids.extend(tokens)
            pos.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            tables.append(blocks)
            seq_lens.append(end)
            query_lens.append(len(tokens))
            last.append(len(ids) - 1)
        md = AttentionMetadata.from_lists(slots, tables, seq_lens, query_lens, bs, dev)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                            torch.tensor(pos, dtype=torch.long, device=dev), self.kv_caches, md)
        return self.model.compute_logits(hidden[torch.tensor(last, device=hidden.device)])[:, :self.vocab_size]

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request], drafted: Sequence[list[int]],
                gens: Sequence[torch.Generator | None]) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft token per row: the processed argmax (greedy) or a draw from ``q`` (returned beside it).
        Row i sees ``drafted[i]`` as output (penalties, min_tokens), as the target's verify rows do."""
        md = SamplingMetadata.from_requests(
            [r.sampling_params for r in requests], [r.prompt_token_ids for r in requests],
            [list(r.output_token_ids) + d for r, d in zip(requests, drafted)], [None] * len(requests),
            self.eos_token_ids, self.vocab_size)
        logits = process_logits(logits.float(), md)
        tokens = logits.max(dim=-1).indices.tolist()
        q: list[torch.Tensor | None] = [None] * len(requests)
        if md.random_rows:
            probs = sampling_probs(logits[md.random_rows], md)
            for p, row in zip(probs, md.random_rows):
                exp = exponential_(torch.empty(self.vocab_size, dtype=torch.float32), gens[row] or self.fallback)
                exp = exp.to(p.device)
                tokens[row] = int((p / exp).argmax())
                q[row] = p
        return tokens, q

    def _forget_finished(self) -> None:
        if len(self.state) > 64:
            self.state = {rid: s for rid, s in self.state.items() if not s[0].is_finished}
