"""Reliability of the RL pair on real processes (`minite rollout` and `minite learner` on loopback):

* the learner SIGKILLed in the middle of a step and restarted: it resumes from its checkpoint, replays
  the batches its trajectory log holds (each used exactly once), pushes only increasing weight versions,
  and ends with the same bits as an uninterrupted run of the same job;
* a rollout replica SIGKILLed and restarted: the learner notices, waits and reports (it does not crash),
  re-pushes its current weights to the replica that came back, and the run goes on.

Each scenario prints one line "RELIABILITY: <scenario> key=value ..." (`pytest -s` shows them)."""
from __future__ import annotations

import json
import re
import time

import grpc
import httpx
import torch
from safetensors.torch import load_file

from minite.v1 import learner_pb2 as lpb
from minite.v1 import learner_pb2_grpc as lpb_grpc
from minite_core.rl.config import RunConfig
from minite_core.rl.loop import run
from tests.service_helpers import Proc, free_port, report, wait_for

TOKEN = "learner-rel-token-8d2e"
STEPS, PROMPTS, GENS, EVERY = 8, 4, 4, 3


def _rollout(model, tmp, g, h, name="rollout"):
    p = Proc(["rollout", "--model-dir", str(model), "--grpc-port", str(g), "--http-port", str(h)], tmp / f"{name}.log",
             env={"MINITE_AUTH_TOKEN": TOKEN})
    p.wait_http(f"http://127.0.0.1:{h}/health")
    return p


def _learner(model, tmp, rollout_port, run_dir, name="learner", steps=STEPS):
    g, h = free_port(), free_port()
    p = Proc(["learner", "--model-dir", str(model), "--rollout", f"127.0.0.1:{rollout_port}", "--grpc-port", str(g),
              "--http-port", str(h), "--steps", str(steps), "--prompts-per-step", str(PROMPTS),
              "--num-generations", str(GENS), "--checkpoint-every", str(EVERY), "--run-dir", str(run_dir),
              "--exit-when-done"], tmp / f"{name}.log", env={"MINITE_AUTH_TOKEN": TOKEN})
    return p, g, h


def _wal(run_dir) -> dict[int, dict]:
    path = run_dir / "trajectories.wal"
    out = {}
    if path.exists():
        for line in path.read_bytes().split(b"\n"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[rec["step"]] = rec
    return out


def _rows(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _served_versions(rollout_log: str) -> list[int]:
    return [int(v) for v in re.findall(r"serving weight version (\d+)", rollout_log)]


def _digest(rec: dict) -> str:
    from minite_core.rl.report import batch_digest
    from minite_core.rl.wal import TrajectoryLog

    return batch_digest(TrajectoryLog.completions(rec))


def test_learner_sigkill_mid_step_resumes_exactly_once(service_model, tmp_path):
    run_dir = tmp_path / "learner"
    g, h = free_port(), free_port()
    rollout = _rollout(service_model, tmp_path, g, h)
    learner = restarted = None
    try:
        learner, *_ = _learner(service_model, tmp_path, g, run_dir)
        kill_at = EVERY + 2  # after the checkpoint of step EVERY: steps EVERY+1.. live only in the trajectory log
        wait_for(lambda: kill_at in _wal(run_dir), 240, f"step {kill_at}'s batch in the trajectory log", [learner])
        learner.p.kill()  # SIGKILL: no handler runs
        learner.p.wait(10)
        learner.kill()
        logged = _wal(run_dir)
        done_before = [r["step"] for r in _rows(run_dir)]
        ckpt = json.loads((run_dir / "checkpoint" / "trainer.json").read_text())["step"]
        assert ckpt == EVERY and set(range(EVERY + 1, kill_at + 1)) <= set(logged)
        versions_before = _served_versions(rollout.text())

        restarted, *_ = _learner(service_model, tmp_path, g, run_dir, name="learner-restarted")
        rc = restarted.p.wait(300)
        assert rc == 0, restarted.text()[-3000:]
    finally:
        for p in (learner, restarted, rollout):
            if p is not None:
                p.kill()

    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once, none twice
    for r in rows:
        if EVERY < r["step"] <= kill_at:  # sampled before the kill: replayed from the log, the same batch
            assert r["replayed"] and r["batch_sha256"] == _digest(logged[r["step"]]), r["step"]
            # the restored weights reproduce the rollout's logprobs of that batch bit for bit
            assert r["drift/bitwise_equal_ratio"] == 1.0
        elif r["step"] > kill_at:
            assert not r["replayed"]
    served = _served_versions(rollout.text())
    assert served == sorted(set(served)), served  # strictly increasing across the restart

    # the same job uninterrupted, in one process: the resumed run ends with the same bits
    ref_dir = tmp_path / "reference"
    run(RunConfig(model_dir=service_model, run_dir=ref_dir, steps=STEPS, prompts_per_step=PROMPTS,
                  num_generations=GENS, checkpoint_every=EVERY), progress=False)
    ours, ref = load_file(str(run_dir / "checkpoint" / "trainer.safetensors")), load_file(str(ref_dir / "checkpoint" / "trainer.safetensors"))
    assert ours.keys() == ref.keys()
    unequal = [k for k in ref if not torch.equal(ours[k], ref[k])]
    assert not unequal, f"{len(unequal)} tensors differ from the uninterrupted run, e.g. {unequal[:3]}"
    assert [r["reward"] for r in rows] == [r["reward"] for r in _rows(ref_dir)]
    report("learner_sigkill", steps=STEPS, checkpoint_every=EVERY, killed_in_step=kill_at,
           steps_done_at_kill=len(done_before), logged_batches_at_kill=len(logged),
           replayed=sum(r["replayed"] for r in rows), trajectories=STEPS * PROMPTS * GENS,
           used_twice=0, versions_before=versions_before[-1], versions_after=served[-1],
           final_bits_equal_uninterrupted=not unequal)


def test_rollout_replica_killed_and_restarted(service_model, tmp_path):
    run_dir = tmp_path / "learner"
    g, h = free_port(), free_port()
    rollout = _rollout(service_model, tmp_path, g, h)
    learner = back = None
    channel = None
    try:
        learner, lg, lh = _learner(service_model, tmp_path, g, run_dir, steps=6)
        wait_for(lambda: len(_rows(run_dir)) >= 2, 240, "two learner steps", [learner])
        rollout.p.kill()
        rollout.p.wait(10)
        rollout.kill()
        t_down = time.monotonic()
        channel = grpc.insecure_channel(f"127.0.0.1:{lg}")
        stub = lpb_grpc.LearnerServiceStub(channel)

        def waiting():
            s = stub.Status(lpb.StatusRequest(), timeout=5)
            return s if "not answering" in learner.text() or s.last_error else None
        status = wait_for(waiting, 60, "the learner to report the replica down", [learner])
        step_down = status.step
        time.sleep(2.0)  # with no replica the learner waits: alive, healthy, not advancing
        assert learner.p.poll() is None
        status = stub.Status(lpb.StatusRequest(), timeout=5)
        assert status.step <= step_down + 1 and status.last_error, status
        assert httpx.get(f"http://127.0.0.1:{lh}/health", timeout=5).status_code == 200
        down_s = time.monotonic() - t_down

        back = _rollout(service_model, tmp_path, g, h, name="rollout-restarted")
        rc = learner.p.wait(300)
        assert rc == 0, learner.text()[-3000:]
        log = learner.text()
    finally:
        if channel is not None:
            channel.close()
        for p in (learner, back, rollout):
            if p is not None:
                p.kill()
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7))
    versions = [r["weight_version"] for r in rows]
    assert versions == sorted(set(versions))
    repushed = _served_versions(back.text())
    # the replica came back with the checkpoint's weights (version 0): the learner pushed its current
    # version before sampling there again, then every later step's version
    assert repushed and repushed[0] >= versions[step_down - 1] and repushed[-1] == versions[-1], (repushed, versions)
    assert "is back" in log or "re-pushing" in log
    report("rollout_replica_restart", steps=len(rows), killed_after_step=step_down, down_s=f"{down_s:.1f}",
           learner_alive_while_down=True, repushed_version=repushed[0], final_version=versions[-1], learner_exit=rc)


# -- weight pushes under load -------------------------------------------------------------------------------
CLIENTS = 64  # concurrent generation streams: 16 each of gRPC Generate, gRPC GenerateStream, REST, REST stream
PUSHES = 20


def _client(kind: str, i: int, grpc_addr: str, url: str, stop, out: list, errors: list) -> None:
    """Generate until `stop`; append (prompt, tokens, logprobs, versions seen) per sequence to `out`."""
    import random

    from minite.v1 import rollout_pb2 as pb
    from minite.v1 import rollout_pb2_grpc as pb_grpc
    from minite_core.rl.addition import AdditionRows, build_tokenizer

    rng, rows, tok = random.Random(i), AdditionRows(2), build_tokenizer()
    channel = grpc.insecure_channel(grpc_addr) if kind.startswith("grpc") else None
    http = httpx.Client(timeout=120) if kind.startswith("rest") else None
    try:
        while not stop.is_set():
            prompt, n, max_tokens, seed = tok.encode(rows[rng.randrange(len(rows))]["prompt"]).ids, rng.choice([1, 2]), rng.randint(2, 8), rng.randrange(2**31)
            try:
                if kind == "grpc":
                    r = pb_grpc.RolloutServiceStub(channel).Generate(pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=prompt),
                        params=pb.SamplingParams(max_tokens=max_tokens, n=n, seed=seed)), timeout=120)
                    out += [(prompt, list(c.token_ids), list(c.logprobs), {c.weight_version, r.weight_version}) for c in r.choices]
                elif kind == "grpc-stream":
                    seqs: dict = {}
                    for m in pb_grpc.RolloutServiceStub(channel).GenerateStream(pb.GenerateRequest(
                            prompt_ids=pb.TokenIds(ids=prompt), params=pb.SamplingParams(max_tokens=max_tokens, n=n, seed=seed)),
                            timeout=120):
                        s = seqs.setdefault(m.index, ([], [], set()))
                        if m.HasField("token_id"):
                            s[0].append(m.token_id)
                            s[1].append(m.logprob)
                        s[2].add(m.weight_version)
                    out += [(prompt, t, lp, v) for t, lp, v in seqs.values()]
                else:
                    body = {"prompt": prompt, "max_tokens": max_tokens, "n": n, "seed": seed, "logprobs": 0,
                            "stream": kind == "rest-stream"}
                    if kind == "rest":
                        r = http.post(f"{url}/v1/completions", json=body)
                        if r.status_code != 200:
                            raise AssertionError(f"HTTP {r.status_code}: {r.text}")
                        j = r.json()
                        out += [(prompt, c["token_ids"], c["logprobs"]["token_logprobs"], {c["weight_version"], j["weight_version"]})
                                for c in j["choices"]]
                    else:
                        seqs = {}
                        with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                            if r.status_code != 200:
                                raise AssertionError(f"HTTP {r.status_code}: {r.read()}")
                            for line in r.iter_lines():
                                if not line.startswith("data: ") or line == "data: [DONE]":
                                    continue
                                c = json.loads(line[6:])["choices"][0]
                                s = seqs.setdefault(c["index"], ([], [], set()))
                                if c["token_ids"]:
                                    s[0].extend(c["token_ids"])
                                    s[1].extend(c["logprobs"]["token_logprobs"])
                                s[2].add(c["weight_version"])
                        out += [(prompt, t, lp, v) for t, lp, v in seqs.values()]
            except Exception as e:  # any failure is a failed request: counted, reported
                errors.append(f"{kind}: {type(e).__name__}: {getattr(e, 'details', lambda: '')() or e}")
    finally:
        if channel is not None:
            channel.close()
        if http is not None:
            http.close()


def test_weight_pushes_under_load(service_model, tmp_path):
    import threading

    g, h = free_port(), free_port()
    rollout = Proc(["rollout", "--model-dir", str(service_model), "--grpc-port", str(g), "--http-port", str(h),
                    "--max-slots", "32", "--max-waiting", "512"], tmp_path / "rollout.log", env={"MINITE_AUTH_TOKEN": TOKEN})
    learner = None
    stop, threads, out, errors = threading.Event(), [], [], []
    try:
        rollout.wait_http(f"http://127.0.0.1:{h}/health")
        learner_g, learner_h = free_port(), free_port()
        learner = Proc(["learner", "--model-dir", str(service_model), "--rollout", f"127.0.0.1:{g}", "--grpc-port",
                        str(learner_g), "--http-port", str(learner_h), "--steps", str(PUSHES), "--prompts-per-step", "2",
                        "--num-generations", "2", "--checkpoint-every", "100", "--keep-versions", str(PUSHES + 8),
                        "--run-dir", str(tmp_path / "learner")], tmp_path / "learner.log", env={"MINITE_AUTH_TOKEN": TOKEN})
        learner.wait_http(f"http://127.0.0.1:{learner_h}/health")
        kinds = ["grpc", "grpc-stream", "rest", "rest-stream"]
        for i in range(CLIENTS):
            t = threading.Thread(target=_client, args=(kinds[i % 4], i, f"127.0.0.1:{g}", f"http://127.0.0.1:{h}", stop,
                                                       out, errors), daemon=True)
            t.start()
            threads.append(t)
        channel = grpc.insecure_channel(f"127.0.0.1:{learner_g}")
        stub = lpb_grpc.LearnerServiceStub(channel)
        t0 = time.monotonic()
        wait_for(lambda: stub.Status(lpb.StatusRequest(), timeout=10).done, 420, f"{PUSHES} learner steps under load",
              [learner, rollout])
        load_s = time.monotonic() - t0
        stop.set()
        for t in threads:
            t.join(150)
        assert not any(t.is_alive() for t in threads), "a client hung"
        final = stub.Status(lpb.StatusRequest(), timeout=10).weight_version

        # every sequence: exactly one version, and its logprobs are the learner's at that version, bit for bit
        mismatched, versions, seqs = [], set(), []
        for prompt, toks, lps, vs in out:
            assert len(vs) == 1, f"a sequence tagged with versions {vs}"
            versions |= vs
            if toks:
                seqs.append((prompt, toks, lps, next(iter(vs))))
        for k in range(0, len(seqs), 256):  # (ScoreBatch takes at most 256 sequences a call)
            part = seqs[k:k + 256]
            resp = stub.ScoreBatch(lpb.ScoreBatchRequest(items=[lpb.ScoreRequest(prompt_ids=p, completion_ids=t, weight_version=v)
                                                                for p, t, _, v in part]), timeout=300,
                                   metadata=(("authorization", f"Bearer {TOKEN}"),))
            for (p, t, lps, v), s in zip(part, resp.results, strict=True):
                assert s.weight_version == v
                if not torch.equal(torch.tensor(list(s.logprobs)), torch.tensor(lps, dtype=torch.float32)):
                    mismatched.append((v, p, t))
        channel.close()
    finally:
        stop.set()
        for p in (learner, rollout):
            if p is not None:
                p.kill()
    served = _served_versions(rollout.text())
    assert not errors, f"{len(errors)} failed requests, e.g. {errors[:3]}"
    assert len(served) >= PUSHES and served == sorted(set(served))
    assert not mismatched, f"{len(mismatched)} of {len(out)} sequences differ from the learner at their version"
    assert len(versions) >= PUSHES // 2, f"the load spanned only versions {sorted(versions)}"
    report("weight_push_under_load", clients=CLIENTS, sequences=len(out), tokens=sum(len(x[1]) for x in out),
           pushes=len(served), final_version=final, versions_sampled=len(versions), failed_requests=len(errors),
           logprobs_equal_learner_at_version=f"{len(out) - len(mismatched)}/{len(out)}", seconds=f"{load_s:.0f}")
