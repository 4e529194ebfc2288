"""Static checks of the deployment files: docker-compose.yml, deploy/docker/Dockerfile, .dockerignore,
deploy/prometheus/prometheus.yml, Grafana provisioning and the dashboard deploy/grafana/dashboards/minite.json,
and the services' metric registries (built in-process, nothing served) against the dashboard.

No service is started here (tests/serve/test_e2e.py runs every panel's query on a real Prometheus scraping
the real services). Checks that need a system tool (docker-compose, promtool: Debian packages
`docker-compose` and `prometheus`) skip without it, unless MINITE_REQUIRE_SYSTEM_TOOLS=1 (CI), which makes
a missing tool a failure.

The metric names below are the contract between the services' exporters and the dashboard.
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `deploy` is not an installed package: import it from the checkout
    sys.path.insert(0, str(ROOT))

from deploy.grafana.panels import DASHBOARD, grafana_regex, iter_panels, panel_queries  # noqa: E402
from tests.service_helpers import system_tool  # noqa: E402

COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA_DATASOURCE = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
GRAFANA_DASHBOARDS = ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "minite.yml"

# Metrics the services export (prometheus_client names: counters end in _total); test_metric_contract checks
# these against the services' registries.
TRAINING_GAUGES = {
    "minite_learner_loss", "minite_learner_kl", "minite_learner_entropy", "minite_learner_grad_norm",
    "minite_learner_clip_ratio",
}
GAUGES = {
    "minite_num_requests_running", "minite_num_requests_waiting", "minite_kv_cache_usage_perc",
    "minite_weight_version", "minite_logprob_abs_diff_max", "minite_kl_k3", "minite_token_mismatch_ratio",
    "minite_bitwise_equal_ratio", "minite_reward_mean", "minite_reward_function_mean", "minite_eval",
} | TRAINING_GAUGES
COUNTERS = {
    "minite_prompt_tokens_total", "minite_generation_tokens_total", "minite_weight_sync_bytes_total",
    "minite_weight_sync_rejected_total", "minite_requests_total", "minite_learner_tokens_total",
    "minite_learner_steps_total",
}
HISTOGRAMS = {
    "minite_time_to_first_token_seconds", "minite_inter_token_latency_seconds", "minite_e2e_request_latency_seconds",
    "minite_weight_sync_seconds", "minite_logprob_abs_diff", "minite_learner_step_seconds",
}
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
# vLLM's serving set, under minite_ and labelled model_name as vLLM labels them
SERVING = {
    "minite_num_requests_running", "minite_num_requests_waiting", "minite_kv_cache_usage_perc",
    "minite_prompt_tokens_total", "minite_generation_tokens_total", "minite_time_to_first_token_seconds",
    "minite_inter_token_latency_seconds", "minite_e2e_request_latency_seconds", "minite_requests_total",
}
# process_* series the dashboard reads (prometheus_client's ProcessCollector, on both services)
PROCESS = {"process_cpu_seconds_total", "process_resident_memory_bytes"}

PORTS = {"rollout": {50051, 8000}, "learner": {50052, 8001}, "prometheus": {9090}, "grafana": {3000}}
HTTP_PORT = {"rollout": 8000, "learner": 8001}
def run_tool(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


def metric_base(name: str) -> str:
    """The exported metric a series name belongs to: histogram series map to their histogram."""
    for suffix in HISTOGRAM_SERIES:
        if name.endswith(suffix) and name[: -len(suffix)] in HISTOGRAMS:
            return name[: -len(suffix)]
    return name


def referenced_metrics(expr: str) -> set[str]:
    return set(re.findall(r"\b(?:minite|process)_[a-z0-9_]+", expr))


def exported(registry) -> dict[str, str]:
    """exported name (a counter's with _total, as in GAUGES, COUNTERS, HISTOGRAMS) -> type, of a registry."""
    return {fam.name + ("_total" if fam.type == "counter" else ""): fam.type for fam in registry.collect()}


def load_yaml(path: Path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(COMPOSE)


@pytest.fixture(scope="module")
def dashboard() -> dict:
    with open(DASHBOARD, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def registries():
    """The services' registries, as the services build them (both in this one process: one registry each)."""
    from services.common.metrics import LearnerMetrics, RolloutMetrics

    rollout = RolloutMetrics("contract-model")
    rollout.requests.labels("rest", "ok")  # (a labelled counter has samples once a label set is used)
    return rollout.registry, LearnerMetrics().registry


# --- docker-compose.yml ----------------------------------------------------------------------------------------

def test_compose_config_validates():
    """Valid with a token; with none, compose stops before anything starts, naming the variable (there is no
    default token); every port is published on 127.0.0.1 unless MINITE_PUBLISH_IP says otherwise."""
    tool = system_tool("docker-compose")
    env = {k: v for k, v in os.environ.items() if k not in ("MINITE_AUTH_TOKEN", "MINITE_PUBLISH_IP")}
    result = subprocess.run([tool, "-f", str(COMPOSE), "config", "-q"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env={**env, "MINITE_AUTH_TOKEN": "a-test-token"})
    assert result.returncode == 0, result.stderr
    unset = subprocess.run([tool, "-f", str(COMPOSE), "config", "-q"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, env=env)
    assert unset.returncode != 0 and "MINITE_AUTH_TOKEN" in unset.stderr, unset.stderr
    rendered = yaml.safe_load(subprocess.run([tool, "-f", str(COMPOSE), "config"], cwd=ROOT, capture_output=True,
                                             text=True, timeout=120, env={**env, "MINITE_AUTH_TOKEN": "t"}).stdout)
    published = [p for svc in rendered["services"].values() for p in svc.get("ports", [])]
    assert published and all(str(p).startswith("127.0.0.1:") or (isinstance(p, dict) and p.get("host_ip") ==
                                                                  "127.0.0.1") for p in published), published


def _container_ports(service: dict) -> dict[int, int]:
    """container port -> published host port, from the short "HOST:CONTAINER" syntax."""
    out = {}
    for spec in service.get("ports", []):
        parts = str(spec).split("/")[0].split(":")  # [IP:]HOST:CONTAINER[/PROTOCOL]
        out[int(parts[-1])] = int(parts[-2]) if len(parts) > 1 else int(parts[-1])
    return out


def test_compose_services_and_ports(compose):
    services = compose["services"]
    assert set(PORTS) <= set(services)
    for name, ports in PORTS.items():
        published = _container_ports(services[name])
        assert set(published) == ports, name
        assert all(published[p] == p for p in ports), f"{name}: published on other host ports {published}"


def test_compose_minite_services(compose):
    services = compose["services"]
    for name in ("rollout", "learner"):
        svc = services[name]
        assert svc["image"] == services["rollout"]["image"], "one image for both services"
        assert svc["build"]["dockerfile"] == "deploy/docker/Dockerfile"
        assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        assert "MINITE_AUTH_TOKEN" in svc["environment"]
        assert svc["environment"]["MINITE_AUTH_TOKEN"].startswith("${MINITE_AUTH_TOKEN")
        cmd = svc["command"]
        assert cmd[:2] == ["minite", name]
        assert cmd[cmd.index("--model-dir") + 1] == "/opt/minite/tiny-model"
        assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
        check = " ".join(svc["healthcheck"]["test"])
        assert f"http://127.0.0.1:{HTTP_PORT[name]}/health" in check
    learner = services["learner"]
    assert learner["command"][learner["command"].index("--rollout") + 1] == "rollout:50051"
    assert learner["depends_on"]["rollout"]["condition"] == "service_healthy"


def test_compose_monitoring(compose):
    services = compose["services"]
    assert services["prometheus"]["image"].startswith("prom/prometheus")
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    grafana = services["grafana"]
    assert grafana["image"].startswith("grafana/grafana")
    mounts = {v.split(":")[0]: v.split(":")[1:] for v in grafana["volumes"]}
    assert mounts["./deploy/grafana/provisioning"] == ["/etc/grafana/provisioning", "ro"]
    # the dashboard provider reads the folder the dashboards are mounted at
    dash_mount = mounts["./deploy/grafana/dashboards"]
    assert dash_mount[1] == "ro"
    (provider,) = load_yaml(GRAFANA_DASHBOARDS)["providers"]
    assert provider["options"]["path"] == dash_mount[0]
    home = grafana["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    assert home is None or home == f"{dash_mount[0]}/{DASHBOARD.name}"


def test_compose_learner_run_dir_is_a_named_volume(compose):
    """The learner's run dir (checkpoints, trajectory log, metrics.jsonl) lies on a named volume, so that a
    recreated container resumes from it; the volume is mounted where the image has a directory owned by the
    `minite` user (Docker gives a new named volume the mount point's owner: a directory the image lacks
    would be root's, and the unprivileged learner could not write its run dir)."""
    learner = compose["services"]["learner"]
    cmd = learner["command"]
    run_dir = cmd[cmd.index("--run-dir") + 1]
    assert run_dir.startswith("/"), "an absolute run dir: it must not depend on the image's WORKDIR"
    mounts = [str(v).split(":") for v in learner.get("volumes", [])]
    covering = [(src, dst) for src, dst, *_ in mounts if run_dir == dst or run_dir.startswith(dst.rstrip("/") + "/")]
    assert len(covering) == 1, f"{run_dir} is on no volume (or on several): {mounts}"
    (volume, target), = covering
    assert not volume.startswith((".", "/", "~")), f"{volume}: a named volume, not a bind mount"
    assert volume in (compose.get("volumes") or {}), f"{volume} is not declared under the top-level volumes:"
    text = DOCKERFILE.read_text()
    user = re.search(r"useradd[^\n]*--create-home[^\n]*\s(\w+)\s*(?:\\|$)", text, re.M)
    assert user and user.group(1) == "minite" and target == "/home/minite", \
        f"the volume is mounted at {target}, not at the `minite` user's home the image creates"
    users = [ln.split()[1] for ln in text.splitlines() if ln.startswith("USER ")]
    assert users[-1] == "minite", "the learner runs as the user that owns the volume"


# --- Dockerfile and .dockerignore -----------------------------------------------------------------------------

def test_dockerfile():
    text = DOCKERFILE.read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    torch_install = [ln for ln in lines if "pip install" in ln and "torch" in ln]
    assert torch_install and "--index-url https://download.pytorch.org/whl/cpu" in torch_install[0]
    # CPU torch is installed before the project, so that the project's dependencies find it satisfied
    assert text.index("download.pytorch.org/whl/cpu") < text.index("pip install /app")
    assert "WORKDIR /app" in lines
    assert "minite build-model --out /opt/minite/tiny-model" in text
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), "the services run as an unprivileged user"
    exposed = {int(p) for ln in lines if ln.startswith("EXPOSE ") for p in ln.split()[1:]}
    assert exposed == PORTS["rollout"] | PORTS["learner"]


def test_dockerignore_keeps_the_build_inputs():
    patterns = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert {".git", ".venv"} <= set(patterns)
    # `pip install .` needs these (pyproject's readme is README.md)
    for needed in ("pyproject.toml", "README.md", "minite_core", "minite_core/cli.py"):
        hits = [p for p in patterns if fnmatch.fnmatch(needed, p) or needed.startswith(p.rstrip("/") + "/")]
        assert not hits, f"{needed} is excluded by {hits}"


# --- Prometheus ------------------------------------------------------------------------------------------------

def test_prometheus_config_promtool():
    result = run_tool([system_tool("promtool"), "check", "config", str(PROMETHEUS)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrape_jobs():
    config = load_yaml(PROMETHEUS)
    assert config["global"]["scrape_interval"] == "5s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    expected = {"minite-rollout": "rollout:8000", "minite-learner": "learner:8001"}
    assert set(jobs) == set(expected)
    for name, target in expected.items():
        assert jobs[name].get("metrics_path", "/metrics") == "/metrics"
        assert [t for sc in jobs[name]["static_configs"] for t in sc["targets"]] == [target]


# --- Grafana -----------------------------------------------------------------------------------------------------

def test_grafana_datasource():
    (ds,) = load_yaml(GRAFANA_DATASOURCE)["datasources"]
    assert ds["type"] == "prometheus"
    assert ds["url"] == "http://prometheus:9090"
    assert ds["uid"] == "minite-prometheus"


def test_dashboard_model(dashboard):
    assert dashboard["uid"] and dashboard["title"]
    assert dashboard["id"] is None, "an exported dashboard has no id: each Grafana gives its own"
    assert 36 <= dashboard["schemaVersion"] <= 41
    panels = list(iter_panels(dashboard))
    assert panels
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles)), "panel titles are unique (the e2e test reports by title)"


# Importing into an existing Grafana and provisioning, with one file. Grafana's import ("Export for sharing
# externally", then Dashboards > Import) asks for each `__inputs` entry and writes the chosen datasource's uid
# over every "${DS_PROMETHEUS}"; file provisioning does not read `__inputs` at all (grafana/grafana#10786),
# so "${DS_PROMETHEUS}" would name no datasource there. Grafana's documented way to make a dashboard
# datasource-independent is a datasource template variable (Dashboards > Variables > "Data source"): the
# panels' "${DS_PROMETHEUS}" is then also that variable, which a provisioned dashboard resolves at view time to
# the default datasource of its type (the provisioned Prometheus, isDefault). One file serves both; a
# provisioned copy with a fixed uid would drift from it.
DS = "${DS_PROMETHEUS}"


def test_dashboard_imports_with_a_datasource_input(dashboard):
    (inp,) = dashboard["__inputs"]
    assert inp == {**inp, "name": "DS_PROMETHEUS", "type": "datasource", "pluginId": "prometheus"}, inp
    required = {(r["type"], r["id"]) for r in dashboard["__requires"]}
    assert {("grafana", "grafana"), ("datasource", "prometheus")} <= required
    assert {("panel", p["type"]) for p in iter_panels(dashboard) if p["type"] != "row"} <= required
    refs = []
    for panel in iter_panels(dashboard):
        if panel["type"] != "row":
            refs += [(panel["title"], panel["datasource"])] + [(panel["title"], t["datasource"]) for t in panel["targets"]]
    refs += [(f"variable {v['name']}", v["datasource"]) for v in dashboard["templating"]["list"] if v["type"] == "query"]
    for where, ds in refs:
        assert ds == {"type": "prometheus", "uid": DS}, (where, ds)
    # no datasource but the input: no fixed uid (the provisioned one or another) left anywhere in the file
    text = DASHBOARD.read_text()
    assert set(re.findall(r"\$\{(DS_[A-Z_]+)\}", text)) == {"DS_PROMETHEUS"}
    (ds,) = load_yaml(GRAFANA_DATASOURCE)["datasources"]
    assert ds["uid"] not in text


def test_provisioning_resolves_the_datasource_variable(dashboard):
    (var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    assert not var.get("current", {}).get("value"), "no saved uid: the default Prometheus of the Grafana it runs in"
    assert not var.get("multi") and not var.get("includeAll")
    (ds,) = load_yaml(GRAFANA_DATASOURCE)["datasources"]
    assert ds["type"] == "prometheus" and ds["isDefault"] is True, "provisioning: the variable's default is this one"


def test_dashboard_job_and_instance_variables(dashboard):
    """job and instance: label_values queries on a metric both services export, instance chained on $job;
    several or All may be picked, and All stays within the miniTE jobs (no allValue such as .*, which would
    match every job of a shared Prometheus: the process_* panels would show them all)."""
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert list(variables) == ["DS_PROMETHEUS", "job", "instance"], "the datasource variable comes first"
    for name, definition in (("job", "label_values(minite_weight_version, job)"),
                             ("instance", 'label_values(minite_weight_version{job=~"$job"}, instance)')):
        v = variables[name]
        assert v["type"] == "query" and v["definition"] == definition, v
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        assert query == definition
        assert v["multi"] and v["includeAll"] and not v.get("allValue"), v
        assert v["refresh"] in (1, 2), "options are loaded from Prometheus, not frozen in the file"
    with open(ROOT / "services" / "common" / "metrics.py", encoding="utf-8") as f:
        assert f.read().count('"minite_weight_version"') == 2, "both services export minite_weight_version"


def test_every_query_filters_on_job_and_instance(dashboard):
    for panel in iter_panels(dashboard):
        assert panel.get("targets") or panel["type"] == "row", f"{panel['title']}: no query"
        for t in panel.get("targets", []):
            expr = (t.get("expr") or "").strip()
            selectors = re.findall(r"\b((?:minite|process)_[a-z0-9_]+)(\{[^}]*\})?", expr)
            assert selectors, (panel["title"], expr)
            for name, matchers in selectors:
                assert 'job=~"$job"' in matchers and 'instance=~"$instance"' in matchers, (panel["title"], name, expr)


def test_dashboard_panels_for_training_and_refused_pushes(dashboard):
    reads = {}
    for panel in iter_panels(dashboard):
        for t in panel.get("targets", []):
            for name in referenced_metrics(t["expr"]):
                reads.setdefault(metric_base(name), set()).add(panel["title"])
    for name in TRAINING_GAUGES | {"minite_learner_step_seconds", "minite_weight_sync_rejected_total"} | PROCESS:
        assert name in reads, f"no panel reads {name}"
    assert reads["minite_weight_sync_rejected_total"] == {"Refused weight pushes"}


def test_dashboard_layout(dashboard):
    cells = {}
    for panel in iter_panels(dashboard):
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_metric_contract(registries):
    """GAUGES, COUNTERS and HISTOGRAMS are what the services' registries export (nothing more, nothing less, of
    the same type); the serving set carries model_name; both registries carry process_* metrics."""
    rollout, learner = (exported(r) for r in registries)
    minite = {n: t for n, t in {**rollout, **learner}.items() if n.startswith("minite_")}
    assert {n for n, t in minite.items() if t == "gauge"} == GAUGES
    assert {n for n, t in minite.items() if t == "counter"} == COUNTERS
    assert {n for n, t in minite.items() if t == "histogram"} == HISTOGRAMS
    for exports in (rollout, learner):
        assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_start_time_seconds",
                "process_open_fds"} <= set(exports)
    for fam in registries[0].collect():
        name = fam.name + ("_total" if fam.type == "counter" else "")
        if name in SERVING:
            assert fam.samples and {s.labels.get("model_name") for s in fam.samples} == {"contract-model"}, name
    assert "minite_generated_tokens_total" not in rollout


def test_step_metrics_with_bad_values_keep_the_export_valid():
    """A diverged step (NaN loss, infinite grad norm), a missing key, a string, a NaN step time: the learner's
    /metrics stays valid exposition (prometheus_client's parser and `promtool check metrics` read it); NaN and
    +Inf are exported as they are, the rest is left out, and the counters and the step-time histogram are
    not poisoned."""
    import math

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from services.common.metrics import LearnerMetrics

    m = LearnerMetrics()
    m.record_step({"loss": 0.5, "kl": 0.01, "entropy": 1.5, "grad_norm": 2.0, "clip_ratio": 0.1, "seconds": 1.25,
                   "tokens": 64, "reward": 0.5, "rewards/format/mean": 1.0})
    m.record_step({"loss": float("nan"), "grad_norm": float("inf"), "entropy": "n/a", "clip_ratio": None,
                   "seconds": float("nan"), "tokens": float("inf"), "reward": float("nan"), "rewards/format/mean": "x"})
    text = generate_latest(m.registry).decode()
    values = {s.name + str(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
              for s in f.samples}
    assert math.isnan(values["minite_learner_loss[]"]) and values["minite_learner_grad_norm[]"] == math.inf
    assert values["minite_learner_entropy[]"] == 1.5 and values["minite_learner_clip_ratio[]"] == 0.1  # (left out)
    assert values["minite_learner_kl[]"] == 0.01  # (missing: the last value)
    assert values["minite_learner_steps_total[]"] == 2 and values["minite_learner_tokens_total[]"] == 64
    assert values["minite_learner_step_seconds_count[]"] == 1 and values["minite_learner_step_seconds_sum[]"] == 1.25
    assert values["minite_reward_function_mean[('function', 'format')]"] == 1.0
    promtool = system_tool("promtool")
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_dashboard_metrics_are_exported(dashboard):
    exported_series = GAUGES | COUNTERS | {h + s for h in HISTOGRAMS for s in HISTOGRAM_SERIES} | PROCESS
    used = set()
    for panel in iter_panels(dashboard):
        for t in panel.get("targets", []):
            expr = t.get("expr") or ""
            # the only variables: Grafana's $__rate_interval and the dashboard's $job and $instance
            assert not re.findall(r"\$(?!__rate_interval\b|\{__rate_interval\}|job\b|instance\b)", expr), \
                f"{panel['title']}: {expr}"
            for name in referenced_metrics(expr):
                assert name in exported_series, f"{panel['title']}: {name} is not an exported series"
                used.add(metric_base(name))
            assert referenced_metrics(expr) - PROCESS or panel["title"].startswith("Process"), \
                f"{panel['title']}: {expr} reads no minite metric"
    assert used == GAUGES | COUNTERS | HISTOGRAMS | PROCESS, \
        f"metrics without a panel: {GAUGES | COUNTERS | HISTOGRAMS | PROCESS - used}"


def test_dashboard_queries_parse(tmp_path):
    """Every query is valid PromQL: promtool parses each as a recording rule."""
    promtool = system_tool("promtool")
    queries = panel_queries(DASHBOARD, rate_interval="15s")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr} for i, (_, expr) in enumerate(queries)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = run_tool([promtool, "check", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_panel_queries():
    queries = panel_queries(DASHBOARD, rate_interval="30s")
    assert queries and all(title and expr for title, expr in queries)
    assert not any("$" in expr for _, expr in queries)
    assert any("[30s]" in expr for _, expr in queries)
    assert all('job=~".+"' in expr and 'instance=~".+"' in expr for _, expr in queries)
    assert panel_queries(rate_interval="15s") == panel_queries(str(DASHBOARD), "15s")
    with pytest.raises(ValueError):
        panel_queries(DASHBOARD, rate_interval="$__rate_interval")
    picked = panel_queries(variables={"job": grafana_regex(["minite-learner"]),
                                      "instance": grafana_regex(["10.0.0.1:8001", "10.0.0.2:8001"])})
    assert all('job=~"minite-learner"' in e and r'instance=~"(10\\.0\\.0\\.1:8001|10\\.0\\.0\\.2:8001)"' in e
               for _, e in picked), picked[0]
    with pytest.raises(ValueError, match="no variable"):
        panel_queries(variables={"model": "x"})


def test_panel_queries_refuse_an_unknown_variable(tmp_path):
    model = json.loads(DASHBOARD.read_text())
    model["panels"][0]["targets"][0]["expr"] = 'minite_weight_version{pod=~"$pod"}'
    path = tmp_path / "d.json"
    path.write_text(json.dumps(model))
    with pytest.raises(ValueError, match=r"\$pod"):
        panel_queries(path)


def test_grafana_regex_is_valid_promql(tmp_path):
    """Instances with dots, a job with a quote or a backslash: the matcher parses and means the literal values."""
    promtool = system_tool("promtool")
    values = ["127.0.0.1:8000", 'we"ird\\job', "a|b"]
    value = grafana_regex(values)
    assert value == r'(127\\.0\\.0\\.1:8000|we\"ird\\\\job|a\\|b)'
    regex = re.sub(r'\\(["\\])', r"\1", value)  # the PromQL string's value: the regex Prometheus anchors and runs
    assert all(re.fullmatch(regex, v) for v in values)
    assert not any(re.fullmatch(regex, v) for v in ("127x0x0x1:8000", "a", "b", "127.0.0.1:80001"))
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "r", "expr": f'minite_weight_version{{instance=~"{value}"}}'}]}]}))
    result = run_tool([promtool, "check", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
