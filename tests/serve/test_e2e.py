"""End to end on real processes over loopback: `minite rollout` and `minite learner` as subprocesses,
a few GRPO steps through gRPC (rollouts pulled, packed NVFP4 weights pushed every step), the REST API
with a real HTTP client, and Debian's real `prometheus` scraping both: every Grafana panel's PromQL,
with the dashboard's job and instance variables filled in from Prometheus as Grafana fills them, must
return data from it; the training panels show the values metrics.jsonl holds, the refused-push panel a
real refused push. Both /metrics endpoints pass `promtool check metrics`, carry process_* metrics, and
the rollout labels its serving metrics with the served model name (as vLLM does)."""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.grafana.panels import DASHBOARD, grafana_regex, panel_queries
from tests.service_helpers import free_port, system_tool

TOKEN = "e2e-token-51c0"
STEPS = 10
MODEL_NAME = "e2e-served-model"  # not the default: the model_name label must come from the setting
# the learner's last-step gauges and the metrics.jsonl keys they export
TRAINING = {"minite_learner_loss": "loss", "minite_learner_kl": "kl", "minite_learner_entropy": "entropy",
            "minite_learner_grad_norm": "grad_norm", "minite_learner_clip_ratio": "clip_ratio"}
# the rollout's serving metrics (vLLM's set): every sample carries model_name
SERVING = {"minite_num_requests_running", "minite_num_requests_waiting", "minite_kv_cache_usage_perc",
           "minite_prompt_tokens", "minite_generation_tokens", "minite_time_to_first_token_seconds",
           "minite_inter_token_latency_seconds", "minite_e2e_request_latency_seconds", "minite_requests"}


def _spawn(args, log: Path, env):
    f = log.open("w")
    return subprocess.Popen([sys.executable, "-m", "minite_core.cli", *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                            cwd=Path(__file__).resolve().parents[2]), f


def _wait_http(url: str, proc, log: Path, timeout=180.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"{url}: process exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not up after {timeout} s:\n{log.read_text()[-3000:]}")


def _scraped_both(base: str) -> bool:
    """Has Prometheus (once it answers) scraped both services?"""
    try:
        return bool(_prom(base, "count(minite_weight_version) == 2", time.time()))
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def stack(service_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    env = dict(os.environ, MINITE_AUTH_TOKEN=TOKEN)
    ports = {k: free_port() for k in ("rg", "rh", "lg", "lh", "prom")}
    procs = []
    started = time.time()
    base = f"http://127.0.0.1:{ports['prom']}"
    auth = {"authorization": f"Bearer {TOKEN}"}
    try:
        prom = None
        if subprocess.run(["which", "prometheus"], capture_output=True).returncode == 0:
            cfg = tmp / "prometheus.yml"
            cfg.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n"
                           f"  - job_name: minite-rollout\n    static_configs:\n      - targets: ['127.0.0.1:{ports['rh']}']\n"
                           f"  - job_name: minite-learner\n    static_configs:\n      - targets: ['127.0.0.1:{ports['lh']}']\n")
            prom = subprocess.Popen(["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{ports['prom']}"],
                                    stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("w"))
            procs.append((prom, None))
        # the learner first: it waits for its rollout replica, paused, until Prometheus scrapes both services,
        # so that every step lands between two scrapes (a step before the first scrape is no rate on a panel)
        learner, f2 = _spawn(["learner", "--model-dir", str(service_model), "--rollout", f"127.0.0.1:{ports['rg']}",
                              "--grpc-port", str(ports["lg"]), "--http-port", str(ports["lh"]), "--steps", str(STEPS),
                              "--prompts-per-step", "4", "--num-generations", "4", "--run-dir", str(tmp / "learner")],
                             tmp / "learner.log", env)
        procs.append((learner, f2))
        _wait_http(f"http://127.0.0.1:{ports['lh']}/health", learner, tmp / "learner.log")
        if prom is not None:
            r = httpx.post(f"http://127.0.0.1:{ports['lh']}/v1/control", json={"action": "pause"}, headers=auth)
            assert r.status_code == 200, r.text
        rollout, f1 = _spawn(["rollout", "--model-dir", str(service_model), "--grpc-port", str(ports["rg"]),
                              "--http-port", str(ports["rh"]), "--model-name", MODEL_NAME], tmp / "rollout.log", env)
        procs.append((rollout, f1))
        _wait_http(f"http://127.0.0.1:{ports['rh']}/health", rollout, tmp / "rollout.log")
        if prom is not None:
            deadline = time.monotonic() + 60
            while not _scraped_both(base):
                assert time.monotonic() < deadline and prom.poll() is None, (tmp / "prometheus.log").read_text()[-3000:]
                time.sleep(0.2)
            r = httpx.post(f"http://127.0.0.1:{ports['lh']}/v1/control", json={"action": "resume"}, headers=auth)
            assert r.status_code == 200, r.text
        yield {"ports": ports, "tmp": tmp, "learner": learner, "prom": prom, "started": started}
    finally:
        for p, f in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
            if f:
                f.close()


def test_rest_on_the_live_rollout(stack):
    url = f"http://127.0.0.1:{stack['ports']['rh']}"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "<bos>3+4=", "max_tokens": 3, "logprobs": 1, "n": 2}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_token_ids"] and all(len(c["token_ids"]) == len(c["logprobs"]["token_logprobs"]) for c in body["choices"])
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "<bos>3+4=", "max_tokens": 0}).status_code == 400
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "<bos>3+4="}],
                                                          "max_tokens": 3}, timeout=60)
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"


def _trained(stack) -> dict:
    """The learner's status once its run has ended (the tests after the steps can run alone, -k)."""
    url = f"http://127.0.0.1:{stack['ports']['lh']}/v1/status"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        st = httpx.get(url, timeout=10).json()
        if st["done"] or (not st["running"] and st["last_error"] and st["step"] >= STEPS):
            break
        assert stack["learner"].poll() is None, (stack["tmp"] / "learner.log").read_text()[-3000:]
        time.sleep(0.5)
    assert st["done"] and st["step"] == STEPS, st
    return st


def test_rl_steps_through_the_services(stack):
    st = _trained(stack)
    hist = _history(stack)
    assert [m["step"] for m in hist] == list(range(1, STEPS + 1))
    assert [m["weight_version"] for m in hist] == list(range(2, STEPS + 2))  # monotonic, one per step
    # rollout logprobs (sampled by another process, sent over gRPC) == learner logprobs, bitwise
    assert all(m["sampling/sampling_logp_difference/max"] == 0.0 for m in hist)
    assert all(m["sampling/importance_sampling_ratio/min"] == 1.0 == m["sampling/importance_sampling_ratio/max"] for m in hist)
    rollout_version = httpx.get(f"http://127.0.0.1:{stack['ports']['rh']}/v1/weight_version").json()["weight_version"]
    assert rollout_version == st["weight_version"] == STEPS + 1


def _metric(url, name):
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported by {url}")


def _families(url) -> dict:
    """name -> MetricFamily of a /metrics endpoint, read with prometheus_client's own parser."""
    return {f.name: f for f in text_string_to_metric_families(httpx.get(url, timeout=10).text)}


def _history(stack) -> list[dict]:
    return [json.loads(x) for x in (stack["tmp"] / "learner" / "metrics.jsonl").read_text().splitlines()]


def test_metrics_endpoints(stack):
    _trained(stack)
    lurl, rurl = (f"http://127.0.0.1:{stack['ports'][k]}/metrics" for k in ("lh", "rh"))
    assert _metric(lurl, "minite_bitwise_equal_ratio") == 1.0
    assert _metric(lurl, "minite_logprob_abs_diff_max") == 0.0
    assert _metric(lurl, "minite_weight_sync_bytes_total") > 0
    assert _metric(rurl, "minite_weight_version") == _metric(lurl, "minite_weight_version")
    # every drift observation fell in the exact-zero bucket
    assert _metric(lurl, 'minite_logprob_abs_diff_bucket{le="0.0"}') == _metric(lurl, "minite_logprob_abs_diff_count") > 0


def test_learner_exports_its_training_metrics(stack):
    """After the steps: the last step's loss, KL, entropy, grad norm and clip ratio, finite and equal to
    metrics.jsonl's last row; the step-time histogram holds every step."""
    _trained(stack)
    hist = _history(stack)
    fam = _families(f"http://127.0.0.1:{stack['ports']['lh']}/metrics")
    for name, key in TRAINING.items():
        assert name in fam and fam[name].type == "gauge" and fam[name].documentation, name
        (sample,) = fam[name].samples
        assert math.isfinite(sample.value) and sample.value == pytest.approx(hist[-1][key], rel=1e-9, abs=1e-12), \
            (name, sample.value, hist[-1][key])
    steps = {s.name: s for s in fam["minite_learner_step_seconds"].samples if s.name != "minite_learner_step_seconds_bucket"}
    assert fam["minite_learner_step_seconds"].type == "histogram"
    assert steps["minite_learner_step_seconds_count"].value == STEPS
    assert steps["minite_learner_step_seconds_sum"].value == pytest.approx(sum(m["seconds"] for m in hist), rel=1e-6)
    assert fam["minite_learner_steps"].samples[0].value == STEPS
    assert fam["minite_reward_mean"].samples[0].value == pytest.approx(hist[-1]["reward"])


def test_process_metrics_and_lint(stack):
    """Both services export process_* (their own processes) and pass `promtool check metrics` (help texts,
    counter names, units)."""
    promtool = system_tool("promtool")
    for port in ("rh", "lh"):
        url = f"http://127.0.0.1:{stack['ports'][port]}/metrics"
        text = httpx.get(url, timeout=10).text
        fam = {f.name: f for f in text_string_to_metric_families(text)}
        assert fam["process_cpu_seconds"].samples[0].value > 0, url
        assert fam["process_resident_memory_bytes"].samples[0].value > 50e6, url  # (torch and the model are loaded)
        assert fam["process_open_fds"].samples[0].value > 0, url
        assert fam["process_start_time_seconds"].samples[0].value >= stack["started"] - 5, url
        lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert lint.returncode == 0, (url, lint.stdout + lint.stderr)


def test_serving_metrics_carry_the_model_name(stack):
    """Every serving metric is labelled model_name=<the served model name GET /v1/models reports>, as vLLM's;
    vLLM's name for sampled tokens (generation_tokens); the weight-sync metrics stay unlabelled."""
    _trained(stack)  # (the learner's requests have gone through)
    base = f"http://127.0.0.1:{stack['ports']['rh']}"
    served = [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]]
    assert served == [MODEL_NAME]
    fam = _families(f"{base}/metrics")
    assert SERVING <= set(fam), SERVING - set(fam)
    for name in SERVING:
        assert fam[name].samples, name
        assert {s.labels.get("model_name") for s in fam[name].samples} == {MODEL_NAME}, name
    assert "minite_generated_tokens" not in fam
    gen = [s for s in fam["minite_generation_tokens"].samples if s.name == "minite_generation_tokens_total"]
    assert gen and gen[0].value > 0
    assert all("model_name" not in s.labels for s in fam["minite_weight_version"].samples)


def _refuse_a_push(stack) -> None:
    """A real refused weight push: an older version than the rollout serves (FAILED_PRECONDITION, stale)."""
    from minite.v1 import rollout_pb2_grpc as pb_grpc
    from services.common.weights import encode_update

    with grpc.insecure_channel(f"127.0.0.1:{stack['ports']['rg']}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.RolloutServiceStub(ch).UpdateWeights(iter(encode_update({}, 1)), timeout=30,
                                                         metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "stale" in e.value.details(), e.value.details()


def _prom(base: str, query: str, at: float) -> list:
    r = httpx.get(f"{base}/api/v1/query", params={"query": query, "time": at}, timeout=10).json()
    assert r["status"] == "success", (query, r)
    return r["data"]["result"]


def _label_values(base: str, definition: str, variables: dict) -> list[str]:
    """A `label_values(selector, label)` variable query, run as Grafana runs it (the series API)."""
    m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition)
    assert m, definition
    selector = m.group(1)
    for name, value in variables.items():
        selector = selector.replace(f"${name}", value)
    r = httpx.get(f"{base}/api/v1/series", params={"match[]": selector}, timeout=10).json()
    assert r["status"] == "success", (definition, r)
    return sorted({s[m.group(2)] for s in r["data"] if m.group(2) in s})


def test_every_dashboard_panel_has_data(stack):
    system_tool("prometheus")
    assert stack["prom"] is not None
    base = f"http://127.0.0.1:{stack['ports']['prom']}"
    _trained(stack)
    _refuse_a_push(stack)
    deadline = time.monotonic() + 30
    while not _prom(base, 'minite_weight_sync_rejected_total{job="minite-rollout"} > 0', time.time()):
        assert time.monotonic() < deadline, "Prometheus never scraped the refused push"
        time.sleep(0.5)
    at = time.time()
    window = f"{int(at - stack['started']) + 30}s"  # the whole run: the steps, the pushes, the refused push
    # the dashboard's variables, filled in as Grafana does: each query's values, "All" = all of them as (a|b)
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {}
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            values = _label_values(base, v["definition"], variables)
            assert values, f"variable {v['name']}: {v['definition']} gives no values"
            variables[v["name"]] = grafana_regex(values)
    assert set(variables) == {"job", "instance"}
    assert _label_values(base, "label_values(minite_weight_version, job)", {}) == ["minite-learner", "minite-rollout"]
    empty, results = [], {}
    for title, expr in panel_queries(rate_interval=window, variables=variables):
        values = [float(s["value"][1]) for s in _prom(base, expr, at)]
        results.setdefault(title, []).extend(values)
        if not values or all(math.isnan(v) for v in values):
            empty.append(f"{title}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    # the training panels show what metrics.jsonl holds; the refused push shows
    last = _history(stack)[-1]
    for title, key in (("Loss", "loss"), ("KL to the reference", "kl"), ("Entropy", "entropy"),
                       ("Grad norm", "grad_norm"), ("Clip ratio", "clip_ratio")):
        assert results[title] == [pytest.approx(last[key], rel=1e-9, abs=1e-12)], (title, results[title], last[key])
    assert max(results["Refused weight pushes"]) > 0
    # every query honours both variables: an instance or a job nobody has leaves every panel empty
    for other in ({"instance": "nowhere:1"}, {"job": "no-such-job"}):
        unfiltered = [f"{t}: {e}" for t, e in panel_queries(rate_interval=window, variables={**variables, **other})
                      if _prom(base, e, at)]
        assert not unfiltered, f"queries that ignore {other}:\n" + "\n".join(unfiltered)


def test_minite_up_runs_the_job(service_model, tmp_path):
    """The README's main job, shortened, with two rollout replicas: `minite up` starts the services (and
    Prometheus when installed), runs the RL job through them, prints where the metrics are, and stops
    everything; both replicas sampled, and both serve the last weight version."""
    import re

    ports = [str(free_port()) for _ in range(5)]
    r = subprocess.run([sys.executable, "-m", "minite_core.cli", "up", "--model-dir", str(service_model), "--run-dir",
                        str(tmp_path / "up"), "--steps", "2", "--prompts-per-step", "4", "--rollout-grpc-port", ports[0],
                        "--rollout-http-port", ports[1], "--learner-grpc-port", ports[2], "--learner-http-port", ports[3],
                        "--prometheus-port", ports[4], "--replicas", "2"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"metrics http://127.0.0.1:{ports[1]}/metrics" in r.stdout and "max rollout/learner |Δlogp| over 2 steps: 0" in r.stdout
    rows = [json.loads(x) for x in (tmp_path / "up" / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    served = re.findall(r"rollout replica (\d) \(127.0.0.1:(\d+)\): (\d+) tokens sampled, serving weight version (\d+)", r.stdout)
    assert [s[0] for s in served] == ["0", "1"] and served[0][1] == ports[0] and served[1][1] != ports[0], r.stdout
    assert all(int(s[2]) > 0 for s in served), served  # the learner spread its prompts over both
    assert {int(s[3]) for s in served} == {rows[-1]["weight_version"]}  # every version fanned out to both
    rest = re.findall(r"REST http://127.0.0.1:(\d+)/v1/completions", r.stdout)
    assert len(rest) == 2 and rest[0] == ports[1]
    if shutil.which("prometheus"):  # Prometheus scrapes both replicas
        cfg = (tmp_path / "up" / "prometheus.yml").read_text()
        assert all(f"127.0.0.1:{p}" in cfg for p in rest), cfg
