"""Static checks of the deployment files: docker-compose.yml, deploy/docker/Dockerfile, .dockerignore,
deploy/prometheus/prometheus.yml, Grafana provisioning and the dashboard deploy/grafana/dashboards/minite.json.

Nothing is started here. Checks that need a system tool (docker-compose, promtool: Debian packages
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

from deploy.grafana.panels import DASHBOARD, iter_panels, panel_queries  # noqa: E402
from tests.service_helpers import system_tool  # noqa: E402

COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA_DATASOURCE = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
GRAFANA_DASHBOARDS = ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "minite.yml"

# Metrics the services export (prometheus_client names: counters end in _total).
GAUGES = {
    "minite_num_requests_running", "minite_num_requests_waiting", "minite_kv_cache_usage_perc",
    "minite_weight_version", "minite_logprob_abs_diff_max", "minite_kl_k3", "minite_token_mismatch_ratio",
    "minite_bitwise_equal_ratio", "minite_reward_mean", "minite_reward_function_mean", "minite_eval",
}
COUNTERS = {
    "minite_prompt_tokens_total", "minite_generated_tokens_total", "minite_weight_sync_bytes_total",
    "minite_requests_total", "minite_learner_tokens_total", "minite_learner_steps_total",
}
HISTOGRAMS = {
    "minite_time_to_first_token_seconds", "minite_inter_token_latency_seconds", "minite_e2e_request_latency_seconds",
    "minite_weight_sync_seconds", "minite_logprob_abs_diff",
}
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")

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
    return set(re.findall(r"minite_[a-z0-9_]+", expr))


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
def datasource_uid() -> str:
    (ds,) = load_yaml(GRAFANA_DATASOURCE)["datasources"]
    return ds["uid"]


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
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard.get("templating", {}).get("list", []) == [], "the dashboard has no template variables"
    panels = list(iter_panels(dashboard))
    assert panels
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles)), "panel titles are unique (the e2e test reports by title)"


def test_dashboard_panels_query_prometheus(dashboard, datasource_uid):
    for panel in iter_panels(dashboard):
        if panel["type"] == "row":
            continue
        title = panel["title"]
        assert panel["datasource"]["uid"] == datasource_uid, title
        targets = panel.get("targets", [])
        assert any((t.get("expr") or "").strip() for t in targets), f"{title}: no query"
        for t in targets:
            assert t.get("datasource", panel["datasource"])["uid"] == datasource_uid, title
            assert (t.get("expr") or "").strip(), f"{title}: target {t.get('refId')} has an empty expr"


def test_dashboard_layout(dashboard):
    cells = {}
    for panel in iter_panels(dashboard):
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_dashboard_metrics_are_exported(dashboard):
    exported = GAUGES | COUNTERS | {h + s for h in HISTOGRAMS for s in HISTOGRAM_SERIES}
    used = set()
    for panel in iter_panels(dashboard):
        for t in panel.get("targets", []):
            expr = t.get("expr") or ""
            # the only Grafana variable allowed: $__rate_interval
            assert not re.findall(r"\$(?!__rate_interval\b|\{__rate_interval\})", expr), f"{panel['title']}: {expr}"
            for name in referenced_metrics(expr):
                assert name in exported, f"{panel['title']}: {name} is not an exported series"
                used.add(metric_base(name))
            assert referenced_metrics(expr), f"{panel['title']}: {expr} reads no minite metric"
    assert used == GAUGES | COUNTERS | HISTOGRAMS, f"metrics without a panel: {GAUGES | COUNTERS | HISTOGRAMS - used}"


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
    assert panel_queries(rate_interval="15s") == panel_queries(str(DASHBOARD), "15s")
    with pytest.raises(ValueError):
        panel_queries(DASHBOARD, rate_interval="$__rate_interval")
