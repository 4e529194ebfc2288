"""Offline checks of the Kubernetes manifests in deploy/k8s (the cluster template, docs/scale-out.md).

Every Kubernetes document is validated against the official OpenAPI-derived JSON schemas with
`kubernetes-validate` (strict: unknown fields are errors). The schemas are bundled in that package, so
nothing is downloaded: `test_schema_check_needs_no_network` runs it with the sockets disabled. Then the
cross-references between the files, which no schema sees: Service selectors against pod labels, the
learner's --rollout addresses against the rollout StatefulSet's pod DNS names and gRPC port, ports against
the services' settings, the token from the Secret, every flag and MINITE_* variable parsed by the
services' own settings classes (services.common.settings.parse, as `minite rollout|learner` does), the
Prometheus targets, the image docker-compose.yml builds. Each check is shown to fail on a broken copy.
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import socket
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from minite_core.cli import SERVICES  # noqa: E402
from services.common import settings as st  # noqa: E402
from tests.service_helpers import system_tool  # noqa: E402

K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATION = K8S / "kustomization.yaml"
SCRAPE = K8S / "prometheus-scrape.yml"
COMPOSE = ROOT / "docker-compose.yml"
# The oldest Kubernetes minor the template targets, and the newest whose schemas the package bundles.
K8S_VERSIONS = ("1.30", ".".join(kubernetes_validate.latest_version().split(".")[:2]))
CLUSTER_DOMAIN = "cluster.local"
SETTINGS = {"rollout": st.RolloutSettings, "learner": st.LearnerSettings}
NAMESPACED = {"Service", "StatefulSet", "Deployment", "ConfigMap", "Secret"}


# -- loading ------------------------------------------------------------------------------------------

def kustomization() -> dict:
    return yaml.safe_load(KUSTOMIZATION.read_text())


def load_docs() -> list[dict]:
    """The Kubernetes objects `kubectl apply -k deploy/k8s` applies, in kustomization order."""
    docs = []
    for res in kustomization()["resources"]:
        for doc in yaml.safe_load_all((K8S / res).read_text()):
            if doc is not None:
                docs.append(doc)
    return docs


def doc_id(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def by_kind(docs, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("StatefulSet", "Deployment")}


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def named_ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def compose_image() -> str:
    return yaml.safe_load(COMPOSE.read_text())["x-minite"]["image"]


def scrape_targets() -> dict[str, list[str]]:
    cfg = yaml.safe_load(SCRAPE.read_text())
    return {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]] for job in cfg["scrape_configs"]}


# -- the services' own parsing -----------------------------------------------------------------------

def container_env(c: dict, docs) -> dict[str, str]:
    """The environment Kubernetes gives the container: envFrom ConfigMaps, then env (literals, Secret keys)."""
    maps, secrets = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
    env = {}
    for src in c.get("envFrom", []):
        env.update({k: str(v) for k, v in maps[src["configMapRef"]["name"]]["data"].items()})
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            # (the shipped Secret is empty on purpose; parse as a deployment would, with the operator's token)
            env[e["name"]] = str(secrets[ref["name"]]["stringData"][ref["key"]]) or "the-operators-token"
    return env


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """os.environ with every MINITE_* variable of this process replaced by `env`'s."""
    saved = dict(os.environ)
    try:
        for k in [k for k in os.environ if k.startswith("MINITE_")]:
            del os.environ[k]
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def parse_settings(role: str, c: dict, docs):
    """(settings, error) as `minite <role>` would parse this container's args and environment."""
    err = io.StringIO()
    with environment(container_env(c, docs)), contextlib.redirect_stderr(err):
        try:
            return st.parse(SETTINGS[role], c["args"][1:], f"minite {role}"), None
        except SystemExit:
            return None, err.getvalue().strip() or "settings refused"


# -- the cross-references -----------------------------------------------------------------------------

def cross_problems(docs) -> list[str]:
    """Everything that ties the manifests together and that no schema checks; [] when all agree."""
    out = []
    kus = kustomization()
    namespaces = by_kind(docs, "Namespace")
    ns = kus.get("namespace")
    if list(namespaces) != [ns]:
        out.append(f"the Namespace objects {list(namespaces)} are not the kustomization's namespace {ns!r}")
    for d in docs:
        if d["kind"] in NAMESPACED and d["metadata"].get("namespace") != ns:
            out.append(f"{doc_id(d)} is in namespace {d['metadata'].get('namespace')!r}, not {ns!r}")
    services, wl = by_kind(docs, "Service"), workloads(docs)
    maps, secrets = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
    if set(wl) != set(SETTINGS):
        return out + [f"workloads {sorted(wl)}, expected {sorted(SETTINGS)}"]

    # selectors and governing Services
    for name, w in wl.items():
        labels = w["spec"]["template"]["metadata"]["labels"]
        sel = w["spec"]["selector"]["matchLabels"]
        if not sel.items() <= labels.items():
            out.append(f"{doc_id(w)}: selector {sel} does not match its pod labels {labels}")
        if w["kind"] == "StatefulSet":
            gov = services.get(w["spec"]["serviceName"])
            if gov is None or gov["spec"].get("clusterIP") != "None":
                out.append(f"{doc_id(w)}: serviceName {w['spec']['serviceName']!r} is not a headless Service")
    for sname, svc in services.items():
        sel = svc["spec"].get("selector", {})
        hits = [n for n, w in wl.items() if sel and sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        if len(hits) != 1:
            out.append(f"Service/{sname}: selector {sel} selects the pods of {hits}, expected exactly one workload")
            continue
        c = container(wl[hits[0]])
        ports = named_ports(c)
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            num = ports.get(target) if isinstance(target, str) else target
            if num not in ports.values():
                out.append(f"Service/{sname} port {p['name']}: targetPort {target!r} is no port of {hits[0]}'s container")
            elif num != p["port"]:
                out.append(f"Service/{sname} port {p['name']}: {p['port']} forwards to {num}; keep them equal")
    if wl["learner"]["spec"]["replicas"] != 1:
        out.append("the learner must run exactly one replica (one owner of the weight versions)")

    # per service: the command, the settings as the service parses them, ports, probes, token, image, metrics
    parsed = {}
    for role, w in wl.items():
        c, pod = container(w), w["spec"]["template"]["spec"]
        if c.get("command") != ["minite"] or not c.get("args") or c["args"][0] != role or role not in SERVICES:
            out.append(f"{doc_id(w)}: must run `minite {role}` (command ['minite'], args starting with {role!r})")
            continue
        dangling = [f"{doc_id(w)}: envFrom ConfigMap {src['configMapRef']['name']!r} does not exist"
                    for src in c.get("envFrom", []) if src["configMapRef"]["name"] not in maps]
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref and (ref["name"] not in secrets or ref["key"] not in secrets[ref["name"]].get("stringData", {})):
                dangling.append(f"{doc_id(w)}: {e['name']} refers to a missing Secret key {ref['name']}/{ref['key']}")
        if dangling:  # the environment cannot be built: nothing below can be checked for this service
            out += dangling
            continue
        fields = SETTINGS[role].model_fields
        for k in container_env(c, docs):
            if k.startswith("MINITE_") and k[len("MINITE_"):].lower() not in fields:
                out.append(f"{doc_id(w)}: {k} is no setting of `minite {role}` (the service would ignore it)")
        s, err = parse_settings(role, c, docs)
        if s is None:
            out.append(f"{doc_id(w)}: `minite {' '.join(c['args'])}` does not parse: {err}")
            continue
        parsed[role] = s
        # the token: from the Secret, never a flag or a literal
        tok = [e for e in c.get("env", []) if e["name"] == "MINITE_AUTH_TOKEN"]
        if len(tok) != 1 or "secretKeyRef" not in tok[0].get("valueFrom", {}):
            out.append(f"{doc_id(w)}: MINITE_AUTH_TOKEN must come from a Secret (env valueFrom.secretKeyRef)")
        if any(a.startswith("--auth-token") for a in c["args"]):
            out.append(f"{doc_id(w)}: the token must not be a flag (visible in ps and in the pod spec)")
        if s.token is None:
            out.append(f"{doc_id(w)}: the service would run without a token")
        # ports: the settings' defaults, the container's ports, the probes, the scrape annotations
        ports = named_ports(c)
        for pname, field in (("grpc", "grpc_port"), ("http", "http_port")):
            want = fields[field].default
            if getattr(s, field) != want or ports.get(pname) != want:
                out.append(f"{doc_id(w)}: port {pname} is {ports.get(pname)} in the container and "
                           f"{getattr(s, field)} in the settings; the service's default is {want}")
        if s.host != "0.0.0.0":
            out.append(f"{doc_id(w)}: the service listens on {s.host}, not on the pod's addresses (0.0.0.0)")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c.get(probe, {}).get("httpGet", {})
            port = ports.get(get.get("port")) if isinstance(get.get("port"), str) else get.get("port")
            if get.get("path") != "/health" or port != s.http_port:
                out.append(f"{doc_id(w)}: {probe} must GET /health on the HTTP port {s.http_port}")
        ann = w["spec"]["template"]["metadata"].get("annotations", {})
        if (ann.get("prometheus.io/scrape"), ann.get("prometheus.io/port"), ann.get("prometheus.io/path")) != \
                ("true", str(s.http_port), "/metrics"):
            out.append(f"{doc_id(w)}: prometheus.io annotations must scrape /metrics on {s.http_port}")
        # shutdown: the drain fits in the grace period
        grace = pod.get("terminationGracePeriodSeconds")
        if grace != 30 or not s.drain_timeout < grace:
            out.append(f"{doc_id(w)}: terminationGracePeriodSeconds {grace}: want 30, above the drain ({s.drain_timeout} s)")
        if pod.get("enableServiceLinks") is not False:
            out.append(f"{doc_id(w)}: enableServiceLinks must be false (no injected *_PORT variables)")
        if c.get("image") != compose_image():
            out.append(f"{doc_id(w)}: image {c.get('image')!r} is not docker-compose.yml's {compose_image()!r}")

    # the shared ConfigMap: only settings both services have, and no token
    for mname, m in maps.items():
        for k in m.get("data", {}):
            if k == "MINITE_AUTH_TOKEN":
                out.append(f"ConfigMap/{mname}: the token belongs in the Secret")
            elif not k.startswith("MINITE_") or any(k[7:].lower() not in cls.model_fields for cls in SETTINGS.values()):
                out.append(f"ConfigMap/{mname}: {k} is not a setting of both services")

    # the learner reaches every rollout replica by its pod DNS name and gRPC port, and Prometheus scrapes them
    if set(parsed) == set(SETTINGS):
        ro = wl["rollout"]
        svc = services.get(ro["spec"].get("serviceName"), {"metadata": {"name": None}, "spec": {"ports": []}})
        grpc = [p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc"]
        pods = [f"{ro['metadata']['name']}-{i}.{svc['metadata']['name']}.{ns}.svc.{CLUSTER_DOMAIN}"
                for i in range(ro["spec"]["replicas"])]
        want = [f"{p}:{grpc[0] if grpc else parsed['rollout'].grpc_port}" for p in pods]
        if parsed["learner"].rollout != want:
            out.append(f"the learner's --rollout {parsed['learner'].rollout} are not the rollout replicas {want}")
        if ro["kind"] == "Deployment":
            out.append("the rollout replicas need their own DNS names (StatefulSet), not a Deployment's shared one")
        targets = scrape_targets()
        lr = wl["learner"]
        want_targets = {
            "minite-rollout": [f"{p}:{parsed['rollout'].http_port}" for p in pods],
            "minite-learner": [f"{lr['metadata']['name']}-0.{lr['spec']['serviceName']}.{ns}.svc.{CLUSTER_DOMAIN}:"
                               f"{parsed['learner'].http_port}"]}
        if targets != want_targets:
            out.append(f"{SCRAPE.name}: targets {targets}, expected {want_targets}")
        # the learner's run dir lives on its PersistentVolumeClaim
        lc = container(lr)
        claims = {t["metadata"]["name"] for t in lr["spec"].get("volumeClaimTemplates", [])}
        mounts = [m["mountPath"] for m in lc.get("volumeMounts", []) if m["name"] in claims]
        run_dir = parsed["learner"].run_dir
        if not any(run_dir == Path(m) or Path(m) in run_dir.parents for m in mounts):
            out.append(f"the learner's --run-dir {run_dir} is on no PersistentVolumeClaim (mounted: {mounts})")
    return out


# -- tests: the files ---------------------------------------------------------------------------------

def test_kustomization_applies_every_manifest_and_the_compose_image():
    kus = kustomization()
    assert kus["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and kus["kind"] == "Kustomization"
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {KUSTOMIZATION.name}
    assert sorted(kus["resources"]) == sorted(on_disk), "kustomization.yaml must list every manifest in deploy/k8s"
    name, tag = compose_image().split(":")
    assert kus["images"] == [{"name": name, "newName": name, "newTag": tag}]
    kinds = sorted(doc_id(d) for d in load_docs())
    assert kinds == ["ConfigMap/minite-settings", "Namespace/minite", "Secret/minite-auth", "Service/learner",
                     "Service/rollout", "StatefulSet/learner", "StatefulSet/rollout"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_document_validates_against_the_kubernetes_schemas(version):
    docs = load_docs()
    assert len(docs) == 7
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc_id(doc)} against Kubernetes {version}: {'.'.join(map(str, e.path))}: {e.message}")


def _statefulset():
    return copy.deepcopy(by_kind(load_docs(), "StatefulSet")["rollout"])


@pytest.mark.parametrize("break_it", [
    lambda d: d["spec"].update(replicaz=2),                                              # unknown field (strict)
    lambda d: container(d)["ports"][0].update(containerPort="50051"),                     # wrong type
    lambda d: container(d).pop("name"),                                                   # required field missing
    lambda d: d["spec"]["template"]["spec"].update(terminationGracePeriodSeconds="30s"),  # wrong type
], ids=["unknown-field", "port-as-string", "no-container-name", "grace-as-string"])
def test_schema_check_fails_on_broken_documents(break_it):
    doc = _statefulset()
    kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)  # the original passes
    break_it(doc)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


def test_schema_check_needs_no_network(monkeypatch):
    """The schemas ship inside the package: validation works with every socket refused."""
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    for v in K8S_VERSIONS:
        assert (schemas / f"v{v}.0-local-strict" / "statefulset-apps-v1.json").is_file()

    def refuse(*a, **k):
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    for doc in load_docs():
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


def test_gpu_limits_and_the_token_placeholder_are_marked():
    for f in ("rollout.yaml", "learner.yaml"):
        assert re.search(r"#\s*nvidia\.com/gpu: 1\s+# optional", (K8S / f).read_text()), f
    secret = by_kind(load_docs(), "Secret")["minite-auth"]
    assert secret["stringData"]["token"] == "" and "REPLACE" in (K8S / "secret.yaml").read_text()


def test_the_shipped_empty_token_stops_the_services_at_start(monkeypatch):
    """No default token ships: the Secret's empty value is refused by both services' settings."""
    from minite_core.rl.config import ConfigError, load
    from services.common.settings import LearnerSettings, RolloutSettings

    monkeypatch.setenv("MINITE_AUTH_TOKEN", by_kind(load_docs(), "Secret")["minite-auth"]["stringData"]["token"])
    for cls in (RolloutSettings, LearnerSettings):
        with pytest.raises(ConfigError, match="empty or blank"):
            load(cls, ["--host", "0.0.0.0"], "minite")


# -- tests: the cross-references ----------------------------------------------------------------------

def test_the_manifests_agree_with_each_other_and_with_the_services():
    assert cross_problems(load_docs()) == []


def _rollout(docs):
    return by_kind(docs, "StatefulSet")["rollout"]


def _learner(docs):
    return by_kind(docs, "StatefulSet")["learner"]


def _learner_arg(i: int, value: str):
    """Replace the learner's args[i] (args: learner --rollout A0 --rollout A1 --run-dir DIR)."""
    return lambda d: container(_learner(d))["args"].__setitem__(i, value)


BREAKS = {
    "service-selector": (lambda d: by_kind(d, "Service")["rollout"]["spec"]["selector"].update(
        {"app.kubernetes.io/component": "rollouts"}), "selects the pods of []"),
    "sts-selector": (lambda d: _learner(d)["spec"]["selector"]["matchLabels"].update(tier="x"), "does not match its pod"),
    "target-port": (lambda d: by_kind(d, "Service")["learner"]["spec"]["ports"][0].update(targetPort="grpcx"),
                    "no port of"),
    "one-more-replica": (lambda d: _rollout(d)["spec"].update(replicas=3), "are not the rollout replicas"),
    "wrong-rollout-port": (_learner_arg(2, "rollout-0.rollout.minite.svc.cluster.local:50052"),
                           "are not the rollout replicas"),
    "wrong-namespace-in-address": (_learner_arg(4, "rollout-1.rollout.default.svc.cluster.local:50051"),
                                   "are not the rollout replicas"),
    "deployment": (lambda d: _rollout(d).update(kind="Deployment"), "not a Deployment"),
    "unknown-flag": (lambda d: container(_rollout(d))["args"].extend(["--max-slotz", "4"]), "does not parse"),
    "bad-flag-value": (lambda d: container(_rollout(d))["args"].extend(["--precision", "fp8"]), "does not parse"),
    "unknown-env": (lambda d: by_kind(d, "ConfigMap")["minite-settings"]["data"].update(MINITE_MAX_SLOT="4"),
                    "MINITE_MAX_SLOT"),
    "one-service-env": (lambda d: by_kind(d, "ConfigMap")["minite-settings"]["data"].update(MINITE_MAX_SLOTS="4"),
                        "not a setting of both"),
    "literal-token": (lambda d: container(_learner(d))["env"].__setitem__(0, {"name": "MINITE_AUTH_TOKEN", "value": "x"}),
                      "must come from a Secret"),
    "token-flag": (lambda d: container(_rollout(d))["args"].extend(["--auth-token", "x"]), "must not be a flag"),
    "missing-secret-key": (lambda d: container(_rollout(d))["env"][0]["valueFrom"]["secretKeyRef"].update(key="tok"),
                           "missing Secret key"),
    "port-not-default": (lambda d: container(_rollout(d))["ports"][0].update(containerPort=50061), "port grpc"),
    "probe-port": (lambda d: container(_learner(d))["livenessProbe"]["httpGet"].update(port=50052), "livenessProbe"),
    "probe-path": (lambda d: container(_rollout(d))["readinessProbe"]["httpGet"].update(path="/healthz"), "readinessProbe"),
    "scrape-port": (lambda d: _rollout(d)["spec"]["template"]["metadata"]["annotations"].update(
        {"prometheus.io/port": "8001"}), "prometheus.io annotations"),
    "short-grace": (lambda d: _rollout(d)["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=10),
                    "terminationGracePeriodSeconds"),
    "loopback": (lambda d: by_kind(d, "ConfigMap")["minite-settings"]["data"].update(MINITE_HOST="127.0.0.1"),
                 "0.0.0.0"),
    "run-dir-off-volume": (_learner_arg(6, "/tmp/run"), "no PersistentVolumeClaim"),
    "two-learners": (lambda d: _learner(d)["spec"].update(replicas=2), "exactly one replica"),
    "other-image": (lambda d: container(_learner(d)).update(image="minite:latest"), "docker-compose.yml"),
    "namespace": (lambda d: by_kind(d, "Secret")["minite-auth"]["metadata"].update(namespace="default"), "namespace"),
    "service-links": (lambda d: _rollout(d)["spec"]["template"]["spec"].pop("enableServiceLinks"), "enableServiceLinks"),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_cross_reference_checks_fail_on_broken_copies(name):
    docs = load_docs()
    break_it, expect = BREAKS[name]
    break_it(docs)
    problems = cross_problems(docs)
    assert any(expect in p for p in problems), problems


def test_prometheus_scrape_config_is_valid():
    promtool = system_tool("promtool")
    import subprocess

    r = subprocess.run([promtool, "check", "config", str(SCRAPE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
