"""Local or remote prefill for one placed prompt: a policy of named filters, scorers and a picker (llm-d's
scheduler shape), chosen by name (``--pd-policy``; ``POLICIES``). A new policy is one class here plus its name.

The two paths: the chosen decode pod prefills the prompt itself ("local": its own stream) or the prefill tier
does and hands the KV over ("remote": ``pdserve:{q-prefill}:queue``). Filters drop a path that must not be taken, in order;
the first filter that leaves one path decides it, and its name is the decision's reason. When both remain, the
scorers estimate each path's TTFT and the picker takes one.

``queue-aware`` (default) estimates, with ``r`` the prefill rate of one pod (the prefill pods' measured prompt
tokens per second of engine steps, ``PodInfo.prefill_tokens_per_s``; ``--prefill-tokens-per-s`` until one is
measured), ``S`` the tokens to prefill, ``Q`` the tokens the ``P`` live prefill pods hold and have not prefilled
(``PodInfo.queued_prefill_tokens``), ``Q_long`` those of long prompts (over the pods' ``long_prefill_token_threshold``
``T``), ``B`` a decode pod's step budget (``--max-num-batched-tokens``) and ``R`` the chosen decode pod's running +
waiting requests (each one decode token per step):

    ahead       = (Q - Q_long) / P + min(Q_long / P, T)   for S <= T (long prompts prefill T tokens a step, one at
                = Q / P                                   otherwise   a time, and shorter prompts pass them)
    TTFT_remote = (ahead + S) / r
    TTFT_local  = S / (r * slack / B),      slack = max(B - R, 1)   (its steps give decodes their tokens first)
    step_local  = (R + min(S, slack)) / r_set                       (a step of that pod while it prefills S;
                                                                     r_set = --prefill-tokens-per-s)

Local is dropped when the pod has running requests and ``step_local`` exceeds ``--tpot-slo-ms`` (their TPOT). Remote is kept when ``TTFT_remote`` meets ``--ttft-slo-ms`` (the
decode pods stay free for decoding); otherwise the lower estimate wins, remote on a tie (with an idle tier the
estimates are equal: remote). ``threshold`` is the rule before it: local only at or under the threshold, or for a
short prompt with no prefill pod alive.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

logger = logging.getLogger(__name__)

LOCAL, REMOTE = "local", "remote"
# the ``reason`` label of pdserve:pd_decisions_total: a filter's or a picker's name, nothing else
REASONS: tuple[str, ...] = ("colocated", "threshold", "no_prefill_pod", "tpot_slo", "ttft_slo_met", "lower_ttft",
                            "default")


@dataclass(slots=True)
class PrefillTier:
    """The prefill tier as the last registry answer shows it: live pods, the tokens they hold to prefill (all, and
    those of long prompts), the pods' long-prompt threshold (0: none) and their measured prefill rate (tokens/s per
    pod; 0: none measured yet)."""

    pods: int
    queued_tokens: int = 0
    queued_long_tokens: int = 0
    long_threshold: int = 0
    tokens_per_s: float = 0.0

    @classmethod
    def of(cls, pods: Sequence[Any], count: int | None = None) -> PrefillTier:
        """From the registry's prefill pods (``count``: a fresher pod count, e.g. the kv lookup's)."""
        def total(name: str) -> int:
            return sum(int(getattr(p, name, 0) or 0) for p in pods)

        rates = [float(getattr(p, "prefill_tokens_per_s", 0) or 0) for p in pods]
        rates = [r for r in rates if r > 0]
        return cls(len(pods) if count is None else count, total("queued_prefill_tokens"),
                   total("queued_long_prefill_tokens"),
                   max((int(getattr(p, "long_prefill_token_threshold", 0) or 0) for p in pods), default=0),
                   sum(rates) / len(rates) if rates else 0.0)

    def ahead(self, tokens: int) -> float:
        """Tokens a prompt of ``tokens`` waits for on one pod: its share of the queue, of which a prompt at or under
        the long threshold waits for only one chunk of the long prompts (they prefill a chunk per step while shorter
        ones pass them: ``scheduler``'s long_prefill_token_threshold)."""
        pods = max(self.pods, 1)
        if 0 < tokens <= self.long_threshold:
            short = (self.queued_tokens - self.queued_long_tokens) / pods
            return short + min(self.queued_long_tokens / pods, self.long_threshold)
        return self.queued_tokens / pods


@dataclass(slots=True)
class PrefillCase:
    """One decision's inputs: the chosen decode ``pod`` (its registry record), ``tokens`` to prefill on it (the
    uncached suffix in kv mode, else the prompt) and the prefill ``tier``."""

    pod: Any
    tokens: int
    tier: PrefillTier


@dataclass(slots=True)
class PolicyConfig:
    """Token counts, ``*_ms`` in ms (0: no SLO), ``prefill_tokens_per_s`` per pod, ``step_budget_tokens``: a
    decode pod's tokens per step."""

    local_prefill_threshold: int = 0
    fallback_max_tokens: int = 256
    ttft_slo_ms: float = 2000.0
    tpot_slo_ms: float = 100.0
    prefill_tokens_per_s: float = 1000.0
    step_budget_tokens: int = 2048


@dataclass(slots=True)
class Decision:
    """``local``: the decode pod prefills; ``reason``: one of ``REASONS``; ``detail``: for the log and the
    placement; ``estimates``: seconds per path where the scorers ran."""

    local: bool
    reason: str
    detail: str
    estimates: dict[str, float] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return LOCAL if self.local else REMOTE


class Filter(Protocol):
    name: str

    def filter(self, case: PrefillCase, paths: list[str]) -> tuple[list[str], str]:
        """The paths still allowed and why (text, used when one is left)."""
        ...


class Scorer(Protocol):
    name: str

    def score(self, case: PrefillCase, path: str) -> float:
        """Estimated TTFT of ``path`` in seconds (lower is better)."""
        ...


class Picker(Protocol):
    name: str

    def pick(self, case: PrefillCase, scores: dict[str, float]) -> tuple[str, str, str]:
        """(path, reason, detail) from each remaining path's summed score."""
        ...


# filters
@dataclass(slots=True)
class Colocated:
    name: str = "colocated"

    def filter(self, case, paths):
        return ([LOCAL], "colocated decode pod") if getattr(case.pod, "colocated", False) else (paths, "")


@dataclass(slots=True)
class Threshold:
    threshold: int
    name: str = "threshold"

    def filter(self, case, paths):
        if case.tokens <= self.threshold:
            return [LOCAL], f"{case.tokens} tokens to prefill <= threshold {self.threshold} tokens"
        return paths, ""


@dataclass(slots=True)
class NoPrefillPod:
    """With no prefill pod alive, a short prompt goes local; a long one waits in the prefill queue (in a decode
    batch it would stall every request decoding there)."""

    fallback_max_tokens: int
    name: str = "no_prefill_pod"

    def filter(self, case, paths):
        if case.tier.pods > 0:
            return paths, ""
        if case.tokens <= self.fallback_max_tokens:
            return [LOCAL], "no prefill pod alive"
        return [REMOTE], (f"no prefill pod alive; {case.tokens} tokens to prefill > {self.fallback_max_tokens}: "
                          "waiting in the prefill queue")


@dataclass(slots=True)
class TpotSlo:
    """Drops local when the pod's running requests would see a step longer than the TPOT SLO."""

    config: PolicyConfig
    name: str = "tpot_slo"

    def filter(self, case, paths):
        c = self.config
        batch = running_batch(case.pod)
        if batch == 0 or c.tpot_slo_ms <= 0 or LOCAL not in paths:
            return paths, ""
        # The configured rate, not the prefill pods' measured one: this models a decode pod's step (its decode tokens
        # counted like prompt tokens), which the prefill pods' rate does not measure, so --prefill-tokens-per-s stays
        # the operator's calibration of it. With the measured rate it refused nearly every local prefill on the 2-core
        # host (short TTFT 2.6-3.0x colocated against 0.3-0.9x; pdserve/loadtest/README.md, pd-vs-colocated).
        step_ms = 1000.0 * (batch + min(case.tokens, slack(batch, c))) / c.prefill_tokens_per_s
        if step_ms <= c.tpot_slo_ms:
            return paths, ""
        return [p for p in paths if p != LOCAL], (f"a local prefill step of ~{step_ms:.0f} ms for {batch} running "
                                                  f"requests > TPOT SLO {c.tpot_slo_ms:g} ms")


# scorers
@dataclass(slots=True)
class TtftEstimate:
    config: PolicyConfig
    name: str = "ttft_estimate"

    def score(self, case, path):
        c = self.config
        if path == REMOTE:
            return remote_ttft(case, c)
        return case.tokens / (rate(case, c) * slack(running_batch(case.pod), c) / c.step_budget_tokens)


# pickers
@dataclass(slots=True)
class RemoteFirst:
    name: str = "default"

    def pick(self, case, scores):
        path = REMOTE if REMOTE in scores else LOCAL
        return path, self.name, f"{case.tokens} tokens to prefill"


@dataclass(slots=True)
class LowestTtft:
    """Remote while it meets the TTFT SLO, else the lower estimate (remote on a tie)."""

    ttft_slo_ms: float
    name: str = "lower_ttft"

    def pick(self, case, scores):
        remote, local = scores.get(REMOTE), scores.get(LOCAL)
        text = ", ".join(f"{p} ~{1000 * s:.0f} ms" for p, s in sorted(scores.items()))
        if remote is not None and self.ttft_slo_ms > 0 and 1000 * remote <= self.ttft_slo_ms:
            return REMOTE, "ttft_slo_met", f"TTFT {text}; remote within SLO {self.ttft_slo_ms:g} ms"
        if local is None or (remote is not None and remote <= local):
            return REMOTE, self.name, f"TTFT {text}"
        return LOCAL, self.name, f"TTFT {text}"


def rate(case: PrefillCase, config: PolicyConfig) -> float:
    """Prefill tokens/s of one pod: the prefill tier's measured rate, else ``--prefill-tokens-per-s``."""
    return case.tier.tokens_per_s or config.prefill_tokens_per_s


def remote_ttft(case: PrefillCase, config: PolicyConfig) -> float:
    """Estimated TTFT (s) on the prefill tier: the tokens ahead of the prompt, then its own, at the tier's rate."""
    return (case.tier.ahead(case.tokens) + case.tokens) / rate(case, config)


def running_batch(pod: Any) -> int:
    """Requests on the decode pod by its last report: running + waiting."""
    return int(getattr(pod, "num_running", 0) or 0) + int(getattr(pod, "num_waiting", 0) or 0)


def slack(batch: int, config: PolicyConfig) -> int:
    """Tokens per step the decode pod has for a prefill after one token per request (at least 1)."""
    return max(config.step_budget_tokens - batch, 1)


class PdPolicy:
    """Filters, then scorers (summed) and a picker: ``decide(case) -> Decision``. Subclasses name their parts."""

    name = ""

    def __init__(self, filters: Sequence[Filter], scorers: Sequence[Scorer], picker: Picker) -> None:
        self.filters, self.scorers, self.picker = list(filters), list(scorers), picker

    def decide(self, case: PrefillCase) -> Decision:
        paths = [LOCAL, REMOTE]
        for f in self.filters:
            paths, detail = f.filter(case, paths)
            assert paths, f"filter {f.name} left no path"
            if len(paths) == 1:
                return Decision(paths[0] == LOCAL, f.name, detail)
        scores = {p: sum(s.score(case, p) for s in self.scorers) for p in paths}
        path, reason, detail = self.picker.pick(case, scores)
        return Decision(path == LOCAL, reason, detail, scores)


class ThresholdPolicy(PdPolicy):
    """Local at or under the threshold (or short with no prefill pod alive), else remote."""

    name = "threshold"

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__([Colocated(), Threshold(config.local_prefill_threshold),
                          NoPrefillPod(config.fallback_max_tokens)], [], RemoteFirst())


class QueueAwarePolicy(PdPolicy):
    """The threshold rule as a floor, then the TPOT SLO, then the lower TTFT estimate (module docstring)."""

    name = "queue-aware"

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__([Colocated(), Threshold(config.local_prefill_threshold),
                          NoPrefillPod(config.fallback_max_tokens), TpotSlo(config)],
                         [TtftEstimate(config)], LowestTtft(config.ttft_slo_ms))


POLICIES: dict[str, type[PdPolicy]] = {p.name: p for p in (QueueAwarePolicy, ThresholdPolicy)}


def make_policy(name: str, config: PolicyConfig) -> PdPolicy:
    """The policy registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return POLICIES[name](config)
    except KeyError:
        raise ValueError(f"unknown pd policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
