"""The engine: requests in, one continuous-batching step at a time, outputs out.

``LLMEngine`` owns the model, the KV cache, the scheduler and the sampler, and is driven by one
thread (the offline ``LLM`` loop, or a worker's engine thread). Besides the usual
``add_request`` / ``step`` / ``abort_request``, it has the disaggregation hooks the prefill and decode
workers use: a *prefill-only* request parks after its first token with its blocks held for export;
a decode pod *reserves* blocks for an incoming request, receives its KV, and *commits* it into the
running batch.
"""

from __future__ import annotations

import logging
import time

import torch

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.detokenizer import IncrementalDetokenizer, check_stop_token
from pdserve.shared.engine.kv_cache import KVCache, KVCacheSpec
from pdserve.shared.engine.kv_cache_manager import KVCacheManager
from pdserve.shared.engine.model_runner import ModelRunner, PromptLogits
from pdserve.shared.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pdserve.shared.engine.request import FINISH_REASONS, Request, RequestStatus
from pdserve.shared.engine.sampler import Sampler, SamplingMetadata, advance_generator
from pdserve.shared.engine.scheduler import Scheduler
from pdserve.shared.engine.spec_decode.spec_decoder import SpecDecoder
from pdserve.shared.engine.swap import SwapManager
from pdserve.shared.models.loader import load_config, load_model
from pdserve.shared.models.resolve import resolve_model
from pdserve.shared.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 256 * 1024**2
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class RequestRejected(ValueError):
    """A request that cannot be served (bad prompt, too long, can never fit). ``param`` names the input."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


def _attention_backend(name: str, device: str):
    from pdserve.kernels.backend import get_attention_backend

    return get_attention_backend(name, device)


class _Group:
    """The ``n`` completions of one user request (n > 1 forks children after the prefill)."""

    __slots__ = ("request_id", "prompt", "params", "members", "detoks", "new", "num_cached_tokens")

    def __init__(self, request_id, prompt, params) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.members: list[Request] = []
        self.detoks: list[IncrementalDetokenizer] = []
        self.new: dict[int, list[int]] = {}
        self.num_cached_tokens = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        model_dir = resolve_model(config.model)
        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_config = load_config(model_dir)
        mc = self.model_config
        device = config.device
        if config.dtype == "auto":
            self.dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        else:
            self.dtype = _DTYPES[config.dtype]
        torch.manual_seed(config.seed)
        self.backend = _attention_backend(config.attention_backend, device)
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        self.kv_spec = KVCacheSpec(mc.num_hidden_layers, mc.num_key_value_heads, head_dim, config.block_size, self.dtype)
        model_max = int(getattr(mc, "max_position_embeddings", 8192))
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif config.kv_cache_memory_bytes is not None:
            num_blocks = 1 + self.kv_spec.num_blocks_for(config.kv_cache_memory_bytes)
        else:  # default: 256 MiB, and at least one full-length sequence
            wanted = config.max_model_len or model_max
            num_blocks = 1 + max(self.kv_spec.num_blocks_for(DEFAULT_KV_CACHE_BYTES), -(-wanted // config.block_size))
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds no KV block "
                             f"({self.kv_spec.bytes_per_block} bytes each)")
        capacity = (num_blocks - 1) * config.block_size
        if config.max_model_len is None:
            self.max_model_len = min(model_max, capacity)
        else:
            if config.max_model_len > model_max:
                raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                                 f"max_position_embeddings={model_max}")
            if config.max_model_len > capacity:
                raise ValueError(f"max_model_len={config.max_model_len} does not fit in the KV cache "
                                 f"({num_blocks - 1} blocks x {config.block_size} = {capacity} tokens); "
                                 "raise kv_cache_memory_bytes or lower max_model_len")
            self.max_model_len = config.max_model_len
        self.model = load_model(model_dir, mc, self.backend, self.dtype, device, self.max_model_len)
        num_cpu_blocks = 0
        if config.preemption_mode == "swap":
            num_cpu_blocks = self.kv_spec.num_blocks_for(config.swap_space_bytes)
        self.kv_cache = KVCache(self.kv_spec, num_blocks, num_cpu_blocks, device)
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                         config.enable_kv_events)
        swap = SwapManager(self.kv_manager, num_cpu_blocks) if num_cpu_blocks else None
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.scheduling_policy, config.preemption_mode, swap)
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv_manager, device)
        self.sampler = Sampler(seed=config.seed)
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = self._eos_ids()
        self.spec = None if config.speculative_config is None else SpecDecoder(
            config.speculative_config, self.sampler.generator, self.eos_token_ids, self.vocab_size, self.max_model_len)
        self.groups: dict[str, _Group] = {}
        self.parked: dict[str, Request] = {}  # prefill-only requests holding blocks for export
        self.reserved: dict[str, Request] = {}  # decode side: blocks reserved for incoming KV
        self.stats = {"prompt_tokens_computed": 0, "prompt_tokens_recomputed": 0, "generation_tokens": 0,
                      "sampled_tokens": 0, "peak_kv_blocks_used": 0,
                      "peak_kv_tokens_live": 0, "peak_num_running": 0, "num_steps": 0}
        logger.info("engine ready: %s %s, %d KV blocks of %d tokens (%.0f MiB), max_model_len %d, backend %s",
                    mc.model_type, str(self.dtype).removeprefix("torch."), num_blocks - 1, config.block_size,
                    num_blocks * self.kv_spec.bytes_per_block / 2**20, self.max_model_len,
                    type(self.backend).__name__)

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        for source in (getattr(self.model_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        try:
            from transformers import GenerationConfig

            gen = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
            ids.update([gen] if isinstance(gen, int) else gen or [])
        except OSError:
            pass
        return frozenset(ids)

    # requests
    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a prompt against this engine; returns the effective ``max_tokens``.

        Raises ``RequestRejected`` (a ``ValueError``) naming the parameter: empty prompt, token ids
        outside the vocabulary, prompt (+ ``max_tokens``) beyond ``max_model_len``. Messages follow
        vLLM's wording so clients that parse them keep working.
        """
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejected("The prompt cannot be empty.", "prompt")
        self._check_vocabulary(prompt_token_ids, "prompt")
        if n >= self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"has {n} tokens, which leaves no room for output.", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion). Please reduce "
                "the length of the prompt or the completion.", "max_tokens")
        return max_tokens

    def _new_request(self, request_id, prompt_token_ids, params, max_tokens, arrival_time, priority, cache_salt,
                     index=0, parent_id=None, prefill_only=False, output_token_ids=()) -> Request:
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator().manual_seed((params.seed + index) % 2**64)
        request = Request(request_id, prompt_token_ids, params, max_tokens, self.eos_token_ids, arrival_time,
                          priority, cache_salt, generator, index, parent_id, prefill_only)
        request.all_token_ids.extend(output_token_ids)
        advance_generator(generator, len(output_token_ids), self.vocab_size)
        return request

    def _check_vocabulary(self, token_ids: list[int], param: str) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"Token id {bad} is out of vocabulary (vocab size {self.vocab_size}).", param)

    def validate_output(self, output_token_ids: list[int], params: SamplingParams, max_tokens: int) -> None:
        """Check the output a resumed request already has (see ``add_request``); raises ``RequestRejected``."""
        self._check_vocabulary(output_token_ids, "output_token_ids")
        if len(output_token_ids) >= max_tokens:
            raise RequestRejected(f"The request already has {len(output_token_ids)} of its {max_tokens} output "
                                  "tokens; nothing is left to generate.", "output_token_ids")
        if output_token_ids and params.n > 1:
            raise RequestRejected("A resumed request continues one completion; n must be 1.", "n")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        prefill_only: bool = False,
        output_token_ids: list[int] | None = None,
        output_text_len: int = 0,
    ) -> None:
        """Queue a request. Raises ``RequestRejected`` when it can never be served, ``ValueError`` on a
        duplicate id. ``prefill_only``: stop after the first token and keep the blocks (``export_kv``).

        ``output_token_ids`` resumes a request that generated these tokens elsewhere (a decode pod that
        died: the router migrates the request with what its client already has). They count as output,
        not prompt: ``max_tokens``/``min_tokens``, penalties, stop strings spanning them and the seeded
        generator (advanced one draw per token, the sampler's rule) continue as if the request had never
        moved. ``output_text_len``: characters of their text the client already has (the rest was held
        back as a possible stop-string prefix and is returned later).
        """
        params = params or SamplingParams()
        if request_id in self.groups or request_id in self.reserved:
            raise ValueError(f"request id {request_id!r} is already in use")
        output_token_ids = list(output_token_ids or ())
        if cache_salt is not None and not cache_salt:
            # block hashes treat "" like no salt: it would share the unsalted tenants' prefix cache
            raise RequestRejected("cache_salt must be a non-empty string when given.", "cache_salt")
        max_tokens = self.validate_prompt(prompt_token_ids, params)
        self.validate_output(output_token_ids, params, max_tokens)
        request = self._new_request(request_id, prompt_token_ids, params, max_tokens, arrival_time, priority,
                                    cache_salt, prefill_only=prefill_only, output_token_ids=output_token_ids)
        group = _Group(request_id, prompt, params)
        self._add_member(group, request, output_text_len)
        self.groups[request_id] = group
        self.scheduler.add_request(request)

    def _add_member(self, group: _Group, request: Request, output_text_len: int = 0) -> None:
        group.members.append(request)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.sampling_params)
        if request.num_output_tokens:
            detok.resume(request.output_token_ids, output_text_len)
        group.detoks.append(detok)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and release everything it holds. Returns whether it existed."""
        found = False
        if request_id in self.reserved:
            self.release_reservation(request_id)
            found = True
        if request_id in self.parked:
            self.release_parked(request_id)
            found = True
        group = self.groups.pop(request_id, None)
        if group is not None:
            for request in group.members:
                if not request.is_finished:
                    self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
            found = True
        return found

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # the step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return outputs for every request that progressed.
        The outputs are snapshots: later steps never change them, so another thread may read them."""
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        if out.is_empty:
            # A step can preempt every running request and schedule nothing (the pool held by reservations or by
            # blocks shared with siblings): its swap-outs must still happen, or the swapped request resumes from
            # CPU blocks that never received its KV (issue 12.B: a seeded choice's text changed under swap).
            self.kv_cache.swap_out(out.blocks_to_swap_out)
            self.kv_cache.copy_blocks(out.blocks_to_copy)
            return []
        for request, n in out.scheduled:
            start, end = request.num_computed_tokens, request.num_computed_tokens + n
            redo = max(0, min(end, request.num_tokens_to_recompute) - start)
            self.stats["prompt_tokens_recomputed"] += redo
            self.stats["prompt_tokens_computed"] += max(0, min(end, request.num_prompt_tokens) - max(
                start, request.num_tokens_to_recompute))
        logits, prompt_logits = self.runner.execute_model(out)
        for chunk in prompt_logits:
            self._record_prompt_logprobs(chunk)
        sampling = self.scheduler.update_after_step(out)
        self._track_peaks()
        if not sampling:
            return []
        # one logits row per plain request, 1 + k rows for one verifying k draft tokens
        plain, rows, verifying, row = [], [], [], 0
        for request in sampling:
            draft = out.spec_token_ids.get(request.request_id)
            if draft:
                verifying.append((request, draft, row))
                row += len(draft) + 1
            else:
                plain.append(request)
                rows.append(row)
                row += 1
        # n > 1: fork the children once the parent's prompt is computed; they sample from its logits row
        for request, row in list(zip(plain, rows)):
            if request.sampling_params.n > 1 and request.num_output_tokens == 0 and request.parent_id is None:
                for child in self._fork(request):
                    plain.append(child)
                    rows.append(row)
        now = time.time()
        touched: dict[str, _Group] = {}
        if plain:
            self._sample(logits if rows == list(range(logits.shape[0])) else logits[torch.tensor(rows)], plain,
                         now, touched)
        if verifying:
            self._verify(logits, verifying, now, touched)
        return [self._make_output(g) for g in touched.values()]

    def _sample(self, logits: torch.Tensor, sampling: list[Request], now: float, touched: dict) -> None:
        md = SamplingMetadata.from_requests(
            [r.sampling_params for r in sampling], [r.prompt_token_ids for r in sampling],
            [r.output_token_ids for r in sampling], [r.generator for r in sampling], self.eos_token_ids,
            self.vocab_size)
        result = self.sampler(logits, md)
        for request, token, lp in zip(sampling, result.sampled_token_ids, result.logprobs):
            self._append_token(request, token, lp, now)
            self._touch(request, touched)

    def _verify(self, logits: torch.Tensor, verifying: list[tuple[Request, list[int], int]], now: float,
                touched: dict) -> None:
        """Speculative step: append each request's accepted drafts and its recovered/bonus token in order (a stop,
        EOS or max_tokens ends the run; later tokens are dropped), then roll ``num_computed_tokens`` back to the
        verified tokens and free the blocks that held only rejected drafts."""
        idx = [r for _, draft, start in verifying for r in range(start, start + len(draft) + 1)]
        requests = [request for request, _, _ in verifying]
        result = self.spec.verify(logits[torch.tensor(idx)], requests, [draft for _, draft, _ in verifying])
        for request, tokens, lps in zip(requests, result.token_ids, result.logprobs):
            request.spec_token_ids = []
            for token, lp in zip(tokens, lps):
                self._append_token(request, token, lp, now)
                if request.is_finished:
                    break
            if not request.is_finished:
                request.num_computed_tokens = request.num_tokens - 1
                self.kv_manager.trim(request, request.num_computed_tokens)
            self._touch(request, touched)

    def _touch(self, request: Request, touched: dict) -> None:
        group = self.groups.get(request.parent_id or request.request_id)
        if group is not None:
            touched[group.request_id] = group

    def _record_prompt_logprobs(self, chunk: PromptLogits) -> None:
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

    def _fork(self, parent: Request) -> list[Request]:
        group = self.groups[parent.request_id]
        children = []
        for i in range(1, parent.sampling_params.n):
            child = self._new_request(f"{parent.request_id}#{i}", parent.prompt_token_ids, parent.sampling_params,
                                      parent.max_tokens, parent.arrival_time, parent.priority, parent.cache_salt,
                                      index=i, parent_id=parent.request_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            self.kv_manager.fork(parent, child)
            self.scheduler.add_running(child)
            self._add_member(group, child)
            children.append(child)
        return children

    def _append_token(self, request: Request, token: int, lp, now: float) -> None:
        request.append_output_token(token)
        self.stats["generation_tokens"] += 1
        self.stats["sampled_tokens"] += 1
        if request.first_token_time is None:
            request.first_token_time = now
        if lp is not None and request.logprobs is not None:
            entry = {tid: Logprob(val, rank + 1) for rank, (tid, val) in enumerate(lp.top)}
            entry[token] = Logprob(lp.logprob, lp.rank)
            request.logprobs.append(entry)
            request.cumulative_logprob += lp.logprob
        group = self.groups.get(request.parent_id or request.request_id)
        group.new.setdefault(request.index, []).append(token)
        params = request.sampling_params
        reason = check_stop_token(token, params, self.eos_token_ids, request.num_output_tokens)
        if reason is None and (request.num_output_tokens >= request.max_tokens
                               or request.num_tokens >= self.max_model_len):
            reason = "length"
        if reason == "stop" and token in params.stop_token_ids:
            request.stop_reason = token
        stop_str = group.detoks[request.index].update([token], stop_terminated=reason == "stop")
        if reason is None and stop_str is not None:
            reason, request.stop_reason = "stop", stop_str
        if reason is not None:
            status = RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH
            self.scheduler.finish_request(request, status)
        elif request.prefill_only:
            self._park(request)

    def _make_output(self, group: _Group) -> RequestOutput:
        outputs = []
        for request, detok in zip(group.members, group.detoks):
            finished = request.is_finished
            new_ids = group.new.pop(request.index, [])
            new_text = detok.get_next_output_text(finished, delta=True)
            # A snapshot: workers format outputs on another thread while the next step appends to the
            # request's lists (sharing them let a logprob entry of step k+1 pair with a token of step k).
            outputs.append(CompletionOutput(
                index=request.index, text=detok.output_text, token_ids=list(request.output_token_ids),
                cumulative_logprob=request.cumulative_logprob,
                logprobs=None if request.logprobs is None else list(request.logprobs),
                finish_reason=FINISH_REASONS.get(request.status), stop_reason=request.stop_reason,
                new_text=new_text, new_token_ids=new_ids))
        first = group.members[0]
        done = all(r.is_finished for r in group.members) and len(group.members) == group.params.n
        prompt_logprobs = first.prompt_logprobs
        if prompt_logprobs is not None and len(prompt_logprobs) < first.num_prompt_tokens:
            prompt_logprobs = None  # not computed here (a decode pod's committed request: the prefill pod has them)
        if done:
            self.groups.pop(group.request_id, None)
        return RequestOutput(group.request_id, group.prompt, first.prompt_token_ids, outputs, done,
                             num_cached_tokens=max(first.num_cached_tokens, 0),
                             metrics={"arrival_time": first.arrival_time, "first_token_time": first.first_token_time,
                                      "num_preemptions": first.num_preemptions},
                             prompt_logprobs=prompt_logprobs)

    def _track_peaks(self) -> None:
        used = self.kv_manager.num_used_blocks
        live = sum(r.num_computed_tokens for r in self.scheduler.running)
        if used > self.stats["peak_kv_blocks_used"]:
            self.stats["peak_kv_blocks_used"] = used
        if live > self.stats["peak_kv_tokens_live"]:
            self.stats["peak_kv_tokens_live"] = live
        self.stats["peak_num_running"] = max(self.stats["peak_num_running"], len(self.scheduler.running))
        self.stats["num_steps"] += 1

    # disaggregation: prefill side
    def _park(self, request: Request) -> None:
        self.scheduler.running.remove(request)
        self.scheduler.requests.pop(request.request_id, None)
        self.parked[request.request_id] = request

    def export_kv(self, request_id: str, first_block: int = 0) -> tuple[list[str], torch.Tensor]:
        """KV of a parked request's computed tokens (its prompt, plus the output of a resumed request; not
        the token just sampled): (hex block hashes of its full blocks,
        ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` for blocks ``first_block:``)."""
        request = self.parked[request_id]
        num_kv_tokens = request.num_tokens - 1
        bs = self.kv_spec.block_size
        ids = self.kv_manager.get_block_ids(request_id)[: -(-num_kv_tokens // bs)]
        hashes = [h.hex() for h in request.update_block_hashes(bs)]
        return hashes[: num_kv_tokens // bs], self.kv_cache.read_blocks(ids[first_block:])

    def release_parked(self, request_id: str) -> None:
        request = self.parked.pop(request_id, None)
        if request is not None:
            request.status = RequestStatus.FINISHED_STOPPED
            self.kv_manager.free(request)
            self.groups.pop(request_id, None)

    # disaggregation: decode side
    def reserve(self, request_id: str, prompt_token_ids: list[int], cache_salt: str | None = None) -> tuple[int, int] | None:
        """Reserve blocks for a prompt whose KV will arrive over the wire.

        Returns ``(num_blocks, num_cached_blocks)``: the leading ``num_cached_blocks`` are prefix-cache
        hits already here (the sender skips them); ``None`` when the pool is short right now.
        The blocks enter the prefix cache only at ``commit`` (their content is not here before).
        """
        if request_id in self.reserved or request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self._new_request(request_id, prompt_token_ids, SamplingParams(max_tokens=1), 1, None, 0, cache_salt)
        computed, num_computed = self.kv_manager.get_computed_blocks(request)
        if self.kv_manager.allocate_slots(request, request.num_tokens - num_computed, computed, cache=False) is None:
            return None
        self.kv_manager.record_prefix_cache_stats(request, num_computed, "transfer")
        request.num_cached_tokens = num_computed
        self.reserved[request_id] = request
        return len(self.kv_manager.req_to_blocks[request_id]), len(computed)

    def write_kv(self, request_id: str, first_block: int, data: torch.Tensor) -> None:
        """Copy received blocks ``[n, layers, 2, block_size, kv_heads, head_dim]`` into the reservation.
        Raises ``KeyError`` when there is none (the request was aborted meanwhile), ``ValueError`` outside it."""
        if request_id not in self.reserved:
            raise KeyError(f"request {request_id!r} holds no reservation here (aborted, or its lease ended)")
        ids = self.kv_manager.get_block_ids(request_id)
        if first_block < 0 or first_block + data.shape[0] > len(ids):
            raise ValueError(f"blocks {first_block}..{first_block + data.shape[0]} outside the reservation of {len(ids)}")
        self.kv_cache.write_blocks(ids[first_block : first_block + data.shape[0]], data)

    def commit(self, request_id: str, first_token_id: int, params: SamplingParams, *, arrival_time: float | None = None,
               priority: int = 0, prompt: str | None = None, output_token_ids: list[int] | None = None,
               output_text_len: int = 0) -> None:
        """The reserved request's KV is complete: it joins the running batch with the token the prefill pod
        sampled. Raises ``KeyError`` without a reservation, ``RequestRejected`` for parameters this engine
        cannot serve (the reservation is then released).

        The reservation holds the KV of every computed token: the prompt, then ``output_token_ids`` for a
        resumed request (``add_request``), which must be the reservation's last tokens. A seeded request's
        generator is advanced past every token sampled elsewhere, so it continues as one engine would.
        """
        reserved = self.reserved.pop(request_id)
        output_token_ids = list(output_token_ids or ())
        tokens = reserved.prompt_token_ids
        split = len(tokens) - len(output_token_ids)
        try:
            if split < 1 or tokens[split:] != output_token_ids:
                raise RequestRejected("output_token_ids must be the last tokens of the reserved KV",
                                      "output_token_ids")
            max_tokens = self.validate_prompt(tokens[:split], params)
            self.validate_output(output_token_ids, params, max_tokens)
        except ValueError:
            self.kv_manager.free(reserved)
            raise
        request = self._new_request(request_id, tokens[:split], params, max_tokens, arrival_time, priority,
                                    reserved.cache_salt, output_token_ids=output_token_ids)
        request.num_computed_tokens = request.num_tokens
        request.num_cached_tokens = reserved.num_cached_tokens
        self.kv_manager.cache_blocks(request, request.num_tokens)
        group = _Group(request_id, prompt, params)
        self._add_member(group, request, output_text_len)
        self.groups[request_id] = group
        self.scheduler.add_running(request)
        self._append_token(request, first_token_id, None, time.time())
        self.stats["sampled_tokens"] -= 1  # the prefill pod sampled it (and counts it)
        advance_generator(request.generator, 1, self.vocab_size)
        group.new.pop(0, None)
        group.detoks[0].get_next_output_text(request.is_finished, delta=True)  # the prefill pod sent it already

    def release_reservation(self, request_id: str) -> None:
        request = self.reserved.pop(request_id, None)
        if request is not None:
            self.kv_manager.free(request)

    # stats
    def get_stats(self) -> dict:
        """Gauges and running totals (tokens unless named otherwise). ``prompt_tokens_computed``: prompt tokens run
        through the model the first time; ``prompt_tokens_recomputed``: tokens run again after a recompute
        preemption; ``generation_tokens``: tokens appended as output (a decode pod counts the first token the prefill
        pod handed over), ``sampled_tokens``: tokens this engine sampled itself; ``prefix_cache_*``: see
        ``PrefixCacheStats``; ``cpu_swap_blocks_*``, ``kv_blocks_swapped_*``: the swap pool (0 under recompute);
        ``spec_decode_*`` (with a ``speculative_config`` only): see ``SpecDecoder.get_stats``."""
        kv = self.kv_manager
        pcs = kv.prefix_cache_stats
        swap = self.scheduler.swap
        live = sum(r.num_computed_tokens for r in self.scheduler.running)
        return {
            "kv_blocks_total": kv.block_pool.num_blocks - 1,
            "kv_blocks_used": kv.num_used_blocks,
            "kv_cache_usage": kv.usage,
            "kv_tokens_live": live,
            "peak_kv_blocks_used": self.stats["peak_kv_blocks_used"],
            "peak_kv_tokens_live": self.stats["peak_kv_tokens_live"],
            "peak_num_running": self.stats["peak_num_running"],
            # new requests' lookups plus a decode pod's reservations (KV not sent); never a recompute's
            "prefix_cache_queries": pcs.queries + pcs.transfer_queries,
            "prefix_cache_hits": pcs.hits + pcs.transfer_hits,
            "prefix_cache_transfer_queries": pcs.transfer_queries,
            "prefix_cache_transfer_hits": pcs.transfer_hits,
            "prefix_cache_preempted_queries": pcs.preempted_queries,
            "prefix_cache_preempted_hits": pcs.preempted_hits,
            "prompt_tokens_computed": self.stats["prompt_tokens_computed"],
            "prompt_tokens_recomputed": self.stats["prompt_tokens_recomputed"],
            "generation_tokens": self.stats["generation_tokens"],
            "sampled_tokens": self.stats["sampled_tokens"],
            "num_preemptions": self.scheduler.num_preemptions,
            "preemption_mode": self.config.preemption_mode,
            "num_requests_swapped": self.scheduler.num_swapped,
            "cpu_swap_blocks_total": swap.num_cpu_blocks if swap is not None else 0,
            "cpu_swap_blocks_used": swap.num_used_cpu_blocks if swap is not None else 0,
            "kv_blocks_swapped_out": self.scheduler.num_blocks_swapped_out,
            "kv_blocks_swapped_in": self.scheduler.num_blocks_swapped_in,
            "enable_prefix_caching": kv.enable_caching,
            "num_running": len(self.scheduler.running),
            "num_waiting": self.scheduler.num_waiting,
            "num_steps": self.stats["num_steps"],
            "block_size": self.kv_spec.block_size,
            "max_model_len": self.max_model_len,
            **(self.spec.get_stats() if self.spec is not None else {}),
        }

