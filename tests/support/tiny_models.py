"""Tiny random-weight models of every supported architecture, built with transformers' own config and model
classes and saved locally (no weights can be downloaded here), with the SmolLM2 tokenizer.

``tiny_model("qwen3")`` -> the directory of a 2-layer, hidden-64 model; built once per session."""

from __future__ import annotations

import pytest

# 4 query heads and 2 KV heads of 16 dims: tensor parallelism at 2 splits both
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
SLIDING_WINDOW = 12  # Mistral's window: shorter than the test prompts

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": SLIDING_WINDOW}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


def build_tiny_model(arch: str, out, tokenizer_dir, seed: int = 0) -> None:
    """Save a random-weight ``arch`` model (fp32 safetensors) and the tokenizer into ``out``."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    config_cls, model_cls, extra = ARCHS[arch]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = getattr(transformers, config_cls)(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                               eos_token_id=tok.eos_token_id, **COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():  # wider weights than the 0.02 init (logits far apart, so greedy ties are rare); biases and
        for p in model.parameters():  # norm weights off their zero / one init, so that each one counts
            if p.dim() == 2:
                p.mul_(4.0)
            else:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(out)
    tok.save_pretrained(out)


_HF_CACHE: dict = {}


def hf_greedy_of(model_dir, prompts, new: int, dtype: str = "float32") -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt in ``dtype`` (default fp32), exactly ``new`` tokens (EOS
    not stopping it); computed once per session for the same arguments."""
    key = (str(model_dir), tuple(map(tuple, prompts)), new, dtype)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = _hf_greedy(model_dir, prompts, new, dtype)
    return _HF_CACHE[key]


def _hf_greedy(model_dir, prompts, new: int, dtype: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, model_dir):
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            build_tiny_model(arch, out, model_dir)
            built[arch] = str(out)
        return built[arch]

    return get
