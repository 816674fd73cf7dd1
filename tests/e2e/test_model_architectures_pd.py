"""The new architectures through the P/D hand-over: ``pdserve up`` (one prefill, one decode worker) serving a tiny
random-weight Mistral whose sliding window (12 tokens) is shorter than the prompts, so both the prefill pod and
the decode pod must mask it, then a tiny Qwen2 and a tiny Qwen3 (q/k norm). (Llama is SmolLM2, which every other
e2e test serves.) Oracle: HF transformers' fp32 greedy tokens, decoded (the offline engine equals them token for
token: ``tests/engine/test_model_architectures.py``)."""

from __future__ import annotations

import pytest

from pdserve.loadtest.cluster import Cluster
from support.tiny_models import hf_greedy_of

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

NEW = 8


@pytest.fixture(scope="module", params=["mistral", "qwen2", "qwen3"])
def arch_dir(request, tiny_model):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory, arch_dir):
    with Cluster("--model", arch_dir, "--prefill", "1", "--decode", "1", "--dtype", "float32",
                 log_dir=tmp_path_factory.mktemp("up"), process=True) as ens:
        yield ens


def test_tiny_model_through_the_handover_equals_hf(ensemble, arch_dir, prompt_of, tokenizer):
    prompts = [prompt_of(20), prompt_of(40, offset=7)]
    want = [tokenizer.decode(ids) for ids in hf_greedy_of(arch_dir, prompts, NEW)]
    client = openai.OpenAI(base_url=f"{ensemble.router_url}/v1", api_key="unused", max_retries=0, timeout=120)
    received_before = ensemble.stats(ensemble.pods("decode")[0])["kv_blocks_received"]
    got = [client.completions.create(model=arch_dir, prompt=p, temperature=0, max_tokens=NEW,
                                     extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    assert got == want
    # the prompts' KV came from the prefill pod: the 40-token prompt alone fills two 16-token blocks
    assert ensemble.stats(ensemble.pods("decode")[0])["kv_blocks_received"] - received_before >= 2
