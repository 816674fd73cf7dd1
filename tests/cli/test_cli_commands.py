"""The ``pdserve`` group: every sub-command listed, loaded only when run, a missing one explained."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from pdserve.services import cli


@pytest.mark.slow
def test_help_lists_every_service_without_importing_them():
    code = ("import sys; from pdserve.services.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('IMPORTED', sorted(m for m in sys.modules if m.startswith('pdserve.services.')"
            " and m not in ('pdserve.services.cli',)), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for name in ("bench", "decode", "planner", "prefill", "registry", "router", "up"):
        assert f"\n  {name} " in out, out
    assert out.rstrip().endswith("IMPORTED [] False")


def test_a_missing_module_costs_only_its_own_sub_command(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "ghost", ("pdserve.services.ghost.main:command", "Does not exist."))
    runner = CliRunner()
    result = runner.invoke(cli.main, ["--help"])
    assert result.exit_code == 0 and "ghost" in result.output and "registry" in result.output
    result = runner.invoke(cli.main, ["ghost", "--flag"])
    assert result.exit_code == 1
    assert result.output.strip() == ("Error: 'pdserve ghost' is unavailable: cannot import "
                                     "pdserve.services.ghost.main:command: ModuleNotFoundError: No module named "
                                     "'pdserve.services.ghost'")
    assert runner.invoke(cli.main, ["registry", "--help"]).exit_code == 0


def test_registered_commands_resolve_to_click_commands():
    ctx = click.Context(cli.main)
    for name in ("registry", "up"):
        assert isinstance(cli.main.get_command(ctx, name), click.Command)
    assert cli.main.get_command(ctx, "nope") is None


def test_every_bench_command_in_the_table_resolves_under_its_name():
    from pdserve.loadtest.cli import COMMANDS, bench

    ctx = click.Context(bench)
    for name in COMMANDS:
        cmd = bench.get_command(ctx, name)
        assert isinstance(cmd, click.Command) and "unavailable" not in (cmd.help or ""), name
    assert set(bench.list_commands(ctx)) == set(COMMANDS) | {"serve"}


@pytest.mark.slow  # a fresh interpreter (about 1 s): the only way to see what an import loads
def test_bench_serve_and_the_mock_server_start_without_torch():
    # a fresh interpreter: `pdserve bench serve` is a load-test client and must not pay for the offline benchmarks'
    # imports (torch, transformers: 3 CPU-s per start before the lazy table)
    code = ("import sys, click; from pdserve.loadtest.cli import bench; ctx = click.Context(bench); "
            "[bench.get_command(ctx, n) for n in ('serve', 'mock-server', 'sweep', 'client-overhead')]; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout.strip()) == (0, "[]"), out.stderr[-3000:]
