"""NetworkPolicies: every connection the ensemble makes is allowed, and nothing else reaches its pods.

Oracles:
- the call paths found in the services' code (``CALL_PATHS`` says where each is made), each dialling the
  address the rendered configuration gives it (ConfigMap and env the services' settings read, the load test's
  ``--base-url``, the ServiceMonitor, the KEDA trigger), resolved through the rendered Services to a pod and a
  container port the way kube-proxy does;
- ``allowed()``, an evaluator of the NetworkPolicy rules as the Kubernetes documentation states them ("Network
  Policies": a pod is isolated for a direction once a policy of its namespace selects it with that policy type;
  then a connection needs a rule of one such policy matching its peer and port; a connection needs both the
  source's egress and the destination's ingress). ``test_the_evaluator_*`` checks it on policies written by hand;
- ``kubernetes-validate`` (strict) for the shape of the rendered policies.

Decided here: a decode pod cannot reach another decode pod's KV port. KV blocks flow only from prefill to decode
(pdserve/services/prefill/worker.py is the only KVTransferClient user; a migrated request is prefilled again through the
queue), so there is nothing to allow.
"""

from __future__ import annotations

import ipaddress
import itertools
from dataclasses import dataclass, field
from urllib.parse import urlparse

import kubernetes_validate
import pytest

from chart_render import NAMESPACE, RELEASE, VALUES_FILES, by_kind, helm, load_all, load_values, pod_templates, render_docs

COMPONENT = "app.kubernetes.io/component"
NS_NAME = "kubernetes.io/metadata.name"  # set by the API server on every namespace

# --- the evaluator ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """One side of a connection. ``namespace`` None: outside the cluster (then only ``ip`` identifies it)."""

    name: str
    namespace: str | None
    labels: dict = field(default_factory=dict, hash=False)
    ip: str = "10.0.0.1"
    # Named container ports, for policies that name a port of the destination pod.
    ports: dict = field(default_factory=dict, hash=False)

    @property
    def ns_labels(self) -> dict:
        return {NS_NAME: self.namespace} if self.namespace else {}

    @property
    def component(self) -> str | None:
        return self.labels.get(COMPONENT)


def selector_matches(selector: dict | None, labels: dict) -> bool:
    """metav1.LabelSelector: matchLabels and matchExpressions ANDed; an empty selector matches everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def peer_matches(peer: dict, ep: Endpoint, policy_ns: str) -> bool:
    if "ipBlock" in peer:
        ip = ipaddress.ip_address(ep.ip)
        block = peer["ipBlock"]
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(e) for e in block.get("except") or [])
    if ep.namespace is None:
        return False  # selectors name pods; something outside the cluster is never a pod
    ns_ok = (ep.namespace == policy_ns if "namespaceSelector" not in peer
             else selector_matches(peer["namespaceSelector"], ep.ns_labels))
    pod_ok = "podSelector" not in peer or selector_matches(peer["podSelector"], ep.labels)
    return ns_ok and pod_ok


def port_matches(ports: list | None, port: int, protocol: str, dst: Endpoint) -> bool:
    if not ports:
        return True  # no ports: every port
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p:
            return True
        want = p["port"]
        if isinstance(want, str):  # a named port is the destination pod's container port of that name
            want = dst.ports.get(want)
            if want is None:
                continue
        if want <= port <= p.get("endPort", want):
            return True
    return False


def policy_types(policy: dict) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else []))


def direction_allowed(policies, pod: Endpoint, peer: Endpoint, port: int, protocol: str, direction: str,
                      dst: Endpoint) -> bool:
    selecting = [p for p in policies if p["metadata"]["namespace"] == pod.namespace
                 and selector_matches(p["spec"]["podSelector"], pod.labels) and direction in policy_types(p)]
    if not selecting:
        return True  # not isolated in this direction
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for p in selecting:
        for rule in p["spec"].get(key) or []:
            peers = rule.get(peers_key)  # absent or empty: every peer
            if (not peers or any(peer_matches(x, peer, p["metadata"]["namespace"]) for x in peers)) \
                    and port_matches(rule.get("ports"), port, protocol, dst):
                return True
    return False


def allowed(policies, src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> bool:
    """Whether a connection from ``src`` to ``dst``'s ``port`` gets through (both ends' policies)."""
    egress = src.namespace is None or direction_allowed(policies, src, dst, port, protocol, "Egress", dst)
    ingress = dst.namespace is None or direction_allowed(policies, dst, src, port, protocol, "Ingress", dst)
    return egress and ingress


# --- the release's pods, and where each of them connects ----------------------------------------------------


# Where gloo and NCCL listen between the ranks of a multi-node tier: ports the kernel picks from
# net.ipv4.ip_local_port_range, whose default is 32768-60999 (Linux Documentation/networking/ip-sysctl.rst).
# Every pod of a LeaderWorkerSet gets its two ends as "ports" here, so the tests below probe them.
EPHEMERAL = (32768, 60999)


def pods(docs, namespace: str = NAMESPACE, first_ip: int = 10) -> dict[str, Endpoint]:
    """One Endpoint per workload of the rendering, by component (router, registry, ..., redis, loadtest; a
    LeaderWorkerSet's leader and worker pods, the worker named ``...#worker``)."""
    out = {}
    templates = [(d, role, t) for d in docs for role, t in pod_templates(d).items()]
    for i, (d, role, t) in enumerate(templates):
        ports = {p["name"]: p["containerPort"] for c in t["spec"]["containers"] for p in c.get("ports", []) if "name" in p}
        if role:
            ports |= {"rank-lo": EPHEMERAL[0], "rank-hi": EPHEMERAL[1]}
        labels = t["metadata"]["labels"]
        suffix = "#worker" if role == "worker" else ""
        out[labels[COMPONENT]] = Endpoint(f"{labels['app.kubernetes.io/instance']}/{d['metadata']['name']}{suffix}",
                                          namespace, labels, f"10.1.{first_ip}.{i + 1}", ports)
    return out


def env(docs, workload: str) -> dict[str, str]:
    """The environment a pod of ``workload`` starts with: its ConfigMaps (envFrom), then its env (later wins)."""
    d = next(d for d in docs if d["metadata"]["name"] == workload and d["kind"] in ("Deployment", "Job", "LeaderWorkerSet"))
    role = "worker" if workload.endswith("#worker") else ""
    templates = pod_templates(d)
    (c,) = templates.get(role, templates.get("leader"))["spec"]["containers"]
    out: dict[str, str] = {}
    for src in c.get("envFrom", []):
        out |= by_kind(docs, "ConfigMap")[src["configMapRef"]["name"]]["data"]
    for e in c.get("env", []):
        out[e["name"]] = e.get("value", "<from a secret>")
    return out


def via_service(docs, host: str, port: int) -> tuple[Endpoint, int]:
    """kube-proxy's view of ``host:port``: the Service's pods and the container port its targetPort names."""
    name = host.split(".")[0]
    svc = by_kind(docs, "Service")[name]
    (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
    (pod,) = [p for p in pods(docs).values() if svc["spec"]["selector"].items() <= p.labels.items()]
    target = sp.get("targetPort", sp["port"])
    return pod, pod.ports[target] if isinstance(target, str) else target


def via_url(docs, url: str) -> tuple[Endpoint, int]:
    u = urlparse(url)
    return via_service(docs, u.hostname, u.port)


PROMETHEUS = Endpoint("monitoring/prometheus-0", "monitoring", {"app.kubernetes.io/name": "prometheus"}, "10.2.0.5")
KEDA = Endpoint("keda/keda-operator", "keda", {"app": "keda-operator"}, "10.2.0.6")
CLIENT = Endpoint("client outside the cluster", None, ip="203.0.113.7")

# Who dials what, as the code does it:
#   router   -> registry  PDSERVE_REGISTRY_URL                 pdserve/services/router/app.py (RegistryClient)
#   prefill  -> registry  PDSERVE_REGISTRY_URL                 pdserve/shared/worker/base.py (heartbeats, KV events)
#   decode   -> registry  PDSERVE_REGISTRY_URL                 pdserve/shared/worker/base.py
#   router, prefill, decode, registry, planner -> Redis  PDSERVE_REDIS_URL  (router/app.py, worker/base.py,
#                                                         registry/app.py, planner/main.py)
#   prefill  -> decode pod IP : its PDSERVE_KV_PORT          pdserve/services/prefill/worker.py (KVTransferClient)
#   router   -> decode pod IP : its PDSERVE_PORT /health     pdserve/services/router/migration.py (pod_alive)
#   planner  -> router/prefill/decode pod IPs : PDSERVE_*_METRICS_PORT /metrics   pdserve/services/planner/planner.py
#   loadtest -> --base-url (router Service)                  the Job's `pdserve bench serve`
#   Prometheus -> each Service the ServiceMonitor selects, its endpoint port
#   KEDA operator -> the redis-streams trigger's address
#   <tier>-worker -> its leader : PDSERVE_MASTER_PORT  pdserve/shared/engine/tp_executor.py (the ranks' TCPStore rendezvous)
#   <tier>-worker <-> its leader, <-> other workers (more than 2 nodes): the collectives (gloo/NCCL pairs), on
#                                 ports from EPHEMERAL
# The registry dials only Redis; no pdserve process calls the planner, a prefill pod's HTTP port, or a decode
# pod's KV port from anything but a prefill pod.
REDIS_CLIENTS = ("router", "prefill", "decode", "registry", "planner")
REGISTRY_CLIENTS = ("router", "prefill", "decode")


def call_paths(docs) -> list[tuple[str, Endpoint, Endpoint, int]]:
    """(what, source, destination pod, container port) for every connection this rendering's pods make."""
    p = pods(docs)
    full = {c: e.name.split("/", 1)[1] for c, e in p.items()}
    paths = []
    for c in REGISTRY_CLIENTS:
        dst, port = via_url(docs, env(docs, full[c])["PDSERVE_REGISTRY_URL"])
        paths.append((f"{c} -> registry", p[c], dst, port))
    if "redis" in p:  # an external Redis is outside the release (see test_restricted_egress_*)
        for c in REDIS_CLIENTS:
            if c in p:
                dst, port = via_url(docs, env(docs, full[c])["PDSERVE_REDIS_URL"])
                paths.append((f"{c} -> redis", p[c], dst, port))
    decode_env = env(docs, full["decode"])
    paths.append(("prefill -> decode KV transfer", p["prefill"], p["decode"], int(decode_env["PDSERVE_KV_PORT"])))
    paths.append(("router -> decode /health (migration)", p["router"], p["decode"], int(decode_env["PDSERVE_PORT"])))
    if "planner" in p:
        penv = env(docs, full["planner"])
        for tier in ("router", "prefill", "decode"):
            (dst,) = [e for e in p.values() if e.name.endswith("/" + penv[f"PDSERVE_{tier.upper()}_DEPLOYMENT"])]
            paths.append((f"planner -> {tier} /metrics", p["planner"], dst, int(penv[f"PDSERVE_{tier.upper()}_METRICS_PORT"])))
    for job in by_kind(docs, "Job").values():
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        dst, port = via_url(docs, args[args.index("--base-url") + 1])
        paths.append(("loadtest -> router", p["loadtest"], dst, port))
    for sm in by_kind(docs, "ServiceMonitor").values():
        sel = sm["spec"]["selector"]["matchLabels"]
        assert sm["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
        for svc in by_kind(docs, "Service").values():
            if sel.items() <= svc["metadata"]["labels"].items():
                for ep in sm["spec"]["endpoints"]:
                    (sp,) = [x for x in svc["spec"]["ports"] if x["name"] == ep["port"]]
                    dst, port = via_service(docs, svc["metadata"]["name"], sp["port"])
                    paths.append((f"Prometheus -> {dst.component} /metrics", PROMETHEUS, dst, port))
    for tier in ("prefill", "decode"):
        if f"{tier}-worker" in p:
            leader, worker = p[tier], p[f"{tier}-worker"]
            lenv = env(docs, full[tier])
            paths.append((f"{tier}-worker -> {tier} rendezvous", worker, leader, int(lenv["PDSERVE_MASTER_PORT"])))
            ranks = [(worker, leader), (leader, worker)] + [(worker, worker)] * (int(lenv["PDSERVE_NNODES"]) > 2)
            for (src, dst), port in itertools.product(ranks, EPHEMERAL):
                paths.append((f"{src.component} -> {dst.component} collectives", src, dst, port))
    for so in by_kind(docs, "ScaledObject").values():
        for trig in so["spec"]["triggers"]:
            if trig["type"] == "redis-streams" and "redis" in p:
                host, port = trig["metadata"]["address"].rsplit(":", 1)
                dst, cport = via_service(docs, host, int(port))
                paths.append(("KEDA -> redis", KEDA, dst, cport))
    return paths


def policies_of(docs) -> list[dict]:
    return [d for d in docs if d["kind"] == "NetworkPolicy"]


def every_port(ep: Endpoint) -> set[int]:
    return set(ep.ports.values())


# --- fixtures ----------------------------------------------------------------------------------------------

# The shipped values files, each with egress open (the default) and restricted.
CASES = [(case, egress) for case in VALUES_FILES for egress in (True, False)]


def render(chart, values: dict, release: str = RELEASE) -> list[dict]:
    """Like chart_render.render_docs, for any release name."""
    manifests = chart.render(values, name=release, namespace=NAMESPACE, is_install=True)
    docs = [d for path, text in manifests.items() if not path.endswith("NOTES.txt") for d in load_all(text) if d]
    for d in docs:
        d.setdefault("metadata", {}).setdefault("namespace", NAMESPACE)
    return docs


def render_case(chart, case: str, allow_external_egress: bool, release: str = RELEASE) -> list[dict]:
    values = load_values(case)
    values.setdefault("networkPolicy", {})["allowExternalEgress"] = allow_external_egress
    return render(chart, values, release)


# --- the evaluator can fail --------------------------------------------------------------------------------


def _policy(spec, ns="a"):
    return {"kind": "NetworkPolicy", "metadata": {"name": "p", "namespace": ns}, "spec": spec}


def test_the_evaluator_follows_the_documented_rules():
    web = Endpoint("a/web", "a", {"app": "web", "tier": "fe"}, "10.0.0.2", {"http": 8080})
    db = Endpoint("a/db", "a", {"app": "db"}, "10.0.0.3", {"pg": 5432})
    other_ns_web = Endpoint("b/web", "b", {"app": "web"}, "10.0.1.2")
    outside = Endpoint("x", None, ip="198.51.100.1")
    # No policy: everything flows.
    assert allowed([], outside, db, 5432) and allowed([], db, web, 1)
    # Selected for ingress with no rules: nothing flows in; egress from db is untouched.
    deny = [_policy({"podSelector": {"matchLabels": {"app": "db"}}, "ingress": []})]
    assert not allowed(deny, web, db, 5432) and allowed(deny, db, web, 8080)
    # A podSelector peer is this namespace only; the named port resolves on the destination.
    only_web = [_policy({"podSelector": {"matchLabels": {"app": "db"}},
                         "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}], "ports": [{"port": "pg"}]}]})]
    assert allowed(only_web, web, db, 5432)
    assert not allowed(only_web, web, db, 5433)
    assert not allowed(only_web, other_ns_web, db, 5432)
    assert not allowed(only_web, web, db, 5432, "UDP")
    # namespaceSelector and podSelector in one peer: both must match (AND); as two peers: either (OR).
    both = {"namespaceSelector": {"matchLabels": {NS_NAME: "b"}}, "podSelector": {"matchLabels": {"app": "web"}}}
    and_ = [_policy({"podSelector": {}, "ingress": [{"from": [both]}]})]
    assert allowed(and_, other_ns_web, db, 5432) and not allowed(and_, web, db, 5432)
    or_ = [_policy({"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": both["namespaceSelector"]},
                                                               {"podSelector": both["podSelector"]}]}]})]
    assert allowed(or_, other_ns_web, db, 5432) and allowed(or_, web, db, 5432)
    # matchExpressions, an empty `from` (every source), ipBlock with except, endPort.
    expr = [_policy({"podSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["db"]}]},
                     "ingress": [{"from": [], "ports": [{"port": 5000, "endPort": 5500}]}]})]
    assert allowed(expr, outside, db, 5432) and not allowed(expr, outside, db, 6000)
    assert allowed(expr, outside, web, 8080)  # not selected, so not isolated
    cidr = {"ipBlock": {"cidr": "198.51.100.0/24", "except": ["198.51.100.1/32"]}}
    block = [_policy({"podSelector": {}, "ingress": [{"from": [cidr]}]})]
    assert not allowed(block, outside, db, 1)
    assert allowed(block, Endpoint("y", None, ip="198.51.100.2"), db, 1)
    # Egress: only with the Egress type (listed, or implied by an egress section).
    to_db = {"to": [{"podSelector": {"matchLabels": {"app": "db"}}}]}
    eg = [_policy({"podSelector": {"matchLabels": {"app": "web"}}, "egress": [to_db]})]
    assert policy_types(eg[0]) == ["Ingress", "Egress"]
    assert allowed(eg, web, db, 5432) and not allowed(eg, web, outside, 443)
    egress_only = [_policy({"podSelector": {}, "policyTypes": ["Egress"], "egress": []})]
    assert allowed(egress_only, outside, db, 5432) and not allowed(egress_only, db, web, 8080)


# --- every real call path is allowed ----------------------------------------------------------------------


@pytest.mark.parametrize(("case", "open_egress"), CASES)
def test_every_call_path_of_the_ensemble_is_allowed(chart, case, open_egress):
    docs = render_case(chart, case, open_egress)
    pols = policies_of(docs)
    assert pols, case
    paths = call_paths(docs)
    unserved = [(what, port) for what, _, dst, port in paths if port not in every_port(dst)]
    assert not unserved, f"[{case}] dialled ports no container listens on: {unserved}"
    blocked = [(what, port) for what, src, dst, port in paths if not allowed(pols, src, dst, port)]
    assert not blocked, f"[{case}, open egress {open_egress}] blocked: {blocked}"
    # The oracle saw the paths it should: a rendering with a planner has its scrapes, etc.
    whats = {w for w, *_ in paths}
    assert {"prefill -> decode KV transfer", "router -> registry", "router -> decode /health (migration)"} <= whats
    mode = load_values(case).get("autoscaling", {}).get("mode", "none")
    assert ("planner -> decode /metrics" in whats) == (mode == "planner")
    assert ("KEDA -> redis" in whats) == (mode == "keda" and load_values(case).get("redis", {}).get("enabled", True))


@pytest.mark.parametrize(("case", "open_egress"), CASES)
def test_between_the_release_pods_nothing_but_the_call_paths_is_allowed(chart, case, open_egress):
    """Every (source pod, destination pod, container port) of the release: allowed exactly when a call path
    uses it, or it is the router's HTTP port (clients from anywhere by default) and the source's egress is open."""
    docs = render_case(chart, case, open_egress)
    pols, p = policies_of(docs), pods(docs)
    expected = {(src.component, dst.component, port) for _, src, dst, port in call_paths(docs)}
    router_http = p["router"].ports["http"]
    wrong = []
    for src, dst in itertools.product(p.values(), repeat=2):
        for port in every_port(dst):
            want = (src.component, dst.component, port) in expected or (
                open_egress and dst.component == "router" and port == router_http)
            if allowed(pols, src, dst, port) != want:
                wrong.append((src.component, dst.component, port, "allowed" if not want else "blocked"))
    assert not wrong, f"[{case}, open egress {open_egress}] {wrong}"


def test_every_pod_of_the_release_is_isolated_by_exactly_its_own_policy(rendered):
    case, docs = rendered
    pols, p = policies_of(docs), pods(docs)
    assert len(pols) == len(p), case
    for pol in pols:
        selected = [c for c, e in p.items() if selector_matches(pol["spec"]["podSelector"], e.labels)]
        assert [f"{RELEASE}-pdserve-{c}" for c in selected] == [pol["metadata"]["name"]], (case, pol["metadata"]["name"], selected)


# --- the leaks are closed ---------------------------------------------------------------------------------


def test_another_release_in_the_namespace_reaches_none_of_the_private_ports(chart):
    """Two releases side by side (their policies together): registry, Redis, KV and worker HTTP ports answer
    their own release only, both ways; each release's own paths still work."""
    ours = render_case(chart, "planner", True)
    theirs = render_case(chart, "planner", True, release="other")
    pols = policies_of(ours) + policies_of(theirs)
    mine, stranger = pods(ours), pods(theirs, first_ip=20)
    for a, b in ((mine, stranger), (stranger, mine)):
        for src in a.values():
            for comp, name in (("registry", "http"), ("redis", "redis"), ("decode", "kv"), ("decode", "http"),
                               ("prefill", "http"), ("planner", "http")):
                assert not allowed(pols, src, b[comp], b[comp].ports[name]), (src.name, comp, name)
    for docs in (ours, theirs):
        for what, src, dst, port in call_paths(docs):
            assert allowed(pols, src, dst, port), what


@pytest.mark.parametrize("stranger", [
    Endpoint("llm/debug-shell", NAMESPACE, {"run": "debug"}, "10.1.99.1"),
    Endpoint("llm/pdserve-lookalike", NAMESPACE, {"app.kubernetes.io/name": "pdserve", COMPONENT: "router"}, "10.1.99.2"),
    Endpoint("tenant-b/app", "tenant-b", {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": RELEASE,
                                          COMPONENT: "router"}, "10.3.0.1"),
    PROMETHEUS,  # no ServiceMonitor in the defaults: not even the monitoring namespace
    CLIENT,
], ids=lambda e: e.name)
def test_strangers_reach_only_the_router(chart, stranger):
    docs = render_docs(chart)
    pols, p = policies_of(docs), pods(docs)
    for comp, ep in p.items():
        for port in every_port(ep):
            assert allowed(pols, stranger, ep, port) == (comp == "router" and port == ep.ports["http"]), (comp, port)


def test_a_decode_pod_cannot_reach_another_decode_pods_kv_port(chart):
    docs = render_docs(chart, {"decode": {"replicaCount": 2}})
    pols, p = policies_of(docs), pods(docs)
    twin = Endpoint("llm/decode-2", NAMESPACE, p["decode"].labels, "10.1.10.99", p["decode"].ports)
    assert not allowed(pols, p["decode"], twin, twin.ports["kv"])
    assert allowed(pols, p["prefill"], twin, twin.ports["kv"])


# --- who else may come in: ingress controller, Prometheus, KEDA --------------------------------------------


def test_router_ingress_from_limits_clients_but_keeps_the_release_and_prometheus(chart):
    nginx = Endpoint("ingress-nginx/controller", "ingress-nginx", {"app": "nginx"}, "10.4.0.1")
    values = load_values("planner") | {"serviceMonitor": {"enabled": True}, "networkPolicy": {"router": {"ingressFrom": [
        {"namespaceSelector": {"matchLabels": {NS_NAME: "ingress-nginx"}}}]}}}
    docs = render_docs(chart, values)
    pols, p = policies_of(docs), pods(docs)
    port = p["router"].ports["http"]
    assert allowed(pols, nginx, p["router"], port)
    assert not allowed(pols, CLIENT, p["router"], port)
    assert not allowed(pols, Endpoint("llm/debug", NAMESPACE, {"run": "debug"}, "10.1.99.1"), p["router"], port)
    for what, src, dst, dport in call_paths(docs):  # loadtest, planner and Prometheus among them
        assert allowed(pols, src, dst, dport), what
    assert {"loadtest -> router", "planner -> router /metrics", "Prometheus -> router /metrics"} <= {w for w, *_ in call_paths(docs)}
    for pol in policies_of(docs):
        kubernetes_validate.validate(pol, "1.29", strict=True)


@pytest.mark.parametrize(("values", "scraped"), [
    ({}, False),
    ({"serviceMonitor": {"enabled": True}}, True),
    # hpa and keda scale on metrics Prometheus scrapes, with or without this chart's ServiceMonitor
    ({"autoscaling": {"mode": "hpa"}}, True),
    ({"autoscaling": {"mode": "keda"}}, True),
    ({"networkPolicy": {"metrics": {"allow": True}}}, True),
    ({"serviceMonitor": {"enabled": True}, "networkPolicy": {"metrics": {"allow": False}}}, False),
])
def test_prometheus_scrapes_the_http_ports_and_nothing_else(chart, values, scraped):
    docs = render_docs(chart, values)
    pols, p = policies_of(docs), pods(docs)
    for comp, ep in p.items():
        for name, port in ep.ports.items():
            want = comp == "router" or (scraped and name == "http")
            assert allowed(pols, PROMETHEUS, ep, port) == want, (values, comp, name)
    other_ns = Endpoint("logging/fluentd", "logging", {"app.kubernetes.io/name": "prometheus"}, "10.5.0.1")
    assert not allowed(pols, other_ns, p["registry"], p["registry"].ports["http"])


def test_keda_reaches_the_in_chart_redis_only_in_keda_mode(chart):
    for mode, want in (("keda", True), ("hpa", False), ("none", False)):
        docs = render_docs(chart, {"autoscaling": {"mode": mode}})
        p = pods(docs)
        assert allowed(policies_of(docs), KEDA, p["redis"], 6379) == want, mode
        assert not allowed(policies_of(docs), KEDA, p["registry"], p["registry"].ports["http"])


# --- egress -----------------------------------------------------------------------------------------------

KUBE_DNS = Endpoint("kube-system/coredns", "kube-system", {"k8s-app": "kube-dns"}, "10.96.0.10")
NODE_LOCAL_DNS = Endpoint("node-local-dns", None, ip="169.254.20.10")
API_SERVER = Endpoint("kube-apiserver", None, ip="172.18.0.2")
EXTERNAL_REDIS = Endpoint("managed redis", None, ip="10.200.0.5")


def test_egress_is_open_by_default(chart):
    docs = render_docs(chart, load_values("planner"))
    p = pods(docs)
    assert all(pol["spec"]["policyTypes"] == ["Ingress"] for pol in policies_of(docs))
    assert allowed(policies_of(docs), p["planner"], API_SERVER, 6443)


def test_restricted_egress_keeps_dns_and_the_call_paths_and_takes_extra_egress(chart):
    values = load_values("planner") | {"networkPolicy": {"allowExternalEgress": False}}
    docs = render_docs(chart, values)
    pols, p = policies_of(docs), pods(docs)
    for comp, ep in p.items():
        for dns in (KUBE_DNS, NODE_LOCAL_DNS):
            assert allowed(pols, ep, dns, 53, "UDP") and allowed(pols, ep, dns, 53, "TCP"), comp
        assert not allowed(pols, ep, API_SERVER, 6443), comp
        assert not allowed(pols, ep, CLIENT, 443), comp
    # The planner needs the API server: named in extraEgress, it (and only it) opens.
    extra = [{"to": [{"ipBlock": {"cidr": "172.18.0.2/32"}}], "ports": [{"protocol": "TCP", "port": 6443}]}]
    docs = render_docs(chart, values | {"networkPolicy": {"allowExternalEgress": False, "extraEgress": extra}})
    pols, p = policies_of(docs), pods(docs)
    assert allowed(pols, p["planner"], API_SERVER, 6443)
    assert not allowed(pols, p["planner"], API_SERVER, 443)
    assert not allowed(pols, p["redis"], API_SERVER, 6443), "Redis opens nothing but DNS"
    for kube_version in ("1.29", "1.33"):
        for pol in pols:
            kubernetes_validate.validate(pol, kube_version, strict=True)


def test_restricted_egress_with_an_external_redis_needs_extra_egress(chart):
    """External Redis is outside the release: closed until extraEgress names it (helm/pdserve/README.md "Network policies")."""
    values = load_values("external-redis") | {"networkPolicy": {"allowExternalEgress": False}}
    p = pods(render_docs(chart, values))
    assert not allowed(policies_of(render_docs(chart, values)), p["router"], EXTERNAL_REDIS, 6379)
    values["networkPolicy"]["extraEgress"] = [{"to": [{"ipBlock": {"cidr": "10.200.0.5/32"}}], "ports": [{"port": 6379}]}]
    docs = render_docs(chart, values)
    for comp in REDIS_CLIENTS:
        if comp in p:
            assert allowed(policies_of(docs), p[comp], EXTERNAL_REDIS, 6379), comp


# --- switches, shape, schema ------------------------------------------------------------------------------


def test_disabled_renders_no_network_policy_and_changes_nothing_else(chart):
    on = render_docs(chart, load_values("planner"))
    off = render_docs(chart, load_values("planner") | {"networkPolicy": {"enabled": False}})
    assert not policies_of(off)
    assert [d for d in on if d["kind"] != "NetworkPolicy"] == off


def test_ports_follow_the_values(chart):
    """Moved ports move the policies: the router's container port (not its Service port), KV, registry."""
    values = {"router": {"port": 8080, "service": {"port": 80}}, "registry": {"port": 7001},
              "decode": {"port": 7003, "kvPort": 7100}, "loadtest": {"enabled": True}}
    docs = render_docs(chart, values)
    pols, p = policies_of(docs), pods(docs)
    assert p["decode"].ports == {"http": 7003, "kv": 7100}
    for what, src, dst, port in call_paths(docs):
        assert allowed(pols, src, dst, port), (what, port)
    assert ("loadtest -> router", 8080) in {(w, port) for w, _, _, port in call_paths(docs)}
    assert not allowed(pols, p["prefill"], p["decode"], 9000)


@pytest.mark.parametrize(("values", "where"), [
    ({"networkPolicy": {"router": {"ingressFrom": [{}]}}}, "/networkPolicy/router/ingressFrom/0"),
    ({"networkPolicy": {"router": {"ingressFrom": [{"namespace": "x"}]}}}, "/networkPolicy/router/ingressFrom/0"),
    ({"networkPolicy": {"metrics": {"allow": "sometimes"}}}, "/networkPolicy/metrics/allow"),
    ({"networkPolicy": {"extraEgress": [{"ports": [{"protocol": "ICMP"}]}]}}, "/networkPolicy/extraEgress/0/ports/0/protocol"),
    ({"networkPolicy": {"enable": True}}, "/networkPolicy"),
])
def test_schema_rejects_bad_network_policy_values(chart, values, where):
    with pytest.raises(helm.HelmValuesError) as err:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert where in str(err.value), str(err.value)
