"""Reliability and security of the services on real processes (`minite rollout|learner` as subprocesses on
loopback, like test_e2e): overload (bounded queue -> prompt 429 / RESOURCE_EXHAUSTED, bounded memory,
recovery), graceful shutdown (SIGTERM: the work in flight finishes, new work is refused with 503 /
UNAVAILABLE, exit 0 within a bound), auth (refusals logged with the method, the token never in the logs
or the metrics) and TLS (learner -> rollout over TLS, REST over HTTPS, plaintext refused).

Every wait has a timeout and every process is killed in a `finally`. Each scenario prints one line
"RELIABILITY: <scenario> key=value ..." with what it measured (`pytest -s` shows them)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minite.v1 import learner_pb2 as lpb
from minite.v1 import learner_pb2_grpc as lpb_grpc
from minite.v1 import rollout_pb2 as pb
from minite.v1 import rollout_pb2_grpc as pb_grpc
from services.common.weights import encode_update, raw_update_call
from tests.service_helpers import Proc, free_port, new_weights, report, system_tool

TOKEN = "rel-secret-Q7f3a9c2d1"  # distinctive: searched for in the logs and the metrics
WRONG = "rel-wrong-Z4k8m1x0p5"
PROMPT = [1, 4, 5, 13, 6, 7, 14]  # <bos>12+34=  (the model's context is 32 tokens)
SLOTS, WAITING = 4, 36  # the overload rollout: more admissible calls than the gRPC server's old 32 workers


def _metric(base: str, name: str, verify=True) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10, verify=verify).text.splitlines():
        if line.startswith((name + " ", name + "{")):  # (serving metrics carry model_name, as vLLM's do)
            return float(line.rsplit(None, 1)[1])
    raise AssertionError(f"{name} not exported by {base}")


def _gen(max_tokens: int, n: int = 1) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=PROMPT), params=pb.SamplingParams(max_tokens=max_tokens, n=n))


# -- the plain rollout: overload and graceful shutdown -------------------------------------------------
@pytest.fixture(scope="module")
def plain(service_model, tmp_path_factory):
    """A rollout with a small queue (SLOTS running, WAITING waiting) and a 20 s drain bound."""
    tmp = tmp_path_factory.mktemp("reliability-plain")
    g, h = free_port(), free_port()
    proc = Proc(["rollout", "--model-dir", str(service_model), "--grpc-port", str(g), "--http-port", str(h),
                 "--max-slots", str(SLOTS), "--max-waiting", str(WAITING), "--drain-timeout", "20"], tmp / "rollout.log")
    channel = None
    try:
        proc.wait_http(f"http://127.0.0.1:{h}/health")
        channel = grpc.insecure_channel(f"127.0.0.1:{g}")
        yield {"proc": proc, "url": f"http://127.0.0.1:{h}", "channel": channel,
               "stub": pb_grpc.RolloutServiceStub(channel), "health": health_pb2_grpc.HealthStub(channel)}
    finally:
        if channel is not None:
            channel.close()
        proc.kill()


def _burst(plain, n_grpc: int, n_rest: int, max_tokens: int) -> dict:
    """n_grpc Generate calls and n_rest POST /v1/completions at once -> outcomes and latencies (s)."""
    stub, url = plain["stub"], plain["url"]
    grpc_out: list = [None] * n_grpc
    rest_out: list = [None] * n_rest
    health_s: list = []

    def on_done(i, t0):
        def cb(fut):
            e = fut.exception()
            if e is None:
                resp = fut.result()
                ok = all(len(c.token_ids) == max_tokens for c in resp.choices)
                grpc_out[i] = ("ok" if ok else "short", time.perf_counter() - t0)
            else:
                grpc_out[i] = (e.code().name, time.perf_counter() - t0)
        return cb

    async def rest_one(client, i):
        t0 = time.perf_counter()
        try:
            r = await client.post(f"{url}/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, "max_tokens": max_tokens})
            if r.status_code == 200:
                ok = all(len(c["token_ids"]) == max_tokens for c in r.json()["choices"])
                rest_out[i] = ("ok" if ok else "short", time.perf_counter() - t0)
            else:
                rest_out[i] = (str(r.status_code), time.perf_counter() - t0)
        except httpx.HTTPError as e:
            rest_out[i] = (type(e).__name__, time.perf_counter() - t0)

    async def main():
        futs = []
        limits = httpx.Limits(max_connections=n_rest + 8, max_keepalive_connections=n_rest + 8)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            tasks = []
            for i in range(max(n_grpc, n_rest)):  # interleaved: both protocols hit the queue together
                if i < n_grpc:
                    t0 = time.perf_counter()
                    f = stub.Generate.future(_gen(max_tokens), timeout=120)
                    f.add_done_callback(on_done(i, t0))
                    futs.append(f)
                if i < n_rest:
                    tasks.append(asyncio.create_task(rest_one(client, i)))
            await asyncio.sleep(0.05)
            # while the queue is full: the gRPC health check still answers at once
            t0 = time.perf_counter()
            st = await asyncio.to_thread(plain["health"].Check, health_pb2.HealthCheckRequest(), timeout=10)
            health_s.append(time.perf_counter() - t0)
            assert st.status == health_pb2.HealthCheckResponse.SERVING
            await asyncio.gather(*tasks)
        for f in futs:
            try:
                f.result(timeout=120)
            except grpc.RpcError:
                pass
        deadline = time.monotonic() + 5
        while None in grpc_out and time.monotonic() < deadline:  # (done callbacks run on grpc's threads)
            time.sleep(0.01)

    asyncio.run(main())
    grpc_out = [o or ("no answer", 0.0) for o in grpc_out]
    outcomes = [o for o, _ in grpc_out + rest_out]
    refused = [s for o, s in grpc_out if o == "RESOURCE_EXHAUSTED"] + [s for o, s in rest_out if o == "429"]
    served = [s for o, s in grpc_out + rest_out if o == "ok"]
    other = sorted({o for o in outcomes if o not in ("ok", "RESOURCE_EXHAUSTED", "429")})
    return {"sent": len(outcomes), "served": len(served), "refused": len(refused), "other": other,
            "refused_grpc": sum(o == "RESOURCE_EXHAUSTED" for o, _ in grpc_out),
            "refused_rest": sum(o == "429" for o, _ in rest_out), "refusal_s": sorted(refused),
            "refusal_grpc_s": sorted(s for o, s in grpc_out if o == "RESOURCE_EXHAUSTED"),
            "refusal_rest_s": sorted(s for o, s in rest_out if o == "429"),
            "served_s": sorted(served), "health_s": health_s[0]}


def _refusal_probes(plain, count: int) -> dict:
    """With the queue held full by long requests, `count` sequential requests per API: each must be refused
    (too many sequences to fit), and how long each refusal took is what the server alone adds."""
    stub, url = plain["stub"], plain["url"]
    fill = [stub.Generate.future(_gen(24, n=4), timeout=120) for _ in range((SLOTS + WAITING) // 4)]
    try:
        deadline = time.monotonic() + 30
        # (one fill request may itself be refused when it races the engine taking the first ones in)
        while _metric(url, "minite_num_requests_waiting") <= WAITING - 8:
            assert time.monotonic() < deadline, "the queue did not fill"
            time.sleep(0.02)
        probe = _gen(4, n=8)  # refused while more than WAITING - 8 sequences wait
        lat = {"grpc": [], "rest": []}
        with httpx.Client(timeout=30) as client:
            for _ in range(count):
                t0 = time.perf_counter()
                with pytest.raises(grpc.RpcError) as e:
                    stub.Generate(probe, timeout=30)
                lat["grpc"].append(time.perf_counter() - t0)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
                t0 = time.perf_counter()
                r = client.post(f"{url}/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, "max_tokens": 4, "n": 8})
                lat["rest"].append(time.perf_counter() - t0)
                assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
    finally:
        for f in fill:  # the clients go away: their work is cancelled, the queue empties
            f.cancel()
    t0 = time.perf_counter()
    deadline = time.monotonic() + 30
    while _metric(url, "minite_num_requests_waiting") + _metric(url, "minite_num_requests_running"):
        assert time.monotonic() < deadline, "cancelled requests still queued"
        time.sleep(0.02)
    return {k: sorted(v) for k, v in lat.items()} | {"cancel_drain_s": time.perf_counter() - t0}


def test_overload_refuses_fast_stays_bounded_and_recovers(plain):
    proc = plain["proc"]
    n_grpc, n_rest, max_tokens = 60, 40, 4
    warm = _burst(plain, n_grpc, n_rest, max_tokens)  # first burst: threads, buffers and allocator pools grow once
    rss_before = proc.rss_mb()
    bursts = [_burst(plain, n_grpc, n_rest, max_tokens) for _ in range(3)]
    # gRPC alone, more calls than the queue admits: each Generate call holds a server thread while it waits, so
    # with too few threads the extra calls would wait unseen for one (neither refused nor queued by us), and
    # so would the health checks behind them
    grpc_only = _burst(plain, 60, 0, 8)
    probes = _refusal_probes(plain, 10)
    rss_after = proc.rss_mb()
    # the service recovers: the queue is empty again and normal requests on both APIs succeed
    r = httpx.post(f"{plain['url']}/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, "max_tokens": 4}, timeout=30)
    g = plain["stub"].Generate(_gen(4, n=2), timeout=30)
    recovered = (r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4
                 and [len(c.token_ids) for c in g.choices] == [4, 4])
    refusals = sorted(s for b in bursts for s in b["refusal_s"])
    served = sorted(s for b in bursts for s in b["served_s"])
    health_worst = max(b["health_s"] for b in bursts + [grpc_only])
    probe_all = sorted(probes["grpc"] + probes["rest"])
    ms = lambda xs, q: f"{_q(xs, q) * 1e3:.0f}" if xs else "-"  # noqa: E731
    report("overload", requests_per_burst=f"{n_grpc}grpc+{n_rest}rest", bursts=f"1+{len(bursts)}",
           queue_bound=f"{SLOTS}slots+{WAITING}waiting", served=len(served), refused=len(refusals),
           refused_grpc=sum(b["refused_grpc"] for b in bursts), refused_rest=sum(b["refused_rest"] for b in bursts),
           burst_refusal_ms_p50=ms(refusals, 0.5), burst_refusal_ms_max=ms(refusals, 1.0),
           burst_served_ms_p50=ms(served, 0.5), grpc_only_burst=f"60sent/{grpc_only['served']}served/"
           f"{grpc_only['refused']}refused/refusal_ms_max={ms(grpc_only['refusal_s'], 1.0)}",
           health_check_in_burst_ms_max=f"{health_worst * 1e3:.0f}",
           full_queue_refusal_ms_p50=ms(probe_all, 0.5), full_queue_refusal_ms_p90=ms(probe_all, 0.9),
           full_queue_refusal_ms_max=ms(probe_all, 1.0), cancelled_queue_emptied_s=f"{probes['cancel_drain_s']:.2f}",
           rss_before_mb=f"{rss_before:.1f}", rss_after_mb=f"{rss_after:.1f}", recovered=recovered)
    for b in [warm] + bursts:
        assert not b["other"], f"outcomes other than served / refused as overloaded: {b['other']}"
        assert b["served"] + b["refused"] == b["sent"] == n_grpc + n_rest
        assert b["refused_grpc"] > 0 and b["refused_rest"] > 0, b  # the burst went beyond the bound, on both APIs
        assert b["served"] >= WAITING, b  # what fits the queue is served, in full (max_tokens tokens each)
    assert recovered, (r.text, g)
    assert not grpc_only["other"] and grpc_only["refused"] >= 10, grpc_only
    # a refusal does not wait for the engine: the server answers it within milliseconds (it used to wait for
    # the lock, behind steps the loop took back unfairly), and inside a burst well before the served requests.
    # Bounds on the median and the 90th percentile, and a loose one on the worst: on two cores shared with the
    # engine thread and the other test worker one probe in twenty was once descheduled for 1.3 s (1 CI run of 7)
    assert _q(probe_all, 0.5) < 0.025 and _q(probe_all, 0.9) < 0.25 and max(probe_all) < 3.0, probe_all
    assert _q(refusals, 0.5) < 0.5 * _q(served, 0.5) and max(refusals) < 3.0, (refusals, served)
    # weight pushes and health checks keep a gRPC worker however many calls are queued
    assert health_worst < 1.0, health_worst
    # memory is bounded: three more bursts of 100 requests and the probes do not grow the process
    assert rss_after - rss_before < 40, (rss_before, rss_after)


def _q(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def test_sigterm_drains_in_flight_refuses_new_and_exits_0(plain):
    """REST requests short, gRPC calls long: the gRPC calls are still in flight once every HTTP response is
    done (where uvicorn alone would have exited and re-raised SIGTERM, cutting them)."""
    proc, url, stub = plain["proc"], plain["url"], plain["stub"]
    short, long = 8, 24
    results: dict = {}

    def rest_stream(key, n):
        max_tokens = short
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "ignore_eos": True, "max_tokens": max_tokens, "n": n, "stream": True}) as r:
            assert r.status_code == 200
            toks, finish, done = {}, {}, False
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    c = json.loads(line[6:])["choices"][0]
                    toks[c["index"]] = toks.get(c["index"], 0) + len(c["token_ids"])
                    if c["finish_reason"]:
                        finish[c["index"]] = c["finish_reason"]
        results[key] = done and toks == {i: max_tokens for i in range(n)} and set(finish.values()) == {"length"}

    def rest_plain(key):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, "max_tokens": short, "n": 2}, timeout=60)
        results[key] = r.status_code == 200 and [len(c["token_ids"]) for c in r.json()["choices"]] == [short] * 2

    def grpc_unary(key):
        resp = stub.Generate(_gen(long, n=4), timeout=60)
        results[key] = [(len(c.token_ids), c.finish_reason) for c in resp.choices] == [(long, "length")] * 4

    def grpc_stream(key):
        toks = sum(1 for ev in stub.GenerateStream(_gen(long), timeout=60) if ev.HasField("token_id"))
        results[key] = toks == long

    def run(fn, key, *a):
        try:
            fn(key, *a)
        except Exception as e:  # recorded: an in-flight request that was cut
            results[key] = f"{type(e).__name__}: {e}"

    work = ([(rest_stream, f"rest_stream{i}", 2) for i in range(2)] + [(rest_plain, "rest")]
            + [(grpc_unary, f"grpc{i}") for i in range(3)] + [(grpc_stream, f"grpc_stream{i}") for i in range(2)])
    seqs = 2 * 2 + 2 + 3 * 4 + 2
    threads = [threading.Thread(target=run, args=w, daemon=True) for w in work]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while _metric(url, "minite_num_requests_running") + _metric(url, "minite_num_requests_waiting") < seqs:
        assert time.monotonic() < deadline, "the requests did not arrive"
        time.sleep(0.02)
    rc = None
    try:
        t_sig = time.monotonic()
        proc.p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while httpx.get(f"{url}/health", timeout=10).status_code == 200:  # the stop begins within 0.1 s
            assert time.monotonic() < deadline, "no drain after SIGTERM"
            time.sleep(0.01)
        # during the drain: new work is refused, on both APIs; the health checks say so
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, "max_tokens": 2}, timeout=10)
        assert r.status_code == 503, (r.status_code, r.text)
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(_gen(2), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        assert plain["health"].Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        refused_during_drain = 2
        still_in_flight = sum(t.is_alive() for t in threads)
        for t in threads:
            t.join(40)
        drained_s = time.monotonic() - t_sig
        try:
            rc = proc.p.wait(20)
        except subprocess.TimeoutExpired:
            rc = None
        exit_s = time.monotonic() - t_sig
    finally:
        if proc.p.poll() is None:
            proc.p.kill()
    completed = sum(v is True for v in results.values())
    report("graceful_shutdown", in_flight_requests=len(work), in_flight_sequences=seqs,
           still_in_flight_after_refusals=still_in_flight, completed=completed, cut=len(work) - completed,
           refused_during_drain=refused_during_drain, drained_s=f"{drained_s:.1f}", exit_code=rc,
           exit_s=f"{exit_s:.1f}")
    assert still_in_flight > 0, "the work finished before the refusals were checked: the test did not test the drain"
    assert all(v is True for v in results.values()) and len(results) == len(work), results
    assert rc == 0, (rc, proc.text()[-3000:])
    assert exit_s < 30, exit_s
    assert "every request in flight finished" in proc.text()



def test_sigterm_cuts_what_outlasts_the_drain_bound(service_model, tmp_path):
    """Work longer than --drain-timeout: it is cut at the bound (finish "abort"), every client still gets a
    well-formed answer (nothing hangs, no transport error), and the process exits 0 soon after the bound."""
    g, h = free_port(), free_port()
    proc = Proc(["rollout", "--model-dir", str(service_model), "--grpc-port", str(g), "--http-port", str(h),
                 "--max-slots", "1", "--max-waiting", "64", "--drain-timeout", "1"], tmp_path / "rollout.log")
    out: dict = {}
    try:
        url = f"http://127.0.0.1:{h}"
        proc.wait_http(f"{url}/health")
        with grpc.insecure_channel(f"127.0.0.1:{g}") as ch:
            stub = pb_grpc.RolloutServiceStub(ch)
            futs = [stub.Generate.future(_gen(24, n=4), timeout=60) for _ in range(6)]  # ~600 steps on one slot

            def stream():
                finish, done = [], False
                with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                                  json={"prompt": PROMPT, "ignore_eos": True, "max_tokens": 24, "n": 2, "stream": True}) as r:
                    for line in r.iter_lines():
                        done |= line == "data: [DONE]"
                        if line.startswith("data: {"):
                            c = json.loads(line[6:])["choices"][0]
                            finish += [c["finish_reason"]] if c["finish_reason"] else []
                out["stream"] = (done, sorted(finish))
            t = threading.Thread(target=stream, daemon=True)
            t.start()
            deadline = time.monotonic() + 30
            while _metric(url, "minite_num_requests_running") + _metric(url, "minite_num_requests_waiting") < 26:
                assert time.monotonic() < deadline, "the requests did not arrive"
                time.sleep(0.02)
            rc, exit_s = proc.terminate(timeout=20)
            t.join(10)
            for i, f in enumerate(futs):
                try:
                    out[f"grpc{i}"] = sorted({c.finish_reason for c in f.result(timeout=10).choices})
                except grpc.RpcError as e:
                    out[f"grpc{i}"] = e.code().name
    finally:
        proc.kill()
    cut = sum("abort" in v for k, v in out.items() if k.startswith("grpc")) + ("abort" in out.get("stream", ((), ()))[1])
    report("drain_bound", drain_timeout_s=1, in_flight_requests=7, answered=len(out), requests_with_cut_sequences=cut,
           exit_code=rc, exit_s=f"{exit_s:.1f}")
    assert rc == 0 and exit_s < 8, (rc, exit_s, proc.text()[-3000:])
    assert out.get("stream", (False,))[0] and len(out["stream"][1]) == 2, out  # both choices ended, then [DONE]
    assert all(isinstance(v, list) for k, v in out.items() if k.startswith("grpc")) and len(out) == 7, out
    assert cut >= 1 and "drain timed out" in proc.text(), out

# -- the secure stack: rollout + learner with a token and TLS, debug logs ------------------------------
def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run([system_tool("openssl"), "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.fixture(scope="module")
def secure(service_model, tmp_path_factory):
    """`minite rollout` and `minite learner` with MINITE_AUTH_TOKEN (from the environment, as advised) and
    --tls-cert/--tls-key/--tls-ca, at --log-level debug; the learner trains against the rollout over TLS."""
    tmp = tmp_path_factory.mktemp("reliability-secure")
    cert, key = _self_signed(tmp)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(cert), "--log-level", "debug"]
    env = {"MINITE_AUTH_TOKEN": TOKEN}
    rg, rh, lg, lh = (free_port() for _ in range(4))
    procs, channels = [], []
    try:
        rollout = Proc(["rollout", "--model-dir", str(service_model), "--grpc-port", str(rg), "--http-port", str(rh), *tls],
                       tmp / "rollout.log", env)
        procs.append(rollout)
        learner = Proc(["learner", "--model-dir", str(service_model), "--rollout", f"127.0.0.1:{rg}", "--grpc-port", str(lg),
                        "--http-port", str(lh), "--steps", "100", "--prompts-per-step", "2", "--num-generations", "2",
                        "--run-dir", str(tmp / "learner"), "--drain-timeout", "3", *tls], tmp / "learner.log", env)
        procs.append(learner)
        rollout.wait_http(f"https://127.0.0.1:{rh}/health", verify=str(cert))
        learner.wait_http(f"https://127.0.0.1:{lh}/health", verify=str(cert))
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        rch, lch = grpc.secure_channel(f"127.0.0.1:{rg}", creds), grpc.secure_channel(f"127.0.0.1:{lg}", creds)
        channels += [rch, lch]
        yield {"rollout": rollout, "learner": learner, "cert": cert, "rurl": f"https://127.0.0.1:{rh}",
               "lurl": f"https://127.0.0.1:{lh}", "rg": rg, "lg": lg, "rch": rch, "lch": lch}
    finally:
        for ch in channels:
            ch.close()
        for p in procs:
            p.kill()


def test_tls_learner_trains_over_tls_and_plaintext_is_refused(secure):
    ca = str(secure["cert"])
    t0 = time.monotonic()
    st = {}
    while time.monotonic() - t0 < 180:  # the learner's steps advance: it samples and pushes weights over TLS
        st = httpx.get(f"{secure['lurl']}/v1/status", timeout=10, verify=ca).json()
        if st["step"] >= 2:
            break
        assert secure["learner"].p.poll() is None, secure["learner"].text()[-3000:]
        time.sleep(0.3)
    steps_s = time.monotonic() - t0
    assert st.get("step", 0) >= 2, (st, secure["learner"].text()[-3000:])
    rollout_version = httpx.get(f"{secure['rurl']}/v1/weight_version", timeout=10, verify=ca).json()["weight_version"]
    assert rollout_version >= 3, rollout_version  # (version 1 is the learner's first push; one more per step)
    # plaintext clients are refused: HTTP on the HTTPS port, and gRPC without TLS, on both services
    plain_http = {}
    for name, url in (("rollout", secure["rurl"]), ("learner", secure["lurl"])):
        try:
            plain_http[name] = str(httpx.get(url.replace("https://", "http://") + "/health", timeout=5).status_code)
        except httpx.HTTPError as e:
            plain_http[name] = type(e).__name__
        assert plain_http[name] != "200", plain_http
    plain_grpc = {}
    for name, port in (("rollout", secure["rg"]), ("learner", secure["lg"])):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as e:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            plain_grpc[name] = e.value.code().name
    assert set(plain_grpc.values()) == {"UNAVAILABLE"}, plain_grpc
    # a client that does not trust the service's CA is refused too
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{secure['rurl']}/health", timeout=5)
    report("tls", learner_step=st["step"], seconds_to_step_2=f"{steps_s:.1f}", rollout_weight_version=rollout_version,
           plaintext_http=",".join(f"{k}:{v}" for k, v in plain_http.items()),
           plaintext_grpc=",".join(f"{k}:{v}" for k, v in plain_grpc.items()), untrusted_https="ConnectError")


def _wait_log(proc: Proc, needles: list[str], timeout: float = 10.0) -> list[str]:
    """The needles not in the process log after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        text = proc.text()
        missing = [n for n in needles if n not in text]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.1)


def test_auth_refusals_logged_and_token_never_leaks(secure, service_model):
    ca = str(secure["cert"])
    push = raw_update_call(secure["rch"])
    weights = new_weights(service_model, seed=7)  # a sound push of the right shapes: refused for the token alone
    lstub = lpb_grpc.LearnerServiceStub(secure["lch"])
    traj = lpb.Trajectory(prompt_ids=PROMPT, completion_ids=[3], rollout_logprobs=[-1.0], weight_version=1)
    rstub = pb_grpc.RolloutServiceStub(secure["rch"])
    version_before = rstub.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=10).version
    codes = []
    for md in ((), (("authorization", f"Bearer {WRONG}"),)):
        with pytest.raises(grpc.RpcError) as e:
            push(encode_update(weights, 10**6, raw=True), metadata=md, timeout=30)
        codes.append(("UpdateWeights", e.value.code().name))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and TOKEN not in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            lstub.SubmitTrajectories(iter([traj]), metadata=md, timeout=30)
        codes.append(("SubmitTrajectories", e.value.code().name))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and TOKEN not in e.value.details()
        r = httpx.post(f"{secure['lurl']}/v1/control", json={"action": "pause"}, headers=dict(md), timeout=10, verify=ca)
        codes.append(("/v1/control", r.status_code))
        assert r.status_code == 401 and TOKEN not in r.text
    assert httpx.get(f"{secure['lurl']}/v1/status", timeout=10, verify=ca).json()["paused"] is False
    version_after = rstub.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=10).version
    assert version_after < 10**6  # the refused push was not applied (the learner's own pushes go on)
    # the right token passes (so the refusals above were about the token)
    ok = httpx.post(f"{secure['lurl']}/v1/control", json={"action": "resume"}, timeout=10, verify=ca,
                    headers={"authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200, ok.text
    # every refusal is logged with its method and why; the token (and the wrong one) never is
    why = ("missing", "wrong")
    missing = (_wait_log(secure["rollout"], [f"refused /minite.v1.RolloutService/UpdateWeights: {w} token" for w in why])
               + _wait_log(secure["learner"], [f"refused {m}: {w} token" for w in why for m in
                                               ("/minite.v1.LearnerService/SubmitTrajectories", "/v1/control")]))
    assert not missing, missing
    metrics = {name: httpx.get(f"{secure[url]}/metrics", timeout=10, verify=ca).text for name, url in
               (("rollout", "rurl"), ("learner", "lurl"))}
    logs = {name: secure[name].text() for name in ("rollout", "learner")}
    assert all(" DEBUG " in t for t in logs.values())  # the logs are at debug level: the check means something
    leaks = [f"{what} {name}" for what, texts in (("log", logs), ("metrics", metrics)) for name, t in texts.items()
             if TOKEN in t or WRONG in t]
    report("auth", refused=";".join(f"{m}:{c}" for m, c in codes), logged_refusals=6 - len(missing),
           rollout_version_before=version_before, rollout_version_after=version_after,
           token_in_logs_or_metrics=",".join(leaks) or "none",
           log_bytes=",".join(f"{k}:{len(v)}" for k, v in logs.items()))
    assert not leaks, leaks


def test_learner_stops_on_sigterm_while_its_replica_hangs(secure):
    """SIGTERM to the learner while its rollout replica is frozen (SIGSTOP) mid-training: the learner must
    not wait out its 120 s call timeouts; it exits 0 within its drain bound. Then the rollout exits 0."""
    learner, rollout = secure["learner"], secure["rollout"]
    assert learner.p.poll() is None and rollout.p.poll() is None
    os.kill(rollout.pid, signal.SIGSTOP)
    try:
        time.sleep(1.0)  # the learner is now waiting on a call to the frozen replica
        rc, seconds = learner.terminate(timeout=40)
    finally:
        os.kill(rollout.pid, signal.SIGCONT)
    rrc, rseconds = rollout.terminate(timeout=30)
    logs = learner.text() + rollout.text()
    report("learner_shutdown", replica="frozen", learner_exit_code=rc, learner_exit_s=f"{seconds:.1f}",
           rollout_exit_code=rrc, rollout_exit_s=f"{rseconds:.1f}", token_in_final_logs=TOKEN in logs)
    assert rc == 0 and seconds < 20, (rc, seconds, learner.text()[-3000:])
    assert rrc == 0 and rseconds < 15, (rrc, rseconds, rollout.text()[-3000:])
    assert TOKEN not in logs


# -- faults in a weight push --------------------------------------------------------------------------------
_KILLED_PUSHER = """
import sys, time, grpc
from services.common.weights import encode_update, raw_update_call
from tests.service_helpers import new_weights
addr, model, version, token = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def slow():
    for i, m in enumerate(encode_update(new_weights(model, seed=9), version, chunk_bytes=4096, raw=True)):
        yield m
        if i == 5:
            print("HALF-WAY", flush=True)
            time.sleep(600)  # SIGKILLed here, mid-stream
raw_update_call(grpc.insecure_channel(addr))(slow(), metadata=(("authorization", "Bearer " + token),), timeout=600)
"""


def _push_faults(weights, version):
    """(name, messages, expected code, words) for each fault, built from one good push."""
    from minite.v1 import rollout_pb2 as wpb

    def msgs():
        return list(encode_update(weights, version, chunk_bytes=4096))

    def edit(fn):
        out = []
        for m in msgs():
            m = fn(m)
            if m is not None:
                out.append(m)
        return out

    chunks = [i for i, m in enumerate(msgs()) if m.WhichOneof("kind") == "chunk"]

    def corrupt(m):
        if m.WhichOneof("kind") == "chunk" and m.chunk.offset == 4096:
            m.chunk.payload = bytes([m.chunk.payload[0] ^ 0x55]) + m.chunk.payload[1:]
        return m

    def dtype(m):
        if m.WhichOneof("kind") == "chunk" and m.chunk.name.endswith("norm.weight"):
            m.chunk.format = "float32"
        return m

    def unknown(m):
        if m.WhichOneof("kind") == "chunk" and m.chunk.name.endswith("o_proj.weight"):
            m.chunk.name = m.chunk.name + ".extra"
        return m

    def shape(m):
        if m.WhichOneof("kind") == "chunk" and m.chunk.name.endswith("down_proj.weight"):
            m.chunk.shape[0] += 16
        return m
    INV, PRE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    cut_mid_tensor = msgs()[: chunks[len(chunks) // 2]] + [wpb.UpdateWeightsRequest(end=wpb.UpdateEnd())]
    return [
        ("truncated (no UpdateEnd)", msgs()[:-1], INV, "truncated"),
        ("cut mid-tensor", cut_mid_tensor, INV, "missing"),
        ("corrupted chunk", edit(corrupt), INV, "checksum"),
        ("wrong dtype", edit(dtype), INV, "format"),
        ("wrong shape", edit(shape), INV, "shape"),
        ("unknown tensor", edit(unknown), INV, "unknown tensor"),
        ("older version", list(encode_update(weights, version - 2, chunk_bytes=4096)), PRE, "stale"),
        ("same version", list(encode_update(weights, version - 1, chunk_bytes=4096)), PRE, "stale"),
    ]


def test_push_faults_keep_serving_and_the_next_push_lands(service_model, tmp_path):
    from services.common.weights import encode_update
    from tests.service_helpers import learner_on

    g, h = free_port(), free_port()
    proc = Proc(["rollout", "--model-dir", str(service_model), "--grpc-port", str(g), "--http-port", str(h)],
                tmp_path / "rollout.log", env={"MINITE_AUTH_TOKEN": TOKEN})
    killer = None
    try:
        proc.wait_http(f"http://127.0.0.1:{h}/health")
        channel = grpc.insecure_channel(f"127.0.0.1:{g}")
        stub = pb_grpc.RolloutServiceStub(channel)
        auth = (("authorization", f"Bearer {TOKEN}"),)
        first = new_weights(service_model, seed=1)
        stub.UpdateWeights(iter(encode_update(first, 1)), metadata=auth, timeout=60)
        refused = []
        for name, msgs, code, words in _push_faults(new_weights(service_model, seed=2), 2):
            with pytest.raises(grpc.RpcError) as e:
                stub.UpdateWeights(iter(msgs), metadata=auth, timeout=60)
            assert e.value.code() == code and words in e.value.details(), (name, e.value.code(), e.value.details())
            r = stub.Generate(_gen(3), timeout=60)  # still serving the previous version
            assert r.weight_version == 1 and len(r.choices[0].token_ids) == 3, name
            refused.append(name)

        # a pushing client SIGKILLed half-way through its stream
        killer = subprocess.Popen([sys.executable, "-c", _KILLED_PUSHER, f"127.0.0.1:{g}", str(service_model), "2", TOKEN],
                                  stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
        assert killer.stdout.readline().strip() == "HALF-WAY"
        killer.kill()
        killer.wait(10)
        time.sleep(0.5)
        assert stub.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=10).version == 1
        refused.append("client killed mid-stream")

        # the next good push lands, and the rollout's logprobs are the learner's at the new weights
        good = new_weights(service_model, seed=3)
        resp = stub.UpdateWeights(iter(encode_update(good, 2)), metadata=auth, timeout=60)
        assert resp.version == 2
        r = stub.Generate(_gen(4, n=2), timeout=60)
        ref = learner_on(service_model, good)
        for c in r.choices:
            assert c.weight_version == 2
            assert torch.equal(torch.tensor(list(c.logprobs)), ref.logprobs(PROMPT, list(c.token_ids)))
        rejected = _metric(f"http://127.0.0.1:{h}", "minite_weight_sync_rejected_total")
        channel.close()
    finally:
        if killer is not None and killer.poll() is None:
            killer.kill()
        proc.kill()
    assert rejected >= len(refused) - 1
    report("push_faults", faults=len(refused), kinds="|".join(x.replace(" ", "_") for x in refused),
           served_previous_version_after_each=True, next_good_push_version=2, rejected_metric=int(rejected))
