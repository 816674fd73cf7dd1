"""CUDA graphs for pure-decode steps: one graph per padded batch size; static inputs copied in, output sliced.

The scheme is vLLM v1's (``GPUModelRunner.capture_model`` / ``_dummy_run`` and ``CUDAGraphWrapper``; nano-vllm's
``ModelRunner.capture_cudagraph`` is the same in a page): at start-up, for each batch size of
``cudagraph_capture_sizes`` (1, 2, 4, then every 8 up to ``max_cudagraph_capture_size``), the model's forward over
that many one-token sequences is captured once into a graph that reads static buffers (``input_ids``,
``positions``, ``slot_mapping``, ``block_tables``, ``seq_lens``; ``query_start_loc`` is ``0..size``) and writes a
static output. A decode step of ``n`` sequences then copies its inputs into the first ``n`` rows, pads the rows
``n..size-1`` of the smallest size >= n (token 0 at position 0, slot ``PAD_SLOT_ID`` = -1 so its K/V is written
nowhere, a context of 1 token read from the zeroed null block 0), replays that graph and returns the first ``n``
output rows. Prefill and mixed steps (speculative verify steps too), and batches above the largest size, run
eagerly as before; so does every step on CPU.

Only ``capture`` and the ``replay`` in ``run`` need CUDA. With ``use_cuda_graph=False`` the same buffers, padding
and slicing run the model eagerly instead of replaying: that is how the CPU tests check all of it against the
unpadded engine (tests/engine/test_cuda_graphs.py). ``emulate_replay=True`` goes one step further: each size's
metadata is built once, with the capture's host-side lengths, and reused by every later step, as a graph replays
whatever the host decided (and cached in ``md.cache``) at capture; a backend that is right under it reads only
device tensors for what changes between steps.

What may run inside a graph: no host syncs (``.item()``, ``.tolist()``, ``bool(tensor)``), no shape that depends on
tensor values, and every host-side choice baked at capture must hold for every replay. The Triton backend meets
this: its decode kernel picks ``num_splits`` on the host from ``md.seq_lens_cpu``, so the capture passes
``max_model_len`` for every row (the most splits any replay could want), and the kernel's per-sequence split
arithmetic is right for any shorter context (empty splits weigh 0 in the merge; tests/kernels checks it). The
``torch`` reference backend syncs (``bool(valid.all())``, ``nonzero``), so graphs are used with ``triton`` only.
Graphs are also off under tensor parallelism (the other ranks run each step eagerly from rank 0's messages, and
the all-reduces would have to be captured on every rank together); ``enforce_eager`` turns them off everywhere.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter

import torch

from pdserve.kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

PAD_SLOT_ID = -1  # slot_mapping of a padding row: reshape_and_cache skips it (vLLM's PAD_SLOT_ID)
DEFAULT_MAX_CAPTURE_SIZE = 512  # vLLM's default max_cudagraph_capture_size


def cudagraph_capture_sizes(max_size: int) -> list[int]:
    """vLLM's default list, up to ``max_size``: 1, 2, 4, every 8 up to 256, then every 16; ``max_size`` itself is
    appended when the steps miss it, so a batch of that many always has a graph. Raises ``ValueError`` below 1."""
    if max_size < 1:
        raise ValueError(f"max_cudagraph_capture_size must be >= 1, got {max_size}")
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += list(range(8, min(max_size, 256) + 1, 8)) + list(range(272, max_size + 1, 16))
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


class DecodeGraphRunner:
    """Runs pure-decode steps of up to ``sizes[-1]`` sequences padded to the next size of ``sizes``.

    model: forward(input_ids [T], positions [T], kv_caches, md) -> hidden [T, hidden] (``LlamaForCausalLM``).
    kv_caches: per layer ``(k_cache, v_cache)``, ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    sizes: ascending batch sizes (``cudagraph_capture_sizes``); max_model_len: tokens per sequence, which sizes
    the static block table (``ceil(max_model_len / block_size)`` columns) and the capture's host-side lengths.
    use_cuda_graph: capture and replay (CUDA); False runs the padded batch eagerly (any device).
    emulate_replay: eager only: one metadata object per size, built with the capture's host-side lengths and reused
    by every step (see the module docstring).
    ``steps`` counts the steps run per size.
    """

    def __init__(self, model, kv_caches, sizes: list[int], max_model_len: int, block_size: int, device,
                 use_cuda_graph: bool, emulate_replay: bool = False) -> None:
        if not sizes or sorted(set(sizes)) != list(sizes) or sizes[0] < 1:
            raise ValueError(f"capture sizes must be ascending, distinct and >= 1, got {sizes}")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = list(sizes)
        self.max_size = self.sizes[-1]
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.use_cuda_graph = use_cuda_graph
        self.emulate_replay = emulate_replay
        self._replay_md: dict[int, AttentionMetadata] = {}
        m, dev = self.max_size, torch.device(device)
        self.input_ids = torch.zeros(m, dtype=torch.long, device=dev)
        self.positions = torch.zeros(m, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((m,), PAD_SLOT_ID, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros((m, self.max_blocks), dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(m, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(m + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.steps: Counter = Counter()

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest size >= ``num_seqs``; None above the largest."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def fits(self, md: AttentionMetadata) -> bool:
        """Whether this step runs here: every sequence decodes one token, at most ``sizes[-1]`` of them, and the
        block tables fit the static one."""
        return (0 < md.num_seqs <= self.max_size and all(q == 1 for q in md.query_lens_cpu)
                and md.block_tables.shape[1] <= self.max_blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """hidden ``[num_seqs, hidden]`` of a step that ``fits``: a view of the graph's static output (valid until
        the next step), or the eager padded batch's rows."""
        n = md.num_seqs
        size = self.padded_size(n)
        self._load(input_ids, positions, md, size)
        self.steps[size] += 1
        if self.use_cuda_graph:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        if self.emulate_replay:
            padded = self._replay_md.get(size)
            if padded is None:
                padded = self._replay_md[size] = self._static_md(size, [self.max_model_len] * size)
        else:
            padded = self._static_md(size, list(md.seq_lens_cpu) + [1] * (size - n))
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, padded)[:n]

    def _load(self, input_ids, positions, md: AttentionMetadata, size: int) -> None:
        # rows n..size-1 become padding that writes no K/V and reads the null block; stale table entries of
        # earlier steps are cleared so a row only ever names its own blocks
        n, width = md.num_seqs, md.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:size].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:size].zero_()
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.slot_mapping[n:size].fill_(PAD_SLOT_ID)
        self.block_tables[:size].zero_()
        self.block_tables[:n, :width].copy_(md.block_tables)
        self.seq_lens[:n].copy_(md.seq_lens)
        self.seq_lens[n:size].fill_(1)

    def _static_md(self, size: int, seq_lens_cpu: list[int]) -> AttentionMetadata:
        md = AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size], self.seq_lens[:size],
                               self.query_start_loc[:size + 1], [1] * size, seq_lens_cpu, self.block_size)
        md.cache["qsl"] = list(range(size + 1))
        return md

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture one graph per size, largest first, all in one memory pool (graphs never run concurrently, so
        the intermediates of one may reuse another's). Each size first runs once eagerly, so Triton compiles and
        lazy choices are made outside the capture. Returns the seconds it took. CUDA only."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.input_ids[:size].zero_()
            self.positions[:size].zero_()
            self.slot_mapping[:size].fill_(PAD_SLOT_ID)  # the capture's own runs write nothing
            self.block_tables[:size].zero_()
            self.seq_lens[:size].fill_(1)
            lens = [self.max_model_len] * size  # host-side only: the most decode splits any replay could need
            self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._static_md(size, lens))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches,
                                 self._static_md(size, lens))
            self.graphs[size], self.outputs[size] = graph, out
        torch.cuda.synchronize()
        return time.perf_counter() - start


def build_decode_graphs(config, backend, model, kv_caches, max_model_len: int) -> DecodeGraphRunner | None:
    """The engine's decode graphs for ``config`` (an ``EngineConfig``), captured now; None (and a log line that
    says why) where they do not apply: ``enforce_eager``, a device other than CUDA, tensor parallelism, an
    attention backend other than ``triton``, or a sliding-window layer (the windowed Triton kernels are checked
    against the reference in the interpreter, not yet captured in a graph on a GPU)."""
    if config.enforce_eager or not str(config.device).startswith("cuda"):
        return None
    if config.tensor_parallel_size > 1:
        logger.info("CUDA graphs off: tensor_parallel_size %d (decode steps run eagerly on every rank)",
                    config.tensor_parallel_size)
        return None
    if getattr(backend, "name", None) != "triton":
        logger.warning("CUDA graphs off: attention backend %r syncs with the host; use 'triton' (the default on "
                       "CUDA) for graphs", getattr(backend, "name", backend))
        return None
    if any(getattr(layer.self_attn, "sliding_window", None) for layer in getattr(model, "layers", ())):
        logger.info("CUDA graphs off: sliding-window layers (windowed kernels not yet verified under graph capture)")
        return None
    sizes = cudagraph_capture_sizes(min(config.max_cudagraph_capture_size or DEFAULT_MAX_CAPTURE_SIZE,
                                        config.max_num_seqs))
    runner = DecodeGraphRunner(model, kv_caches, sizes, max_model_len, config.block_size, config.device, True)
    seconds = runner.capture()
    logger.info("CUDA graphs: captured %d decode batch sizes (1..%d) in %.1f s", len(sizes), sizes[-1], seconds)
    return runner
