"""The ``pdserve`` command: one sub-command per service, ``up`` for the whole ensemble, ``bench``.

Sub-commands are imported only when run, so ``pdserve --help`` is fast and a module that is
missing (or fails to import) costs only its own sub-command, which then explains why it is unavailable.
"""

from __future__ import annotations

import importlib

import click

# name -> ("module:attribute" of a click command, one-line help shown by ``pdserve --help``)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("pdserve.services.up:command", "Start Redis, registry, router, prefill and decode workers locally."),
    "router": ("pdserve.services.router.main:command", "Run the OpenAI-compatible router."),
    "prefill": ("pdserve.services.prefill.main:command", "Run a prefill worker."),
    "decode": ("pdserve.services.decode.main:command", "Run a decode worker (KV-transfer server + engine)."),
    "registry": ("pdserve.services.registry.main:command", "Run the pod registry."),
    "planner": ("pdserve.services.planner.main:command", "Run the autoscaling planner."),
    "models": ("pdserve.services.models:command", "List the converted models and their folders (tokenizer paths)."),
    "top": ("pdserve.services.top:command", "Live view of a running ensemble: pods, KV usage, queues, TTFT/TPOT."),
    "tp-worker": ("pdserve.services.tp_worker:command", "Run node K >= 1 of a multi-node tensor-parallel engine."),
    "bench": ("pdserve.loadtest.cli:bench", "Benchmark a running deployment."),
}


def _unavailable(name: str, target: str, error: BaseException) -> click.Command:
    reason = f"{type(error).__name__}: {error}"

    @click.command(name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
                   help=f"(unavailable: {reason})", add_help_option=False)
    def stub() -> None:
        raise click.ClickException(f"'pdserve {name}' is unavailable: cannot import {target}: {reason}")

    return stub


class LazyGroup(click.Group):
    def __init__(self, *args, lazy: dict[str, tuple[str, str]], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands:
            return self.commands[name]
        if name not in self.lazy:
            return None
        target = self.lazy[name][0]
        module, _, attr = target.partition(":")
        try:
            cmd = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            return _unavailable(name, target, e)
        if not isinstance(cmd, click.Command):
            return _unavailable(name, target, TypeError(f"{target} is not a click command"))
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # From the table, not by importing every service (torch, the model) just to print help.
        rows = [(name, self.lazy[name][1] if name in self.lazy else (self.commands[name].get_short_help_str()))
                for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, lazy=COMMANDS)
@click.version_option(package_name="pdserve")
def main() -> None:
    """pdserve: disaggregated prefill/decode LLM serving."""


if __name__ == "__main__":
    main()
