"""The ``pdserve`` command: one sub-command per service, ``up`` for the whole ensemble, ``bench``."""

from __future__ import annotations

import click


@click.group()
@click.version_option(package_name="pdserve")
def main() -> None:
    """pdserve: disaggregated prefill/decode LLM serving."""


def _register_optional() -> None:
    # Each sub-command lives with the code it runs; a missing optional extra must not break the CLI.
    import importlib

    for module, attr in [
        ("pdserve.loadtest.cli", "bench"),
    ]:
        try:
            main.add_command(getattr(importlib.import_module(module), attr))
        except ImportError:
            pass


_register_optional()

if __name__ == "__main__":
    main()
