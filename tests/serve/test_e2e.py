"""End to end on real processes over loopback: `minite rollout` and `minite learner` as subprocesses,
a few GRPO steps through gRPC (rollouts pulled, packed NVFP4 weights pushed every step), the REST API
with a real HTTP client, and Debian's real `prometheus` scraping both: every Grafana panel's PromQL
must return data from it."""
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deploy.grafana.panels import panel_queries
from tests.service_helpers import free_port, system_tool

TOKEN = "e2e-token-51c0"
STEPS = 10


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


@pytest.fixture(scope="module")
def stack(service_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    env = dict(os.environ, MINITE_AUTH_TOKEN=TOKEN)
    ports = {k: free_port() for k in ("rg", "rh", "lg", "lh", "prom")}
    procs = []
    try:
        rollout, f1 = _spawn(["rollout", "--model-dir", str(service_model), "--grpc-port", str(ports["rg"]),
                              "--http-port", str(ports["rh"])], tmp / "rollout.log", env)
        procs.append((rollout, f1))
        _wait_http(f"http://127.0.0.1:{ports['rh']}/health", rollout, tmp / "rollout.log")
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
        learner, f2 = _spawn(["learner", "--model-dir", str(service_model), "--rollout", f"127.0.0.1:{ports['rg']}",
                              "--grpc-port", str(ports["lg"]), "--http-port", str(ports["lh"]), "--steps", str(STEPS),
                              "--prompts-per-step", "4", "--num-generations", "4", "--run-dir", str(tmp / "learner")],
                             tmp / "learner.log", env)
        procs.append((learner, f2))
        _wait_http(f"http://127.0.0.1:{ports['lh']}/health", learner, tmp / "learner.log")
        yield {"ports": ports, "tmp": tmp, "learner": learner, "prom": prom}
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


def test_rl_steps_through_the_services(stack):
    url = f"http://127.0.0.1:{stack['ports']['lh']}/v1/status"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        st = httpx.get(url, timeout=10).json()
        if st["done"] or (not st["running"] and st["last_error"] and st["step"] >= STEPS):
            break
        assert stack["learner"].poll() is None, (stack["tmp"] / "learner.log").read_text()[-3000:]
        time.sleep(0.5)
    assert st["done"] and st["step"] == STEPS, st
    stack["done_at"] = time.time()
    hist = [json.loads(x) for x in (stack["tmp"] / "learner" / "metrics.jsonl").read_text().splitlines()]
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


def test_metrics_endpoints(stack):
    lurl, rurl = (f"http://127.0.0.1:{stack['ports'][k]}/metrics" for k in ("lh", "rh"))
    assert _metric(lurl, "minite_bitwise_equal_ratio") == 1.0
    assert _metric(lurl, "minite_logprob_abs_diff_max") == 0.0
    assert _metric(lurl, "minite_weight_sync_bytes_total") > 0
    assert _metric(rurl, "minite_generated_tokens_total") > 0
    assert _metric(rurl, "minite_weight_version") == _metric(lurl, "minite_weight_version")
    # every drift observation fell in the exact-zero bucket
    assert _metric(lurl, 'minite_logprob_abs_diff_bucket{le="0.0"}') == _metric(lurl, "minite_logprob_abs_diff_count") > 0


def test_every_dashboard_panel_has_data(stack):
    system_tool("prometheus")
    assert stack["prom"] is not None
    base = f"http://127.0.0.1:{stack['ports']['prom']}"
    at = stack.get("done_at", time.time())
    time.sleep(3)  # the scrapes after the last step
    empty = []
    for title, expr in panel_queries(rate_interval="30s"):
        r = httpx.get(f"{base}/api/v1/query", params={"query": expr, "time": at}, timeout=10).json()
        assert r["status"] == "success", (title, expr, r)
        values = [float(s["value"][1]) for s in r["data"]["result"]]
        if not values or all(math.isnan(v) for v in values):
            empty.append(f"{title}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


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
