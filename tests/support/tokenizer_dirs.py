"""Model directories that hold only a tokenizer (and a small config.json), for tests that compare tokenizer loading
paths: a Llama-2-style tokenizer (sentencepiece-like BPE with byte fallback, a BOS added by its post-processor,
Llama 2's chat template with ``bos_token``), built in milliseconds with the ``tokenizers`` trainer and saved by
transformers as a model directory is; and copies of a directory with its tokenizer files rewritten."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Llama 2's chat template (meta-llama/Llama-2-7b-chat-hf), minus its raise_exception for unordered roles
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = '' %}{% endif %}"
    "{% for message in loop_messages %}{% if loop.index0 == 0 %}"
    "{% set content = system_message + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")

CORPUS = ["The capital of France is Paris.", "Ça va? 日本語 🙂 naïve café", "def f(x):\n    return x * 2",
          "Tell me a story about a bridge and a river."]


def make_llama2_style_tokenizer(out: Path) -> Path:
    """A directory with tokenizer.json, tokenizer_config.json (class ``TokenizersBackend``, as transformers 5 saves
    it), chat_template.jinja and config.json (model_type llama). Vocabulary: <unk> <s> </s>, the 256 byte pieces
    <0x00>..<0xFF>, then ~150 trained merges' pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import TokenizersBackend

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    model = json.loads(trained.to_str())["model"]
    vocab = {t: i for i, t in enumerate(specials)} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    hf = TokenizersBackend(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = LLAMA2_TEMPLATE
    hf.save_pretrained(out)
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": len(hf),
                                                 "max_position_embeddings": 512}))
    return out


def copy_tokenizer_dir(src: Path, out: Path, tokenizer_class: str | None = None, model_type: str | None = None,
                       drop: tuple[str, ...] = ()) -> Path:
    """``src``'s files but its weights, with tokenizer_config.json's ``tokenizer_class`` and config.json's
    ``model_type`` replaced where given and the files in ``drop`` left out."""
    out = Path(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", *drop))
    for name, key, value in (("tokenizer_config.json", "tokenizer_class", tokenizer_class),
                             ("config.json", "model_type", model_type)):
        if value is not None:
            data = json.loads((out / name).read_text())
            data[key] = value
            (out / name).write_text(json.dumps(data))
    return out


def write_vocab_and_merges(src: Path, out: Path) -> Path:
    """``src`` (a byte-level BPE model directory) with its tokenizer as GPT-2's older files (vocab.json, merges.txt,
    added tokens in tokenizer_config.json, class ``GPT2Tokenizer``) and no tokenizer.json."""
    out = copy_tokenizer_dir(src, out, drop=("tokenizer.json",))
    tj = json.loads((Path(src) / "tokenizer.json").read_text())
    (out / "vocab.json").write_text(json.dumps(tj["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                                      for t in tj["added_tokens"]}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out
