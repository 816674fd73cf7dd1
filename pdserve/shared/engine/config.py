"""Engine configuration: one dataclass, the same names as vLLM's engine arguments."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdserve.shared.engine.spec_decode.config import SpeculativeConfig

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_bytes(value: int | str | None) -> int | None:
    """``1073741824``, ``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` -> bytes. Raises ``ValueError`` on junk."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse a byte size from {value!r} (use e.g. 536870912, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(slots=True)
class EngineConfig:
    """What an engine instance is built with.

    model: a known name (``smollm2-135m-instruct``), a local HF directory, or a ``.gguf`` file.
    dtype: ``float32`` | ``bfloat16`` | ``float16`` | ``auto`` (bf16 on CUDA, fp32 elsewhere).
    block_size: tokens per KV block (16, as vLLM's default).
    kv_cache_memory_bytes / num_kv_blocks: size of the KV pool; ``num_kv_blocks`` wins when both are
        set. Neither: 256 MiB, raised to hold at least one ``max_model_len`` sequence.
    max_model_len: context limit per request (prompt + output); default the model's
        ``max_position_embeddings``, capped by what the KV pool holds.
    max_num_seqs: cap on requests in one batch. max_num_batched_tokens: token budget per step
        (decode tokens + prefill chunks), vLLM's chunked-prefill budget.
    enable_prefix_caching: automatic prefix caching by block hash (on by default, as vLLM v1).
    preemption_mode: ``recompute`` (default) or ``swap`` (to a CPU block pool of ``swap_space_bytes``).
    scheduling_policy: ``fcfs`` or ``priority`` (lower value first, then arrival; vLLM's convention), or ``srpt``:
        shortest remaining prefill first, aged by ``srpt_aging_tokens_per_s`` tokens per second waited
        (``scheduler.SRPTQueue``, which states its starvation bound; prefill pods' default).
    long_prefill_token_threshold / max_long_partial_prefills: vLLM's names: with a threshold T > 0, a request computes
        at most T tokens per step and at most ``max_long_partial_prefills`` prompts that started with more than T tokens
        to compute are in prefill at once, so short prompts behind a long one are not held for its whole prefill; under
        ``srpt`` a long prefill also sits out a step for a shorter waiting prompt (``scheduler``).
    attention_backend: ``auto`` | ``cpu`` | ``torch`` | ``triton`` (``pdserve/kernels/backend.py``).
    tensor_parallel_size: ranks (processes) the model's heads are split over, Megatron-style; 1 runs in-process
        (``pdserve/shared/engine/tp_executor.py``).
    nnodes / master_port / tp_join_timeout_s: multi-node tensor parallelism (vLLM's ``--nnodes``,
        ``--master-port``): the ranks spread over ``nnodes`` nodes (pods), ``tensor_parallel_size // nnodes`` each;
        this engine is node 0 and holds the rendezvous (a ``TCPStore``, on every interface) on ``master_port`` (0: a
        free port, one node only); nodes 1.. run ``pdserve tp-worker --node-rank K --master-addr <node 0's address>``
        and must join within ``tp_join_timeout_s`` seconds.
    enforce_eager: vLLM's name: no CUDA graphs, every step runs eagerly. Off (the default), pure-decode steps on CUDA
        with the ``triton`` backend and ``tensor_parallel_size`` 1 replay a graph captured at start-up per padded
        batch size (``pdserve/shared/engine/cuda_graphs.py``); CPU ignores it.
    max_cudagraph_capture_size: the largest decode batch with a graph (vLLM's name; default the smaller of 512 and
        ``max_num_seqs``); larger batches run eagerly.
    kv_offloading_size: GiB of host memory for the CPU offloading tier (vLLM's ``--kv-offloading-size``); blocks
        the prefix cache evicts from the pool go there instead of being dropped (``kv_offload.py``). None: no tier.
    kv_offloading_disk_path / kv_offloading_disk_size: a local-disk tier below it (a directory; GiB of files),
        kept across restarts. Offloading needs prefix caching and ``tensor_parallel_size`` 1 (docs/engine.md
        "KV offloading tiers").
    kv_offloading_store_threshold / kv_offloading_tracker_size: admission (vLLM's ``store_threshold`` and
        ``max_tracker_size``): an evicted block is written to the tiers only once requests have looked it up this
        many times, counted in an LRU table of that many hashes; 1 (the default) writes every evicted block.
    speculative_config: vLLM's dict (or its JSON text), e.g. ``{"method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2}``; parsed into a ``SpeculativeConfig`` (None: off).
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory_bytes: int | str | None = None
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space_bytes: int | str = 256 * 1024**2
    scheduling_policy: str = "fcfs"
    srpt_aging_tokens_per_s: float = 200.0
    long_prefill_token_threshold: int = 0
    max_long_partial_prefills: int = 1
    attention_backend: str = "auto"
    device: str = "cpu"
    seed: int = 0
    enable_kv_events: bool = False
    speculative_config: dict | str | SpeculativeConfig | None = None
    tensor_parallel_size: int = 1
    nnodes: int = 1
    master_port: int = 0
    tp_join_timeout_s: float = 60.0
    enforce_eager: bool = False
    max_cudagraph_capture_size: int | None = None
    kv_offloading_size: float | None = None
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float = 8.0
    kv_offloading_store_threshold: int = 1
    kv_offloading_tracker_size: int = 64000

    def __post_init__(self) -> None:
        self.kv_cache_memory_bytes = parse_bytes(self.kv_cache_memory_bytes)
        self.swap_space_bytes = parse_bytes(self.swap_space_bytes)
        if not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        checks = [
            ("block_size", self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             "a power of two"),
            ("max_num_seqs", self.max_num_seqs >= 1, ">= 1"),
            ("tensor_parallel_size", self.tensor_parallel_size >= 1, ">= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, ">= 1"),
            ("preemption_mode", self.preemption_mode in ("recompute", "swap"), "'recompute' or 'swap'"),
            ("scheduling_policy", self.scheduling_policy in ("fcfs", "priority", "srpt"),
             "'fcfs', 'priority' or 'srpt'"),
            ("srpt_aging_tokens_per_s", self.srpt_aging_tokens_per_s >= 0, ">= 0"),
            ("long_prefill_token_threshold", self.long_prefill_token_threshold >= 0, ">= 0"),
            ("max_long_partial_prefills", self.max_long_partial_prefills >= 1, ">= 1"),
            ("dtype", self.dtype in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"),
             "float32, bfloat16, float16 or auto"),
            ("attention_backend", self.attention_backend in ("auto", "cpu", "torch", "triton"), "auto, cpu, torch or triton"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of nnodes "
                             f"({self.nnodes}): every node runs the same number of ranks")
        if self.nnodes > 1 and not 0 < self.master_port < 65536:
            raise ValueError(f"nnodes={self.nnodes} needs master_port (the rendezvous port the other nodes "
                             f"connect to), got {self.master_port}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}")
        if self.max_cudagraph_capture_size is not None and self.max_cudagraph_capture_size < 1:
            raise ValueError(f"max_cudagraph_capture_size must be >= 1, got {self.max_cudagraph_capture_size}")
        self._check_offloading()
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")

    def _check_offloading(self) -> None:
        if not self.kv_offloading_size and not self.kv_offloading_disk_path:
            return
        if (self.kv_offloading_size or 0) < 0 or self.kv_offloading_disk_size <= 0:
            raise ValueError("kv_offloading_size must be >= 0 and kv_offloading_disk_size > 0 (GiB), got "
                             f"{self.kv_offloading_size} and {self.kv_offloading_disk_size}")
        if self.kv_offloading_store_threshold < 1 or self.kv_offloading_tracker_size < 1:
            raise ValueError("kv_offloading_store_threshold and kv_offloading_tracker_size must be >= 1, got "
                             f"{self.kv_offloading_store_threshold} and {self.kv_offloading_tracker_size}")
        if not self.enable_prefix_caching or self.tensor_parallel_size != 1:
            raise ValueError("KV offloading tiers need enable_prefix_caching and tensor_parallel_size 1")

    def torch_dtype(self):
        """The ``torch.dtype`` that ``dtype`` names (``auto``: bf16 on CUDA, fp32 elsewhere)."""
        import torch  # here, so that reading a config needs no torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return getattr(torch, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(self.dtype, self.dtype))
