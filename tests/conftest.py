"""Makes ``tests/support`` importable as ``support`` and its real-process fixtures available everywhere."""

import atexit
import gc
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["support.fixtures", "support.model_fixtures", "support.tiny_models", "support.tiers", "support.ssl_context"]


def _freeze() -> None:
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session) -> None:
    """What collection imported (torch, transformers, every test module) lives until the run ends, and so do the
    session's fixtures: freezing what survives a module keeps the cyclic garbage collector from scanning those
    millions of objects again at every full collection (about 8 of the fast tier's ~70 s of CPU went to that;
    tests/README.md "Tiers"). A module's own objects are collected before they are frozen. At exit they are
    unfrozen, so that the interpreter's last collection frees them (native extensions such as Triton's report
    what is never freed as leaks)."""
    _freeze()
    atexit.register(gc.unfreeze)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if nextitem is None or nextitem.module is not item.module:
        _freeze()  # after the module's last teardown: its fixtures are gone
