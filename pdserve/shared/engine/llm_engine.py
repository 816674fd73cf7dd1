"""The engine: requests in, one continuous-batching step at a time, outputs out.

``LLMEngine`` is a facade over the nouns that do the work: ``InputProcessor`` (checks, ``Request``s),
``Scheduler`` + ``KVCacheManager`` (who runs, which blocks), ``ModelRunner`` (one forward pass), ``Sampler``
and ``OutputProcessor`` (text, stops, ``RequestOutput``s). One thread drives it (the offline ``LLM`` loop, or
a worker's engine thread). Disaggregation lives in ``handover``: a *prefill-only* request parks after its first
token and is exported (``take_exports``); a decode pod *reserves* blocks for an incoming request, receives its
KV and *commits* it into the running batch.

``n > 1`` is vLLM v1's: the ``n`` choices are sibling requests (``request_id``, ``request_id#1``, ...) that
share the first one's full prompt blocks through the prefix cache, as the router's choices do across pods.
"""

from __future__ import annotations

import logging
import time

import torch

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.handover import DecodeImport, Export, PrefillExport
from pdserve.shared.engine.input_processor import InputProcessor, RequestRejected, eos_token_ids
from pdserve.shared.engine.cuda_graphs import build_decode_graphs
from pdserve.shared.engine.executor import build_executor
from pdserve.shared.engine.kv_cache import KVCacheSpec
from pdserve.shared.engine.kv_cache_manager import KVCacheManager
from pdserve.shared.engine.kv_offload import build_offload
from pdserve.shared.engine.model_runner import ModelRunner
from pdserve.shared.engine.output_processor import OutputProcessor
from pdserve.shared.engine.outputs import RequestOutput
from pdserve.shared.engine.request import Request, RequestStatus
from pdserve.shared.engine.sampler import Sampler, SamplingMetadata, advance_generator
from pdserve.shared.protocol.sampling_params import SamplingParams
from pdserve.shared.engine.scheduler import Scheduler
from pdserve.shared.engine.spec_decode.draft_model import draft_kv_bytes_per_block
from pdserve.shared.engine.spec_decode.spec_decoder import SpecDecoder, split_logits_rows
from pdserve.shared.engine.step_log import StepLog
from pdserve.shared.engine.stats import EngineCounters, EngineStats, kv_and_scheduler_stats
from pdserve.shared.engine.structured_output import StructuredOutputManager
from pdserve.shared.engine.swap import SwapManager
from pdserve.shared.models.loader import load_config
from pdserve.shared.models.sliding_window import block_freeing_window
from pdserve.shared.models.resolve import resolve_model

__all__ = ["LLMEngine", "RequestRejected"]

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.model_dir = resolve_model(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model_config = mc = load_config(self.model_dir)
        self.dtype = config.torch_dtype()
        torch.manual_seed(config.seed)
        self.kv_spec = KVCacheSpec.from_model_config(mc, config.block_size, self.dtype)
        ex = build_executor(config, self.model_dir, mc, self.dtype, self.kv_spec,
                            draft_kv_bytes_per_block(config.speculative_config, config.block_size, self.dtype))
        self.backend, self.model, self.kv_cache, self.tp, plan = ex.backend, ex.model, ex.kv_cache, ex.tp, ex.plan
        self.max_model_len = plan.max_model_len
        self.kv_manager = KVCacheManager(plan.num_blocks, config.block_size, config.enable_prefix_caching,
                                         config.enable_kv_events, block_freeing_window(mc, config))
        self.offload = build_offload(config, self.model_dir, self.kv_spec, self.kv_cache)
        if self.offload is not None:
            self.kv_manager.set_offload(self.offload)
        swap = SwapManager(self.kv_manager, plan.num_cpu_blocks) if plan.num_cpu_blocks else None
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.scheduling_policy, config.preemption_mode, swap,
                                   config.srpt_aging_tokens_per_s, config.long_prefill_token_threshold,
                                   config.max_long_partial_prefills)
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv_manager, config.device)
        self.runner.graphs = build_decode_graphs(config, self.backend, self.model, self.runner.kv_caches,
                                                 self.max_model_len)
        self.sampler = Sampler(seed=config.seed)
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = eos_token_ids(mc, self.tokenizer, self.model_dir)
        self.spec = SpecDecoder.for_engine(self)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.input = InputProcessor(self.vocab_size, self.max_model_len, self.eos_token_ids)
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self._steps_timed = 0  # EngineCounters.num_steps when ``step`` last added to ``busy_seconds``
        self.prefill_export = PrefillExport(self.scheduler, self.kv_manager, self.kv_cache)
        self.decode_import = DecodeImport(self.scheduler, self.kv_manager, self.kv_cache)
        self.stats = EngineCounters()
        self.step_log: StepLog | None = None  # what each step ran, for tracing; a worker sets one when tracing is on
        logger.info("engine ready: %s %s, %d KV blocks of %d tokens (%.0f MiB), max_model_len %d, backend %s, "
                    "CUDA graphs %s", mc.model_type, str(self.dtype).removeprefix("torch."), plan.num_blocks - 1,
                    config.block_size, plan.num_blocks * self.kv_spec.bytes_per_block / 2**20, self.max_model_len,
                    type(self.backend).__name__,
                    f"1..{self.runner.graphs.max_size}" if self.runner.graphs is not None else "off")

    # requests
    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a prompt against this engine; returns the effective ``max_tokens``. Raises ``RequestRejected``
        (a ``ValueError``) naming the parameter (see ``InputProcessor.validate_prompt``; ``structured_outputs``
        when its spec does not parse)."""
        max_tokens = self.input.validate_prompt(prompt_token_ids, params)
        self.structured.grammar_for(params)  # starts the compile early; cached for add_request
        return max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None, *,
                    prompt: str | None = None, arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, prefill_only: bool = False,
                    output_token_ids: list[int] | None = None, output_text_len: int = 0) -> None:
        """Queue a request (its ``n`` choices). Raises ``RequestRejected`` when it can never be served,
        ``ValueError`` on a duplicate id. ``prefill_only``: stop after the first token and keep the blocks for
        ``take_exports``.

        ``output_token_ids`` resumes a request that generated these tokens elsewhere (a decode pod that died:
        the router migrates the request with what its client already has). They count as output, not prompt:
        ``max_tokens``/``min_tokens``, penalties, stop strings spanning them and the seeded generator continue
        as if the request had never moved. ``output_text_len``: characters of their text the client already has
        (the rest was held back as a possible stop-string prefix and is returned later).
        """
        params = self._with_bad_words_token_ids(params or SamplingParams())
        if self.owns(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        output_token_ids = list(output_token_ids or ())
        max_tokens = self.input.validate(prompt_token_ids, params, cache_salt, output_token_ids)
        choices = [self.input.new_request(
            request_id if i == 0 else f"{request_id}#{i}", prompt_token_ids, params, max_tokens,
            arrival_time=arrival_time, priority=priority, cache_salt=cache_salt, index=i,
            parent_id=None if i == 0 else request_id, prefill_only=prefill_only, output_token_ids=output_token_ids)
            for i in range(params.n)]
        for choice in choices:  # a matcher per sequence; the first call rejects a spec that does not parse
            choice.grammar = self.structured.grammar_for(params)
        for choice in choices[1:]:
            choice.prompt_logprobs = None  # the first choice computes them; the others may hit its prompt blocks
        self.output.add_request(request_id, prompt, params, choices, output_text_len)
        for choice in choices:
            if choice.grammar is not None and not choice.grammar.is_ready:
                self.structured.pending.append(choice)  # joins the scheduler when compiled (step)
            else:
                self.scheduler.add_request(choice)

    def _with_bad_words_token_ids(self, params: SamplingParams) -> SamplingParams:
        """``params`` with ``bad_words`` tokenized by this model's tokenizer (the router sends them tokenized;
        offline callers give words only). A copy, so the caller's object (maybe shared by prompts) stays."""
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        params = params.clone()
        params.update_from_tokenizer(self.tokenizer)
        return params

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and release everything it holds. Returns whether it existed."""
        found = self.decode_import.release(request_id)
        found = self.prefill_export.release(request_id) or found
        state = self.output.pop(request_id)
        if state is not None:
            compiling = self.structured.discard(state.members)
            compiling.update(r.request_id for r in self.decode_import.discard(state.members))  # its tier load
            for request in state.members:
                if request.request_id in compiling:
                    if request.status == RequestStatus.RUNNING:  # a committed hand-over holds its blocks
                        self.kv_manager.free(request)
                    request.status = RequestStatus.FINISHED_ABORTED  # otherwise never scheduled: holds nothing
                elif not request.is_finished:
                    self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return found or state is not None

    def owns(self, request_id: str) -> bool:
        """Whether the engine holds anything for ``request_id``: a queued, running or parked request, or a
        reservation. Safe to call from another thread (dictionary lookups only)."""
        return request_id in self.output or request_id in self.decode_import or request_id in self.prefill_export

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self.structured.pending)
                or bool(self.decode_import.loading))

    @property
    def num_waiting(self) -> int:
        """Requests waiting for blocks or a batch slot (new, preempted, swapped) or for their grammar."""
        return self.scheduler.num_waiting + len(self.structured.pending)

    # the step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return outputs for every request that progressed.
        The outputs are snapshots: later steps never change them, so another thread may read them. With a
        ``step_log``, the step's prefill chunks and preemptions are recorded there (tracing)."""
        started = time.perf_counter()
        outputs = self._step()
        if self.stats.num_steps != self._steps_timed:  # a step that ran the model (``_step`` returns early otherwise)
            self._steps_timed = self.stats.num_steps
            self.stats.busy_seconds += time.perf_counter() - started
        if self.step_log is not None:
            self.step_log.end()
        return outputs

    def _step(self) -> list[RequestOutput]:
        for request in self.decode_import.take_loaded():  # committed hand-overs whose tier load is in
            if request.grammar is not None and not request.grammar.is_ready:
                self.structured.pending.append(request)
            else:
                self.scheduler.add_running(request)
        for request in self.structured.take_ready():
            if request.status == RequestStatus.RUNNING:  # committed from a hand-over: its KV is all there
                self.scheduler.add_running(request)
            else:
                self.scheduler.add_request(request)
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        if self.step_log is not None:
            self.step_log.begin(out)
        if out.is_empty:
            self.structured.wait_any(0.05)  # nothing to run but grammars compiling: no busy loop
            if self.kv_manager.loads:
                self.kv_manager.loads.wait_any(0.05)  # nothing to run but blocks loading from a tier: likewise
            # A step can preempt every running request and schedule nothing (the pool held by reservations): its
            # swap-outs must still happen, or the swapped request resumes from CPU blocks that never received
            # its KV (otherwise a seeded choice's text changed under swap).
            self.kv_cache.swap_out(out.blocks_to_swap_out)
            return []
        self.stats.count_scheduled(out)
        if self.spec is not None:
            self.spec.fill_drafts(out)  # a draft model proposes into the slots just allocated
        logits, prompt_logits = self.runner.execute_model(out)
        for chunk in prompt_logits:
            self.output.record_prompt_logprobs(chunk)
        sampling = self.scheduler.update_after_step(out)
        self.stats.track_peaks(self.scheduler, self.kv_manager)
        if not sampling:
            return []
        plain, rows, verifying = split_logits_rows(sampling, out.spec_token_ids)
        now = time.time()
        if plain:
            self._sample(logits if rows == list(range(logits.shape[0])) else logits[torch.tensor(rows)], plain, now)
        if verifying:
            self.spec.verify_and_append(logits, verifying, lambda r, token, lp: self._append_token(r, token, lp, now),
                                        self.kv_manager)
        return self.output.take_outputs()

    def _sample(self, logits: torch.Tensor, sampling: list[Request], now: float) -> None:
        md = SamplingMetadata.from_requests(
            [r.sampling_params for r in sampling], [r.prompt_token_ids for r in sampling],
            [r.output_token_ids for r in sampling], [r.generator for r in sampling], self.eos_token_ids,
            self.vocab_size, grammars=[r.grammar for r in sampling])
        result = self.sampler(logits, md)
        for request, token, lp in zip(sampling, result.sampled_token_ids, result.logprobs):
            self._append_token(request, token, lp, now)

    def _append_token(self, request: Request, token: int, lp, now: float, sampled_here: bool = True) -> None:
        """``sampled_here``: False for a hand-over's first token (the prefill pod sampled and counts it)."""
        self.stats.sampled_tokens += sampled_here
        reason = self.output.append_token(request, token, lp, now)
        # the matcher advances on each accepted token; one still compiling (a decode pod's commit) replays the whole
        # output at its first mask instead of blocking here
        if request.grammar is not None and request.grammar.is_ready:
            request.grammar.sync(request.output_token_ids)
            if reason is None and request.grammar.is_terminated:
                reason = "stop"
        self.stats.generation_tokens += 1
        if reason is not None:
            status = RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH
            self.scheduler.finish_request(request, status)
        elif request.prefill_only:
            self.prefill_export.park(request)

    # disaggregation: prefill side
    def take_exports(self) -> dict[str, Export]:
        """KV of every request parked since the last call, its blocks released (they stay in the prefix cache):
        ``{request_id: (hex hashes of its full blocks, [n, layers, 2, block_size, kv_heads, head_dim])}``."""
        exports = self.prefill_export.take_exports()
        for request_id in exports:
            self.output.pop(request_id)
        return exports

    # disaggregation: decode side
    def reserve(self, request_id: str, prompt_token_ids: list[int],
                cache_salt: str | None = None) -> tuple[int, int] | None:
        """Reserve blocks for a prompt whose KV will arrive over the wire: ``(num_blocks, num_cached_blocks)``,
        or ``None`` when the pool is short right now (``DecodeImport.reserve``). Cached blocks include those the
        offloading tiers hold: they load while the batch keeps stepping, and the committed request joins the batch
        once they are in."""
        if self.owns(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        placeholder = self.input.new_request(request_id, prompt_token_ids, SamplingParams(max_tokens=1), 1,
                                             cache_salt=cache_salt)
        return self.decode_import.reserve(placeholder)

    def write_kv(self, request_id: str, first_block: int, data: torch.Tensor) -> None:
        """Copy received blocks ``[n, layers, 2, block_size, kv_heads, head_dim]`` into the reservation.
        Raises ``KeyError`` when there is none (the request was aborted meanwhile), ``ValueError`` outside it."""
        self.decode_import.write_kv(request_id, first_block, data)

    def commit(self, request_id: str, first_token_id: int, params: SamplingParams, *, arrival_time: float | None = None,
               priority: int = 0, prompt: str | None = None, output_token_ids: list[int] | None = None,
               output_text_len: int = 0) -> None:
        """The reserved request's KV is complete: it joins the running batch with the token the prefill pod
        sampled. Raises ``KeyError`` without a reservation, ``RequestRejected`` for parameters this engine
        cannot serve (the reservation is then released). A resumed request's ``output_token_ids`` must be the
        reservation's last tokens; a seeded generator skips every token sampled elsewhere."""
        output_token_ids = list(output_token_ids or ())
        params = self._with_bad_words_token_ids(params)

        def build(prompt_token_ids: list[int], cache_salt: str | None) -> Request:
            max_tokens = self.input.validate_prompt(prompt_token_ids, params)
            self.input.validate_output(output_token_ids, params, max_tokens)
            request = self.input.new_request(request_id, prompt_token_ids, params, max_tokens,
                                             arrival_time=arrival_time, priority=priority, cache_salt=cache_salt,
                                             output_token_ids=output_token_ids)
            # the grammar's state is rebuilt by replaying the output (structured_output.py)
            request.grammar = self.structured.grammar_for(params)
            return request

        request = self.decode_import.commit(request_id, output_token_ids, build)
        self.output.add_request(request_id, prompt, params, [request], output_text_len)
        self._append_token(request, first_token_id, None, time.time(), sampled_here=False)
        advance_generator(request.generator, 1, self.vocab_size)  # keep a seeded generator in step
        self.output.mark_sent(request)  # the prefill pod sent it already
        if request in self.decode_import.loading:
            if request.is_finished:  # by its first token: its blocks are freed already (the load's once it is done)
                self.decode_import.discard([request])
            else:  # its tier load is not in yet: out of the batch until ``step`` finds it in; the batch keeps stepping
                self.scheduler.detach(request)
        elif request.grammar is not None and not request.grammar.is_ready and not request.is_finished:
            # a first compile on this pod: the request keeps its blocks but leaves the batch until it is compiled
            # (``step`` puts it back), so the batch keeps stepping
            self.scheduler.detach(request)
            self.structured.pending.append(request)

    def release_reservation(self, request_id: str) -> None:
        self.decode_import.release(request_id)

    # the prefix cache, for the block registry
    def kv_events(self) -> list:
        """``KVCacheEvent``s (blocks stored in / removed from the prefix cache) since the last call."""
        return self.kv_manager.take_events()

    def cached_block_hashes(self) -> list[bytes]:
        """Every block hash in the prefix cache now."""
        return self.kv_manager.cached_block_hashes()

    def offloaded_block_hashes(self) -> dict[str, list[bytes]]:
        """Every block hash the offloading tiers hold now: ``{"cpu": [...], "disk": [...]}`` ({} without tiers)."""
        return self.offload.hashes() if self.offload is not None else {}

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (removals go out as KV events); False, and nothing done, while requests hold blocks."""
        return self.kv_manager.reset_prefix_cache()

    # stats
    def get_stats(self) -> EngineStats:
        """Gauges and running totals now (``EngineStats``); ``peak_*`` since the last ``stats.reset_peaks()``."""
        return EngineStats(**kv_and_scheduler_stats(self.scheduler, self.kv_manager), **self.stats.as_dict(),
                           block_size=self.kv_spec.block_size, max_model_len=self.max_model_len,
                           tensor_parallel_size=self.config.tensor_parallel_size,
                           offload=self.offload.tier_stats() if self.offload is not None else {},
                           **(self.spec.get_stats() if self.spec is not None else {}))
