"""The learner service over real gRPC and HTTP, against a real rollout service: it pushes its weights to
the rollout at start, scores with the learner engine (equal to the rollout's logprobs bit for bit),
records drift for submitted trajectories, refuses stale versions, bad input and missing tokens, and its
/health reports a training loop that died."""
import time

import grpc
import httpx
import pytest
import torch

from minite.v1 import learner_pb2 as lpb
from minite.v1 import learner_pb2_grpc as lpb_grpc
from minite.v1 import rollout_pb2 as rpb
from minite.v1 import rollout_pb2_grpc as rpb_grpc
from tests.service_helpers import learner_service, rollout_service

TOKEN = "learner-test-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
HEADERS = {"authorization": f"Bearer {TOKEN}"}
PROMPT = [1, 4, 5, 13, 6, 7, 14]


@pytest.fixture(scope="module")
def pair(service_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("learner-run")
    with rollout_service(service_model, auth_token=TOKEN) as ro:
        with learner_service(service_model, ro[1], auth_token=TOKEN, steps=0, run_dir=run_dir) as le:
            ch_r, ch_l = grpc.insecure_channel(ro[1]), grpc.insecure_channel(le[1])
            yield ro, le, rpb_grpc.RolloutServiceStub(ch_r), lpb_grpc.LearnerServiceStub(ch_l)
            ch_r.close()
            ch_l.close()


def _trajectories(rstub, version=None, **params):
    resp = rstub.Generate(rpb.GenerateRequest(prompt_ids=rpb.TokenIds(ids=PROMPT), params=rpb.SamplingParams(
        max_tokens=5, n=4, seed=2, **params)), timeout=60)
    return [lpb.Trajectory(prompt_ids=PROMPT, completion_ids=c.token_ids, rollout_logprobs=c.logprobs, reward=0.5,
                           temperature=params.get("temperature", 1.0),
                           weight_version=c.weight_version if version is None else version) for c in resp.choices]


def test_learner_pushed_its_weights_packed(pair):
    ro, le, rstub, _ = pair
    # the Trainer's first re-quantize is version 1, pushed to the rollout as packed NVFP4
    assert le[0].version == 1 == rstub.GetWeightVersion(rpb.GetWeightVersionRequest()).version
    assert ro[0].metrics.sync_bytes._value.get() > 0


def test_score_equals_rollout_logprobs(pair):
    ro, le, rstub, lstub = pair
    for t in _trajectories(rstub):
        s = lstub.Score(lpb.ScoreRequest(prompt_ids=PROMPT, completion_ids=t.completion_ids), timeout=60, metadata=AUTH)
        assert list(s.logprobs) == list(t.rollout_logprobs) and s.weight_version == 1
        r = httpx.post(f"{le[2]}/v1/score", headers=HEADERS, json={"prompt_ids": PROMPT, "completion_ids": list(t.completion_ids)}).json()
        assert [float(torch.tensor(x, dtype=torch.float32)) for x in r["logprobs"]] == list(t.rollout_logprobs)


def test_submit_records_zero_drift(pair):
    ro, le, rstub, lstub = pair
    before = le[0].metrics.abs_diff._sum.get()
    summary = lstub.SubmitTrajectories(iter(_trajectories(rstub, temperature=0.7)), metadata=AUTH, timeout=60)
    assert summary.accepted == 4 and summary.tokens > 0
    assert summary.logprob_abs_diff_max == 0.0 and summary.bitwise_equal_ratio == 1.0 and summary.kl_k3 == 0.0
    assert le[0].metrics.bitwise._value.get() == 1.0 and le[0].metrics.abs_diff._sum.get() == before


@pytest.mark.parametrize("make, code, words", [
    (lambda ts: [lpb.Trajectory(prompt_ids=PROMPT, completion_ids=[3, 4], rollout_logprobs=[-1.0], weight_version=1)],
     grpc.StatusCode.INVALID_ARGUMENT, "logprobs for"),
    (lambda ts: [lpb.Trajectory(prompt_ids=PROMPT, completion_ids=[99], rollout_logprobs=[-1.0], weight_version=1)],
     grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    (lambda ts: [lpb.Trajectory(prompt_ids=[], completion_ids=[3], rollout_logprobs=[-1.0], weight_version=1)],
     grpc.StatusCode.INVALID_ARGUMENT, "non-empty"),
    (lambda ts: [], grpc.StatusCode.INVALID_ARGUMENT, "no trajectories"),
    (lambda ts: [lpb.Trajectory(prompt_ids=t.prompt_ids, completion_ids=t.completion_ids,
                                rollout_logprobs=t.rollout_logprobs, weight_version=0) for t in ts],
     grpc.StatusCode.FAILED_PRECONDITION, "weight version 0"),
])
def test_submit_refuses_bad_trajectories(pair, make, code, words):
    _, _, rstub, lstub = pair
    with pytest.raises(grpc.RpcError) as e:
        lstub.SubmitTrajectories(iter(make(_trajectories(rstub))), metadata=AUTH, timeout=60)
    assert e.value.code() == code and words in e.value.details(), e.value.details()


def test_submit_at_another_temperature_shows_drift(pair):
    """The drift metrics can fail: the same tokens scored at the wrong temperature are not equal."""
    _, le, rstub, lstub = pair
    ts = _trajectories(rstub, temperature=0.7)
    for t in ts:
        t.temperature = 1.0
    summary = lstub.SubmitTrajectories(iter(ts), metadata=AUTH, timeout=60)
    assert summary.logprob_abs_diff_max > 0 and summary.bitwise_equal_ratio < 1.0
    assert le[0].metrics.abs_diff_max._value.get() == pytest.approx(summary.logprob_abs_diff_max)


def test_token_required(pair):
    _, le, rstub, lstub = pair
    for md in ((), (("authorization", "Bearer nope"),)):
        with pytest.raises(grpc.RpcError) as e:
            lstub.SubmitTrajectories(iter(_trajectories(rstub)), metadata=md, timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert httpx.post(f"{le[2]}/v1/control", json={"action": "pause"}).status_code == 401
    bad = httpx.post(f"{le[2]}/v1/control", json={"action": "pause"}, headers={"authorization": "Bearer nope"})
    assert bad.status_code == 401 and TOKEN not in bad.text
    ok = httpx.post(f"{le[2]}/v1/control", json={"action": "pause"}, headers={"authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and ok.json()["paused"] is True
    httpx.post(f"{le[2]}/v1/control", json={"action": "resume"}, headers={"authorization": f"Bearer {TOKEN}"})


def test_score_bad_input_and_status(pair):
    _, le, _, lstub = pair
    with pytest.raises(grpc.RpcError) as e:
        lstub.Score(lpb.ScoreRequest(prompt_ids=PROMPT, completion_ids=[3] * 40), timeout=30, metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in e.value.details()
    r = httpx.post(f"{le[2]}/v1/score", headers=HEADERS, json={"prompt_ids": PROMPT, "completion_ids": []})
    assert r.status_code == 400 and "completion_ids" in r.json()["error"]["message"]
    st = lstub.Status(lpb.StatusRequest(), timeout=30)
    assert st.weight_version == 1 and st.step == 0 and len(st.rollout_replicas) == 1
    assert httpx.get(f"{le[2]}/v1/status").json()["weight_version"] == 1
    assert "/v1/score" in httpx.get(f"{le[2]}/openapi.json").json()["paths"]


@pytest.mark.parametrize("traj, words", [
    (dict(completion_ids=[3], rollout_logprobs=[float("nan")]), "finite"),
    (dict(completion_ids=[3], rollout_logprobs=[0.5]), "finite and <= 0"),
    (dict(completion_ids=[3], rollout_logprobs=[-1.0], temperature=1e308), "temperature"),
    (dict(completion_ids=[3], rollout_logprobs=[-1.0], temperature=-1.0), "temperature"),
])
def test_submit_refuses_poison(pair, traj, words):
    _, _, _, lstub = pair
    t = lpb.Trajectory(prompt_ids=PROMPT, weight_version=1, **traj)
    with pytest.raises(grpc.RpcError) as e:
        lstub.SubmitTrajectories(iter([t]), metadata=AUTH, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details(), e.value.details()


def test_score_temperature_bounds(pair):
    _, le, _, lstub = pair
    for t in (1e308, 1e-300):
        with pytest.raises(grpc.RpcError) as e:
            lstub.Score(lpb.ScoreRequest(prompt_ids=PROMPT, completion_ids=[3], temperature=t), timeout=30, metadata=AUTH)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        r = httpx.post(f"{le[2]}/v1/score", headers=HEADERS, json={"prompt_ids": PROMPT, "completion_ids": [3], "temperature": t})
        assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]


def test_restarted_learner_resyncs_above_the_replicas(service_model, tmp_path):
    """A learner that starts while its replica already serves version 7 (e.g. it restarted) pushes 8, not a
    stale 1; and a step whose sequences exceed the replica's queue bound waits instead of failing."""
    from services.common.weights import encode_update
    from tests.service_helpers import new_weights

    with rollout_service(service_model, auth_token=TOKEN, max_waiting=16, max_slots=4) as ro:
        stub = rpb_grpc.RolloutServiceStub(grpc.insecure_channel(ro[1]))
        stub.UpdateWeights(encode_update(new_weights(service_model, seed=1), 7), metadata=AUTH, timeout=60)
        with learner_service(service_model, ro[1], auth_token=TOKEN, steps=0, run_dir=tmp_path,
                             prompts_per_step=8, num_generations=8) as le:
            assert le[0].version == 8 == stub.GetWeightVersion(rpb.GetWeightVersionRequest()).version
            m = le[0].trainer.step()  # 64 sequences through a queue of 16
            assert m["weight_version"] == 9 and m["sampling/sampling_logp_difference/max"] == 0.0
            assert stub.GetWeightVersion(rpb.GetWeightVersionRequest()).version == 9


def test_score_at_kept_versions_and_in_batches(pair):
    """(Last in this module: it moves the learner to new versions.) A completion sampled before a push is
    scored at its own version, bit for bit, also in one ScoreBatch mixing versions; a version the learner
    no longer keeps is NOT_FOUND / 404."""
    ro, le, rstub, lstub = pair
    rt = le[0]
    old = _trajectories(rstub)
    v_old = old[0].weight_version
    g = torch.Generator().manual_seed(5)
    with rt.lock, torch.no_grad():  # a different weight set, pushed as the next version
        for m in rt.trainer.masters.values():
            m.add_(0.05 * torch.randn(m.shape, generator=g))
        rt.trainer.sync_weights()
    new = _trajectories(rstub)
    assert new[0].weight_version == rt.version > v_old
    items = [lpb.ScoreRequest(prompt_ids=PROMPT, completion_ids=t.completion_ids, weight_version=t.weight_version)
             for t in old + new]
    resp = lstub.ScoreBatch(lpb.ScoreBatchRequest(items=items), timeout=60, metadata=AUTH)
    assert [list(r.logprobs) for r in resp.results] == [list(t.rollout_logprobs) for t in old + new]
    assert [r.weight_version for r in resp.results] == [t.weight_version for t in old + new]
    now = lstub.Score(lpb.ScoreRequest(prompt_ids=PROMPT, completion_ids=old[0].completion_ids), timeout=60, metadata=AUTH)
    assert now.weight_version == rt.version and list(now.logprobs) != list(old[0].rollout_logprobs)
    r = httpx.post(f"{le[2]}/v1/score", headers=HEADERS, json={"prompt_ids": PROMPT, "completion_ids": list(old[0].completion_ids),
                                              "weight_version": v_old}).json()
    assert [float(torch.tensor(x, dtype=torch.float32)) for x in r["logprobs"]] == list(old[0].rollout_logprobs)

    for call in (lambda: lstub.Score(lpb.ScoreRequest(prompt_ids=PROMPT, completion_ids=[3], weight_version=999), timeout=30, metadata=AUTH),
                 lambda: lstub.ScoreBatch(lpb.ScoreBatchRequest(items=[items[0], lpb.ScoreRequest(
                     prompt_ids=PROMPT, completion_ids=[3], weight_version=999)]), timeout=30, metadata=AUTH)):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "999 is not kept" in e.value.details()
    r = httpx.post(f"{le[2]}/v1/score", headers=HEADERS, json={"prompt_ids": PROMPT, "completion_ids": [3], "weight_version": 999})
    assert r.status_code == 404 and "not kept" in r.json()["error"]["message"]
    for req, words in [(lpb.ScoreBatchRequest(), "no items"),
                       (lpb.ScoreBatchRequest(items=[items[0], lpb.ScoreRequest(prompt_ids=PROMPT)]), "item 1"),
                       (lpb.ScoreBatchRequest(items=[items[0]] * 4097), "at most 256")]:
        with pytest.raises(grpc.RpcError) as e:
            lstub.ScoreBatch(req, timeout=30, metadata=AUTH)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details(), e.value.details()


def test_learner_health_reports_a_dead_training_loop(service_model, pair, tmp_path):
    rollout, learner = pair[:2]
    assert httpx.get(f"{learner[2]}/health", timeout=30).status_code == 200  # a learner whose loop is fine
    run_dir = tmp_path / "run"
    (run_dir / "metrics.jsonl").mkdir(parents=True)  # the loop cannot write its metrics: it stops on the error
    with learner_service(service_model, rollout[1], auth_token=TOKEN, steps=1, run_dir=run_dir) as (rt, _, url):
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # not started yet
        rt.start()
        deadline = time.monotonic() + 60
        while rt.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not rt.thread.is_alive() and rt.last_error and not rt.done
        r = httpx.get(f"{url}/health", timeout=30)
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["status"] == "failed" and "training loop" in body["error"]["message"]
        assert "metrics.jsonl" in body["error"]["message"]  # the cause, as the loop reported it
        assert httpx.get(f"{url}/v1/status", timeout=30).json()["last_error"]  # Status still answers
