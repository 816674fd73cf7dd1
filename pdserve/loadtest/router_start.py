"""``pdserve bench router-start``: what one router start costs, for source trees in turns.

    pdserve bench router-start --tree before=/tmp/pdserve-old --tree after=/work/main --turns 3

Each ``--tree NAME=DIR`` is a checkout of this repository (the package ``pdserve`` is its folder ``pdserve/``, or
its root in checkouts older than that layout). A start runs
``python -m pdserve.services.cli router`` with ``PYTHONPATH`` pointing at a temporary folder whose ``pdserve`` links
to that tree, against one ``redis-server`` started here (the router connects at startup; no registry or pod is
needed to become healthy). It counts from launch to the first ``GET /health`` that answers 200 (polled every
0.25 s): the router has imported its app, loaded the model's tokenizer and is listening. Per start: wall seconds, the
process's CPU-seconds (user + system, psutil) at that moment, its RSS, and whether it mapped any file of the torch
package (``/proc/PID/maps``; importing torch maps ``torch/_C``). Trees run in turns (A B A B ...), so a shared
machine's load reaches each alike; the load average is printed before and after.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from pdserve.loadtest.errors import LoadTestError
from pdserve.loadtest.procs import free_port, stop, wait_healthy


def torch_mapped(pid: int) -> bool | None:
    """Whether process ``pid`` has any file of the torch package mapped; None where /proc is not readable."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return any("/torch/" in line.split()[-1] for line in maps if line.strip())
    except OSError:
        return None


def start_once(tree: Path, redis_url: str, model: str, timeout_s: float = 300.0) -> dict:
    """One router start from ``tree``: ``{wall_s, cpu_s, rss_mb, torch}`` at its first healthy ``/health``."""
    import psutil

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pdserve-router-start-") as tmp:
        (Path(tmp) / "pdserve").symlink_to(package_dir(tree).resolve(), target_is_directory=True)
        log_path = Path(tmp) / "router.log"
        env = {**os.environ, "PYTHONPATH": tmp, "PDSERVE_REDIS_URL": redis_url, "PDSERVE_MODEL": model}
        with open(log_path, "wb") as log:
            t0 = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-m", "pdserve.services.cli", "router", "--host", "127.0.0.1",
                                     "--port", str(port), "--registry-url", f"http://127.0.0.1:{free_port()}"],
                                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                wait_healthy(f"http://127.0.0.1:{port}/health", proc, str(log_path), timeout_s)
                wall = time.monotonic() - t0
                p = psutil.Process(proc.pid)
                cpu = p.cpu_times()
                return {"wall_s": wall, "cpu_s": cpu.user + cpu.system, "rss_mb": p.memory_info().rss / 2**20,
                        "torch": torch_mapped(proc.pid)}
            finally:
                stop(proc)


def run_turns(trees: dict[str, Path], turns: int, model: str) -> list[dict]:
    """``turns`` rounds of one start per tree, in the given order each round; one row per start."""
    from pdserve.services.up import redis_executable

    rows = []
    port = free_port()
    redis = subprocess.Popen([redis_executable(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        for turn in range(turns):
            for name, tree in trees.items():
                row = start_once(tree, f"redis://127.0.0.1:{port}/0", model)
                rows.append({"turn": turn + 1, "tree": name, **row})
                click.echo(f"turn {turn + 1} {name:>10}: {row['wall_s']:6.2f} s wall  {row['cpu_s']:6.2f} CPU-s  "
                           f"{row['rss_mb']:6.0f} MB RSS  torch {'yes' if row['torch'] else 'no'}")
    finally:
        redis.terminate()
        redis.wait(10)
    return rows


def package_dir(tree: Path) -> Path | None:
    """The folder that is the package ``pdserve`` in a checkout: ``pdserve/``, or the root in the old layout."""
    for candidate in (tree / "pdserve", tree):
        if (candidate / "services" / "router").is_dir():
            return candidate
    return None


def _parse_trees(values: tuple[str, ...]) -> dict[str, Path]:
    trees = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or package_dir(Path(path)) is None:
            raise click.BadParameter(f"{value!r}: expected NAME=DIR, DIR a checkout of pdserve", param_hint="--tree")
        trees[name] = Path(path)
    return trees


@click.command("router-start")
@click.option("--tree", "tree_args", multiple=True, required=True,
              help="NAME=DIR: a checkout of pdserve to start the router from (repeat; run in turns in this order).")
@click.option("--turns", default=3, show_default=True, type=click.IntRange(1), help="Starts of each tree.")
@click.option("--model", default="smollm2-135m-instruct", show_default=True, help="Model whose tokenizer loads.")
def router_start_command(tree_args: tuple[str, ...], turns: int, model: str) -> None:
    """Wall seconds and CPU-seconds of a router start (launch to healthy), trees in turns (A B A B ...)."""
    trees = _parse_trees(tree_args)
    click.echo(f"load average before: {Path('/proc/loadavg').read_text().strip()}")
    try:
        rows = run_turns(trees, turns, model)
    except LoadTestError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"load average after:  {Path('/proc/loadavg').read_text().strip()}")
    for name in trees:
        mine = [r for r in rows if r["tree"] == name]
        click.echo(f"{name:>10}: median {statistics.median(r['wall_s'] for r in mine):.2f} s wall, "
                   f"{statistics.median(r['cpu_s'] for r in mine):.2f} CPU-s, "
                   f"{statistics.median(r['rss_mb'] for r in mine):.0f} MB RSS over {len(mine)} starts")


if __name__ == "__main__":
    router_start_command()
