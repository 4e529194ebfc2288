"""/v1/chat/completions of a real rollout service (gRPC + uvicorn on loopback) on a random-weight Qwen3 whose
folder holds a transformers-saved BPE tokenizer with a Qwen3-style chat template and a generation_config.json
with two eos ids: the prompt ids equal transformers' `apply_chat_template`, `chat_template_kwargs` reach the
template, generation stops on the eos ids unless `ignore_eos`, and a template that fails is a 400."""
import shutil

import grpc
import httpx
import pytest

from minite.v1 import rollout_pb2 as pb
from minite.v1 import rollout_pb2_grpc as pb_grpc
from tests.helpers_hf import write_generation_config
from tests.service_helpers import rollout_service

transformers = pytest.importorskip("transformers")

MSGS = [{"role": "system", "content": "You add numbers. Réponds vite 🙂"},
        {"role": "user", "content": "What is 1+2?"}, {"role": "assistant", "content": "<think>\nsmall\n</think>\n\n3"},
        {"role": "user", "content": "And 12+34?"}]


@pytest.fixture(scope="module")
def model_dir(bpe_model_dir):
    return bpe_model_dir


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def svc(model_dir):
    with rollout_service(model_dir, precision="bf16", max_slots=8) as s:
        yield s


def chat(url, **body):
    body.setdefault("messages", MSGS)
    body.setdefault("max_tokens", 4)
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def hf_ids(hf, messages, **kw):
    out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_prompt_ids_equal_transformers(svc, hf):
    r = chat(svc[2], seed=1)
    assert r.status_code == 200, r.text
    ids = r.json()["prompt_token_ids"]
    assert ids == hf_ids(hf, MSGS) == svc[0].tokenizer.apply_chat_template(MSGS)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_chat_template_kwargs(svc, hf):
    on = chat(svc[2], seed=1).json()["prompt_token_ids"]
    off = chat(svc[2], seed=1, chat_template_kwargs={"enable_thinking": False}).json()["prompt_token_ids"]
    assert off == hf_ids(hf, MSGS, enable_thinking=False) != on
    assert hf.decode(off[len(on):]) == "<think>\n\n</think>\n\n"
    meta = chat(svc[2], chat_template_kwargs={"metadata": {"k": "é"}}).json()["prompt_token_ids"]
    assert meta == hf_ids(hf, MSGS, metadata={"k": "é"}) != on
    no_prompt = chat(svc[2], add_generation_prompt=False).json()["prompt_token_ids"]
    assert no_prompt == list(hf.apply_chat_template(MSGS, add_generation_prompt=False, tokenize=True)["input_ids"])


def test_stops_on_generation_config_eos_unless_ignore_eos(svc, model_dir):
    eos = set(write_generation_config(model_dir))  # (the same file the service read)
    assert set(svc[0].eos_token_ids) == eos
    req = {"seed": 11, "n": 16, "max_tokens": 100, "temperature": 1.0}
    free = chat(svc[2], ignore_eos=True, **req).json()["choices"]
    hits = [c for c in free if eos & set(c["token_ids"])]
    # the premise: a random model samples from ~600 tokens, so 1600 draws hit one of the two eos ids
    assert hits, "no eos sampled with this seed: pick another"
    assert all(len(c["token_ids"]) == 100 and c["finish_reason"] == "length" for c in free)
    stopped = {c["index"]: c for c in chat(svc[2], **req).json()["choices"]}
    for c in free:
        cut = next((k for k, t in enumerate(c["token_ids"]) if t in eos), None)
        got = stopped[c["index"]]
        if cut is None:
            assert got["token_ids"] == c["token_ids"] and got["finish_reason"] == "length"
        else:  # the same tokens up to the eos id, which ends the choice (and is not in its text)
            assert got["token_ids"] == c["token_ids"][: cut + 1] and got["finish_reason"] == "stop"
            assert "<|im_end|>" not in got["message"]["content"]
    # stop_token_ids still apply with ignore_eos
    first = free[0]["token_ids"][3]
    r = chat(svc[2], ignore_eos=True, stop_token_ids=[first], **dict(req, n=1)).json()["choices"][0]
    assert r["token_ids"][-1] == first and r["finish_reason"] == "stop"


def test_completions_stop_on_eos_too(svc):
    body = {"prompt": "What is 12+34?", "seed": 11, "n": 16, "max_tokens": 100}
    free = httpx.post(f"{svc[2]}/v1/completions", json=dict(body, ignore_eos=True), timeout=120).json()["choices"]
    stopped = httpx.post(f"{svc[2]}/v1/completions", json=body, timeout=120).json()["choices"]
    eos = set(svc[0].eos_token_ids)
    for a, b in zip(free, stopped):
        cut = next((k for k, t in enumerate(a["token_ids"]) if t in eos), None)
        assert b["token_ids"] == (a["token_ids"] if cut is None else a["token_ids"][: cut + 1])


def test_grpc_text_prompt_uses_the_tokenizer(svc, hf):
    text = "<|im_start|>user\nWhat is 12+34?<|im_end|>\n"
    with grpc.insecure_channel(svc[1]) as ch:
        r = pb_grpc.RolloutServiceStub(ch).Generate(pb.GenerateRequest(
            text=text, params=pb.SamplingParams(max_tokens=3, seed=1)), timeout=60)
    assert list(r.prompt_ids) == hf.encode(text)
    assert r.choices[0].text == svc[0].tokenizer.decode(r.choices[0].token_ids)


@pytest.mark.parametrize("body, words", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]},
     "the system message must come first"),  # the template's own raise_exception
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs cannot set 'messages'"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
])
def test_template_failure_is_400(svc, body, words):
    r = chat(svc[2], **body)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert words in msg
    if "system" in words:
        assert "chat_template.jinja" in msg


def test_broken_template_is_400_naming_the_file(model_dir, tmp_path):
    broken = shutil.copytree(model_dir, tmp_path / "broken")
    (broken / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with rollout_service(broken, precision="bf16", max_slots=2) as s:
        r = chat(s[2])
        assert r.status_code == 400, r.text
        assert "chat_template.jinja" in r.json()["error"]["message"] and "compile" in r.json()["error"]["message"]
        ok = httpx.post(f"{s[2]}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200, ok.text  # the rest of the service is fine
