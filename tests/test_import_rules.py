"""The import rules of docs/design.md §1, as import-linter contracts (``[tool.importlinter]`` in pyproject.toml):
the router and the registry never import the engine, the model code, torch or transformers (beyond the
router's tokenizer); no service imports another service; ``pdserve/shared/`` imports no service, and ``pdserve/shared/protocol``
nothing of pdserve beyond itself. Plus the runtime fact the first rule is for: starting
the router's or the registry's app loads no torch."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    # import-linter's CLI runs logging.config.dictConfig with disable_existing_loggers left True: every logger
    # created so far (pdserve.transport, ...) would stay disabled for the rest of the session, and later tests
    # that read log records (caplog) would see none. Put their state back.
    loggers = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    disabled = {lg: lg.disabled for lg in loggers}
    try:
        assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0
    finally:
        for lg, was in disabled.items():
            lg.disabled = was


@pytest.mark.slow  # a fresh interpreter: the only way to see what an import loads
def test_router_and_registry_apps_load_without_torch():
    # then the router's tokenizer (tokenizer_loader.py): transformers, but still no torch (AutoTokenizer imports it)
    code = ("import sys; import pdserve.services.router.app, pdserve.services.router.main, "
            "pdserve.services.registry.app, pdserve.services.registry.main; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules) + "
            "sorted(m for m in sys.modules if m.startswith('pdserve.shared.engine'))); "
            "from pdserve.services.router.prompts import PromptProcessor; "
            "from pdserve.shared.models.resolve import resolve_model; "
            "p = PromptProcessor(resolve_model('smollm2-135m-instruct')); p.decode(p.tokenizer.encode('hi')); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert (out.returncode, out.stdout.split()) == (0, ["[]", "['transformers']"]), out.stderr[-3000:]
