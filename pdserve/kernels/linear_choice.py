"""Which CPU product computes a bf16 linear layer, chosen per GEMM shape and row count by measurement.

Three ways to compute ``x @ W^T`` for a bf16 model on CPU, none fastest everywhere:

* ``bf16``: ``F.linear`` in bf16 (oneDNN). Fast where the CPU has AVX512-BF16/AMX and many rows (prefill);
  4-7x slower than fp32 on CPUs without them, where oneDNN converts and accumulates in fp32.
* ``fp32``: ``F.linear`` on an fp32 copy of the weights (MKL's sgemm); twice the weight memory.
* ``skinny``: ``cpu_linear``'s one-pass kernel for up to ``cpu_linear.MAX_ROWS`` rows (decode and verify
  steps), bound by reading the weights once: ``vdpbf16ps`` where ``/proc/cpuinfo`` lists ``avx512_bf16``,
  else fp32 FMAs on the bf16 weights.

At start-up, for every (N, K) of the model and every row bucket (``BUCKETS``: a step of R rows falls in the
first bucket >= R), the candidates are timed in turns on random data of that shape (best of ``REPS`` turns,
this process's torch threads) and the fastest kept. Choices are cached as JSON in
``$PDSERVE_CACHE_DIR/linear_choice`` (default ``~/.cache/pdserve``), in a file keyed by the CPU's flags, torch's
version and the thread count, so a second start measures nothing. ``PDSERVE_CPU_LINEAR=bf16|fp32|skinny``
forces one path for every shape (``skinny`` only up to its row limit; beyond it ``bf16``); ``auto`` (default)
measures. The same idea as oneDNN's and MKL's own per-shape dispatch, lifted one level up to choose between
libraries; vLLM-CPU instead fixes one path per build.

The rows of one step choose its path, so a row's logits may differ in the last bits between a 1-row decode
step and a (k + 1)-row verify step when their buckets chose different paths (forced paths keep them equal:
``skinny`` for up to 16 rows is bit-identical across row counts).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_build, cpu_linear

logger = logging.getLogger(__name__)

PATHS = ("bf16", "fp32", "skinny")
BUCKETS = (1, 4, 8, 16, 64, 256)  # rows; the last also takes every larger step
REPS = 5
ENV = "PDSERVE_CPU_LINEAR"


def bucket_of(rows: int) -> int:
    """The bucket a step of ``rows`` rows falls in: the first of ``BUCKETS`` >= rows, else the last."""
    for b in BUCKETS:
        if rows <= b:
            return b
    return BUCKETS[-1]


def forced_path() -> str | None:
    """``PDSERVE_CPU_LINEAR`` when it forces a path, None for ``auto`` or unset; ValueError naming it otherwise."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value == "auto":
        return None
    if value not in PATHS:
        raise ValueError(f"{ENV}={value!r}: expected one of auto, {', '.join(PATHS)}")
    return value


def skinny_available() -> bool:
    return cpu_linear.load_dpbf16() is not None or cpu_linear.load() is not None


def skinny_bf16(x: torch.Tensor, weight: torch.Tensor, bias32: torch.Tensor | None) -> torch.Tensor:
    """The skinny kernel on a bf16 ``weight`` [N, K]: ``x`` [M <= MAX_ROWS, K] -> [M, N] float32."""
    if cpu_linear.load_dpbf16() is not None:
        return cpu_linear.skinny_linear_dpbf16(x, weight, bias32)
    return cpu_linear.skinny_linear(x, weight, bias32)


def candidates(bucket: int) -> tuple[str, ...]:
    """The paths that apply to a bucket on this machine."""
    skinny = bucket <= cpu_linear.MAX_ROWS and skinny_available()
    return ("bf16", "fp32", "skinny") if skinny else ("bf16", "fp32")


def cache_file() -> Path:
    root = Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve")) / "linear_choice"
    sources = cpu_linear.SOURCE.read_bytes() + cpu_linear.SOURCE_DPBF16.read_bytes()  # a kernel change re-measures
    key = f"{cpu_build.cpu_flags()}|{torch.__version__}|{torch.get_num_threads()}|".encode() + sources
    return root / f"{hashlib.sha256(key).hexdigest()[:16]}.json"


def _time_paths(n: int, k: int, rows: int, paths: tuple[str, ...]) -> dict[str, float]:
    """Best seconds per call of each path on random bf16 data of shape [rows, k] x [n, k], timed in turns."""
    g = torch.Generator().manual_seed(n * 7919 + k)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    w32 = w.float()
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    calls = {"bf16": lambda: F.linear(x, w), "fp32": lambda: F.linear(x.float(), w32).to(torch.bfloat16),
             "skinny": lambda: skinny_bf16(x, w, None).to(torch.bfloat16)}
    times: dict[str, list[float]] = {p: [] for p in paths}
    for p in paths:
        calls[p]()  # warm-up: oneDNN's first call builds its kernel, the C kernel's first call builds the library
    for _ in range(REPS):
        for p in paths:
            t0 = time.perf_counter()
            calls[p]()
            times[p].append(time.perf_counter() - t0)
    return {p: min(ts) for p, ts in times.items()}  # the least disturbed turn: others share this machine


class LinearChooser:
    """Per-shape choices of this process: measured once per (N, K) and cached on disk."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_file()
        self.choices: dict[str, dict[str, str]] = {}  # "NxK" -> {bucket: path}
        self.timings: dict[str, dict[str, dict[str, float]]] = {}
        try:
            data = json.loads(self.path.read_text())
            self.choices, self.timings = data["choices"], data.get("timings", {})
        except (OSError, ValueError, KeyError, TypeError):
            pass
        self.used: dict[str, dict[int, str]] = {}  # the shapes of this process's model, as chosen

    def plan(self, n: int, k: int) -> dict[int, str]:
        """bucket -> path for a bf16 layer of ``n`` outputs and ``k`` inputs."""
        forced = forced_path()
        if forced is not None:
            plan = {b: forced if forced in candidates(b) else "bf16" for b in BUCKETS}
        else:
            plan = self._measured(n, k)
        self.used[f"{n}x{k}"] = plan
        return plan

    def _measured(self, n: int, k: int) -> dict[int, str]:
        key = f"{n}x{k}"
        cached = self.choices.get(key, {})
        if all(str(b) in cached and cached[str(b)] in candidates(b) for b in BUCKETS):
            return {b: cached[str(b)] for b in BUCKETS}
        timings = {str(b): _time_paths(n, k, b, candidates(b)) for b in BUCKETS}
        self.timings[key] = {b: {p: round(s * 1e6, 1) for p, s in t.items()} for b, t in timings.items()}
        self.choices[key] = {b: min(t, key=t.get) for b, t in timings.items()}
        self._save()
        logger.info("CPU linear %s: %s (us per call: %s)", key, self.choices[key], self.timings[key])
        return {b: self.choices[key][str(b)] for b in BUCKETS}

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"choices": self.choices, "timings": self.timings}, indent=1))
            os.replace(tmp, self.path)  # atomic: concurrent pods may race harmlessly
        except OSError as e:
            logger.warning("could not cache CPU linear choices in %s: %s", self.path, e)

    def summary(self) -> dict:
        """What the bench prints: CPU flags of note, the mode, and the chosen path per shape and bucket."""
        flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if cpu_linear.cpu_has(f)]
        return {"cpu_flags": flags, "mode": os.environ.get(ENV, "auto"), "dpbf16": cpu_linear.load_dpbf16() is not None,
                "threads": torch.get_num_threads(),
                "shapes": {s: {str(b): p for b, p in plan.items()} for s, plan in self.used.items()}}


_chooser: LinearChooser | None = None


def chooser() -> LinearChooser:
    global _chooser
    if _chooser is None:
        _chooser = LinearChooser()
    return _chooser


class ChosenLinear(nn.Module):
    """A bf16 ``nn.Linear`` on CPU whose product is chosen per row bucket (``LinearChooser.plan``).

    Keeps the layer's bf16 weights; an fp32 copy only when some bucket chose ``fp32``. ``forward``: ``x`` [M, in]
    bf16 -> [M, out] bf16, the bf16 GEMM's rounding whichever path ran."""

    def __init__(self, linear: nn.Linear, chooser_: LinearChooser | None = None) -> None:
        super().__init__()
        w = linear.weight.detach().contiguous()
        assert w.dtype == torch.bfloat16
        self.weight = nn.Parameter(w, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.bias32 = None if self.bias is None else self.bias.float()
        self.out_features = linear.out_features
        self.plan = (chooser_ or chooser()).plan(w.shape[0], w.shape[1])
        self.weight32 = w.float() if "fp32" in self.plan.values() else None

    def path(self, rows: int) -> str:
        return self.plan[bucket_of(rows)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self.path(x.shape[0]) if x.dim() == 2 else "bf16"
        if path == "skinny":
            return skinny_bf16(x, self.weight, self.bias32).to(x.dtype)
        if path == "fp32":
            return F.linear(x.float(), self.weight32, self.bias32).to(x.dtype)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)
