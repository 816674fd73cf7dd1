"""Settings every engine worker (prefill, decode) reads: CLI flags and ``PDSERVE_*`` variables."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.settings import ServiceSettings


def _default_pod_id() -> str:
    # In Kubernetes the pod name is unique; elsewhere add a suffix so two local workers never collide.
    name = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:63]


class WorkerSettings(ServiceSettings):
    """``--max-num-seqs`` <-> ``PDSERVE_MAX_NUM_SEQS`` and so on (the flags are generated from these fields:
    ``pdserve/shared/settings.py``); ``REDIS_URL`` is accepted as well."""

    host: str = Field("0.0.0.0", description="HTTP bind address.")
    port: int = Field(8003, ge=0, le=65535, description="HTTP port for /health and /metrics.")
    pod_id: str = Field(default_factory=_default_pod_id,
                        description="Unique pod name (default: the host name and a random suffix).")
    # Address other pods use to reach this one (the pod IP in Kubernetes).
    advertise_host: str = Field("127.0.0.1", description="Address other pods reach this one at.")
    redis_url: str = Field("redis://127.0.0.1:6379/0", validation_alias=AliasChoices("PDSERVE_REDIS_URL", "REDIS_URL"),
                           description="Redis URL.")
    registry_url: str = Field("http://127.0.0.1:8001", description="Block registry URL.")
    # The registry's bearer token (PDSERVE_REGISTRY_TOKEN); None for a registry without authentication.
    registry_token: SecretStr | None = Field(None, description=(
        "The registry's bearer token (prefer the variable: a flag shows in ps)."))
    kv_transfer_secret: str = Field("pdserve-dev-secret", description="Shared KV-transfer secret.")
    # vLLM's kv_transfer_config as JSON text: the KV connector both sides of the hand-over use (prefill and decode
    # pods must agree; docs/ensemble.md "KV connectors"). None: tcp.
    kv_transfer_config: str | None = Field(None, description=(
        'KV connector for the P/D hand-over, vLLM\'s JSON: \'{"kv_connector": "shm"}\' (tcp, shm, loopback; '
        'default tcp).'))

    @field_validator("kv_transfer_config")
    @classmethod
    def _known_kv_connector(cls, value: str | None) -> str | None:
        from pdserve.shared.transport.connector import KVTransferConfig  # torch: only when one is set

        if value is not None:
            KVTransferConfig.parse(value)  # a ValueError naming the registered connectors
        return value
    heartbeat_interval_s: float = Field(1.0, gt=0, description="Seconds between heartbeats to the registry.")
    # An engine whose loop finishes no step (nor idle wait) for this long counts as stuck: heartbeats stop (the pod
    # leaves the registry), /health answers 503, a prefill pod stops holding its queue entries. Far above any one
    # step: a long prefill on a loaded CPU is slow, not stuck.
    engine_stall_s: float = Field(300.0, gt=0, description=(
        "An engine with no finished step for this long counts as stuck: no heartbeat, /health 503 (s)."))
    # A request this worker holds with no output for this long gets a keep-alive event on its output stream
    # (pdserve/shared/worker/keepalive.py), so the router's --request-timeout-s (a bound on silence) does not end a request
    # that waits for KV blocks under load (s; silence lasts up to 1.5x this: the router refuses a timeout below 2x it).
    output_keepalive_s: float = Field(5.0, gt=0, description=(
        "A request silent this long gets a keep-alive event to the router (s)."))
    log_level: str = Field("info", description="debug|info|warning|error.")
    # engine
    model: str = Field("smollm2-135m-instruct", description="Model name, HF directory or .gguf.")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="Weights and KV cache dtype (auto: bfloat16 on CUDA, float32 elsewhere).")
    block_size: int = Field(16, ge=1, description="Tokens per KV block.")
    max_model_len: int | None = Field(None, ge=1, description="Context length (default: the model's).")
    max_num_seqs: int = Field(64, ge=1, description="Requests per batch.")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget per step.")
    # vLLM's names (pdserve/shared/engine/scheduler.py): off (0) by default here; prefill pods set their own default
    long_prefill_token_threshold: int = Field(0, ge=0, description=(
        "Tokens a request computes per step at most; prompts with more left are long (0: no cap)."))
    max_long_partial_prefills: int = Field(1, ge=1, description=(
        "Long prompts (over --long-prefill-token-threshold) in prefill at once; shorter ones may pass them."))
    enable_prefix_caching: bool = Field(True, description="Prefix caching.")
    # publish the prefix cache's block events to the registry (KV-aware routing)
    enable_kv_events: bool = Field(True, description=(
        "Publish the prefix cache's block events to the registry (KV-aware routing)."))
    kv_cache_memory: str | None = Field(None, description="KV cache size, e.g. 512MiB.")
    preemption_mode: Literal["recompute", "swap"] = Field("recompute", description=(
        "When KV blocks run out: recompute a preempted request later, or swap its KV to a CPU pool."))
    # offloading tiers below the KV pool (vLLM's names; docs/engine.md "KV offloading tiers")
    kv_offloading_size: float | None = Field(None, ge=0, description=(
        "GiB of host memory for the CPU tier that blocks evicted from the KV pool go to (default: none)."))
    kv_offloading_disk_path: str | None = Field(None, description=(
        "Directory of a local-disk tier below the CPU tier; this pod uses <path>/<pod id>, kept across restarts."))
    kv_offloading_disk_size: float = Field(8.0, gt=0, description="GiB of block files the disk tier may hold.")
    kv_offloading_store_threshold: int = Field(1, ge=1, description=(
        "Admission to the tiers (vLLM's store_threshold): write an evicted block only once requests have looked it "
        "up this many times (2: skip blocks seen once); 1 writes every evicted block."))
    attention_backend: Literal["auto", "cpu", "torch", "triton"] = Field("auto", description="Attention kernels.")
    device: str = Field("cpu", description="cpu|cuda.")
    # CUDA graphs for decode batches (pdserve/shared/engine/cuda_graphs.py); vLLM's names
    enforce_eager: bool = Field(False, description="No CUDA graphs: every step runs eagerly (CUDA only).")
    max_cudagraph_capture_size: int | None = Field(None, ge=1, description=(
        "Largest decode batch captured in a CUDA graph (default: the smaller of 512 and --max-num-seqs)."))
    # vLLM's speculative_config as JSON text, e.g. '{"method": "ngram", "num_speculative_tokens": 4}' (decode pods)
    speculative_config: str | None = Field(None, description=(
        'Speculative decoding (decode pods), vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'.'))
    tensor_parallel_size: int = Field(1, ge=1, description=(
        "Rank processes the model's heads are split over (tensor parallelism; 1: in-process)."))
    # multi-node tensor parallelism (vLLM's names): this pod is node 0 of nnodes and holds the ranks' rendezvous;
    # nodes 1.. are `pdserve tp-worker` pods (pdserve/shared/engine/tp_executor.py; a LeaderWorkerSet in the chart)
    nnodes: int = Field(1, ge=1, description=(
        "Nodes (pods) the tensor-parallel ranks spread over; this pod is node 0, the others run `pdserve tp-worker`."))
    master_port: int = Field(29500, ge=1, le=65535, description=(
        "Port of the tensor-parallel rendezvous this pod holds when --nnodes > 1."))
    tp_join_timeout_s: float = Field(60.0, gt=0, description=(
        "Fail when the other tensor-parallel nodes have not joined within this long (s)."))
    # Engine workers sharing a machine each default to every core they may use, and then fight over them (OpenMP
    # barriers wait on a descheduled sibling); `pdserve up` sets this per worker (its --prefill-threads and
    # --decode-threads, default the cores split among the workers).
    num_threads: int | None = Field(None, ge=1, description=(
        "Torch threads of this worker's engine (default: the cores this process may use)."))

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, dtype=self.dtype, block_size=self.block_size, max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_long_partial_prefills=self.max_long_partial_prefills,
            enable_prefix_caching=self.enable_prefix_caching, kv_cache_memory_bytes=self.kv_cache_memory,
            preemption_mode=self.preemption_mode, attention_backend=self.attention_backend, device=self.device,
            enable_kv_events=self.enable_kv_events and self.enable_prefix_caching,
            speculative_config=self.speculative_config, tensor_parallel_size=self.tensor_parallel_size,
            nnodes=self.nnodes, master_port=self.master_port if self.nnodes > 1 else 0,
            tp_join_timeout_s=self.tp_join_timeout_s, enforce_eager=self.enforce_eager,
            max_cudagraph_capture_size=self.max_cudagraph_capture_size,
            kv_offloading_size=self.kv_offloading_size, kv_offloading_disk_size=self.kv_offloading_disk_size,
            kv_offloading_store_threshold=self.kv_offloading_store_threshold,
            # one directory per pod: a restarted pod (same pod id) finds its own blocks, two pods never mix files
            kv_offloading_disk_path=(os.path.join(self.kv_offloading_disk_path, self.pod_id)
                                     if self.kv_offloading_disk_path else None),
        )
