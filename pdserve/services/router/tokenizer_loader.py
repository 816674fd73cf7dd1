"""The router's tokenizer, loaded without torch wherever that gives the tokenizer ``AutoTokenizer`` would give.

transformers 5's ``AutoTokenizer`` reads the model config through ``configuration_utils``, which imports torch:
about 5 of a router start's 7 CPU-seconds and a few hundred MB, in a process that never runs a tensor. When
``AutoTokenizer`` would load a directory's tokenizer as the generic fast class ``TokenizersBackend`` (backed by
the ``tokenizers`` library) anyway, the router loads that class itself: the same class, ``from_pretrained`` and
files, so the same token ids, chat template and decoding. Any other directory (a model-specific tokenizer class,
remote code, no ``tokenizer.json``, Mistral's ``tekken.json``, transformers 4) goes through ``AutoTokenizer`` as
before, with one log line saying why. tests/router/test_tokenizer_loader.py compares both paths; the router process
test checks that torch never loads.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# tokenizer_config.json's names of the generic fast class (transformers 5 saves "TokenizersBackend"; 4.x saved
# "PreTrainedTokenizerFast", an alias of it in 5).
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


class TokenizerLoadError(RuntimeError):
    """The model directory's tokenizer cannot be loaded by either path; the message names the directory and why."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@functools.lru_cache(maxsize=1)
def hub_class_overrides() -> frozenset[str] | None:
    """Model types whose ``tokenizer_config.json`` class ``AutoTokenizer`` overrides with its own registered class
    (transformers' ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``, e.g. ``qwen2`` -> ``Qwen2Tokenizer``), read from
    the installed ``tokenization_auto.py`` without importing it (importing it imports torch). None when the
    installed transformers has no such literal set: the caller then takes the ``AutoTokenizer`` path."""
    try:
        spec = importlib.util.find_spec("transformers.models.auto.tokenization_auto")
        tree = ast.parse(Path(spec.origin).read_text())  # type: ignore[union-attr, arg-type]
    except (ImportError, AttributeError, OSError, SyntaxError, TypeError):
        return None
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS":
            try:
                return frozenset(ast.literal_eval(node.value))  # type: ignore[arg-type]
            except ValueError:
                return None
    return None


def torch_free_refusal(model_dir: Path) -> str | None:
    """None when ``AutoTokenizer.from_pretrained(model_dir)`` would build a plain ``TokenizersBackend`` (its
    transformers 5 rules: the generic class named in ``tokenizer_config.json``, no ``auto_map``, no Mistral
    ``tekken.json``, a model type whose hub class it does not override); else why the router must ask
    ``AutoTokenizer``."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        return "there is no tokenizer.json (a slow tokenizer needs transformers' conversion)"
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    name = tok_config.get("tokenizer_class")
    if name not in GENERIC_CLASSES:
        return f"tokenizer_config.json names tokenizer_class {name!r}, not the generic {GENERIC_CLASSES[0]}"
    if "auto_map" in tok_config:
        return "tokenizer_config.json has an auto_map (a remote-code tokenizer)"
    if (model_dir / "tekken.json").exists():
        return "there is a tekken.json (Mistral's own tokenizer format)"
    overrides = hub_class_overrides()
    if overrides is None:
        return "the installed transformers has no MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS to check against"
    config = _read_json(model_dir / "config.json")
    for key in ("model_type", "model_name"):
        if config.get(key) in overrides:
            return f"AutoTokenizer picks its own tokenizer class for {key} {config[key]!r}"
    return None


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer of ``model_dir`` as ``AutoTokenizer.from_pretrained(model_dir)`` returns it (same class, same
    outputs), without importing torch where :func:`torch_free_refusal` allows. Raises :class:`TokenizerLoadError`
    when neither path can load it."""
    reason = torch_free_refusal(model_dir)
    if reason is None:
        try:
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(model_dir)
        except ImportError:  # transformers 4
            reason = "the installed transformers has no TokenizersBackend (transformers < 5)"
        except Exception as exc:  # anything it refuses, AutoTokenizer gets to try (and to word the error)
            reason = f"TokenizersBackend could not load it ({type(exc).__name__}: {exc})"
    logger.info("loading the tokenizer of %s with AutoTokenizer, which imports torch (a few CPU-seconds): %s",
                model_dir, reason)
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # transformers raises OSError/ValueError/ImportError/... for a tokenizer it cannot build
        raise TokenizerLoadError(f"cannot load the tokenizer of {model_dir}: {type(exc).__name__}: {exc} "
                                 f"(AutoTokenizer was used because {reason})") from exc
