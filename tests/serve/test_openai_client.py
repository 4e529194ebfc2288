"""The rollout service as an OpenAI/vLLM drop-in, driven by the real `openai` client over loopback (REST on
uvicorn, a random-weight Qwen3 whose folder holds a transformers-saved byte-level BPE tokenizer with a chat
template, so tokens can be pieces of a multi-byte character).

Checked against the learner's definition where there is one: every logprob a response reports (sampled,
top-N alternatives, echoed prompt tokens) is recomputed by the learner engine (`Learner.logprobs`) on the
same weights and must be equal bit for bit. Streaming must give the text of the same seeded request served
whole. Every parameter that is not served is a 400 naming it, through the client's own exception.
"""

import openai
import pytest
import torch

from minite_core.engine.learner import Learner
from minite_core.model import load_model
from tests.service_helpers import rollout_service

MODEL = "qwen3-bpe"


@pytest.fixture(scope="module")
def model_dir(bpe_model_dir):
    return bpe_model_dir


@pytest.fixture(scope="module")
def svc(model_dir):
    with rollout_service(model_dir, precision="bf16", max_slots=8, model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(svc):
    with openai.OpenAI(base_url=f"{svc[2]}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def learner(model_dir):
    return Learner(load_model(model_dir, precision="bf16"))


def ids_of(model_dir):
    from minite_core.tokenizer import Tokenizer
    return Tokenizer.from_dir(model_dir)


def test_completions_logprobs_top_n_and_offsets(client, learner, model_dir):
    tok = ids_of(model_dir)
    r = client.completions.create(model=MODEL, prompt="The cat sat", max_tokens=6, temperature=0.8, seed=3,
                                  logprobs=5, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    ids = r.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
    want = learner.logprobs(ids[0], ids[1], 0.8).tolist()
    assert lp.token_logprobs == want  # the learner's logprobs, bit for bit (fp32 -> JSON float is exact)
    for k, (top, sampled) in enumerate(zip(lp.top_logprobs, ids[1])):
        assert 5 <= len(top) <= 6  # the 5 most likely, and the sampled token (as vLLM) when it is not among them
        best = sorted(top.values(), reverse=True)[:5]
        assert best == sorted(best, reverse=True) and max(top.values()) >= lp.token_logprobs[k]
        assert f"token_id:{sampled}" in top and lp.tokens[k] == f"token_id:{sampled}"
        for piece, value in top.items():  # each alternative's logprob is the learner's for that token
            alt = int(piece.removeprefix("token_id:"))
            assert value == learner.logprobs(ids[0] + ids[1][:k], [alt], 0.8).item()
    named = client.completions.create(model=MODEL, prompt="The cat sat", max_tokens=6, temperature=0.8, seed=3,
                                      logprobs=5, extra_body={"ignore_eos": True}).choices[0].logprobs
    # by default a token is named by its text, as OpenAI and vLLM name it (not the BPE vocabulary entry "Ġcat")
    assert named.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids[1]]
    assert named.token_logprobs == lp.token_logprobs
    # text_offset: where each token's text starts in the returned text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # (a token that ends inside a character, shown as U+FFFD by decode, begins where the character does)
    assert lp.text_offset[-1] == len(tok.decode(ids[1][:-1]).rstrip("\ufffd"))
    assert all(o <= len(c.text) for o in lp.text_offset)


def test_completions_echo_with_prompt_logprobs(client, learner):
    r = client.completions.create(model=MODEL, prompt="One two three", max_tokens=3, temperature=0, echo=True,
                                  logprobs=0)
    c = r.choices[0]
    prompt, comp = r.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
    lp = c.logprobs
    assert c.text.startswith("One two three") and len(lp.tokens) == len(prompt) + len(comp)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(prompt)] == learner.logprobs(prompt[:1], prompt[1:], 1.0).tolist()
    assert lp.token_logprobs[len(prompt):] == learner.logprobs(prompt, comp, 1.0).tolist()


def test_completions_echo_with_top_alternatives_at_prompt_positions(client, learner):
    """echo + logprobs=N: each prompt position after the first lists the N most likely tokens too (and the prompt
    token, as vLLM), each with the learner's logprob for that token there; streamed as unary."""
    kw = dict(model=MODEL, prompt="One two three four", max_tokens=2, temperature=0.7, seed=2, echo=True, logprobs=3,
              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    r = client.completions.create(**kw)
    prompt, lp = r.model_extra["prompt_token_ids"], r.choices[0].logprobs
    assert len(prompt) >= 3 and lp.top_logprobs[0] is None
    logits = learner.model.logits(torch.tensor([prompt]))[0].float()
    for k in range(1, len(prompt)):
        top = lp.top_logprobs[k]
        assert 3 <= len(top) <= 4 and top[f"token_id:{prompt[k]}"] == lp.token_logprobs[k]
        best = set(torch.topk(logits[k - 1], 3).indices.tolist())  # the 3 largest logits (no ties in random weights)
        assert best <= {int(p.removeprefix("token_id:")) for p in top}, k
        for piece, value in top.items():
            alt = int(piece.removeprefix("token_id:"))
            assert value == learner.logprobs(prompt[:k], [alt], 0.7).item(), (k, alt)
    streamed = []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.top_logprobs
    assert streamed == lp.top_logprobs


def test_completions_echo_streamed_gives_the_unary_answer(client):
    kw = dict(model=MODEL, prompt="One two three", max_tokens=4, temperature=0.9, seed=5, echo=True, logprobs=2,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    text, tokens, lps, offsets = "", [], [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text and text.startswith("One two three")
    assert tokens == whole.logprobs.tokens and lps == whole.logprobs.token_logprobs and lps[0] is None
    assert offsets == sorted(offsets) and offsets[-1] < len(text)


def test_a_list_of_prompts_in_one_call(client):
    r = client.completions.create(model=MODEL, prompt=["alpha", "beta gamma"], max_tokens=2, n=2, temperature=0.7,
                                  seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = client.completions.create(model=MODEL, prompt="beta gamma", max_tokens=2, n=2, temperature=0.7, seed=1)
    assert [c.text for c in r.choices[2:]] == [c.text for c in alone.choices]  # seeded: the same as served alone
    assert r.usage.prompt_tokens == len(r.model_extra["prompt_token_ids"][0]) + len(r.model_extra["prompt_token_ids"][1])
    r = client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=1)
    assert len(r.choices) == 2


def test_a_list_of_prompts_streamed(client):
    kw = dict(model=MODEL, prompt=["alpha", "beta gamma", "delta"], max_tokens=5, n=2, temperature=0.9, seed=4,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    texts: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 3 * 2 * 5
    assert texts == {c.index: c.text for c in whole.choices} and sorted(texts) == list(range(6))


def test_chat_top_logprobs_bytes_and_text_parts(client, learner, model_dir):
    tok = ids_of(model_dir)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.9, seed=7,
                                       logprobs=True, top_logprobs=3)
    same = client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0.9, seed=7,
                                          messages=[{"role": "user", "content": "Hello\nthere"}])
    c = r.choices[0]
    assert r.model_extra["prompt_token_ids"] == same.model_extra["prompt_token_ids"]  # parts joined with "\n"
    assert c.message.content == same.choices[0].message.content
    ids = c.model_extra["token_ids"]
    want = learner.logprobs(r.model_extra["prompt_token_ids"], ids, 0.9).tolist()
    assert [e.logprob for e in c.logprobs.content] == want
    for e, t in zip(c.logprobs.content, ids):
        assert len(e.top_logprobs) == 3 and bytes(e.bytes) == tok.token_bytes(t)
        assert [a.logprob for a in e.top_logprobs] == sorted((a.logprob for a in e.top_logprobs), reverse=True)
    text = b"".join(bytes(e.bytes) for e in c.logprobs.content).decode("utf-8", errors="replace")
    assert text == tok.decode(ids)  # the bytes of the tokens are the text


def test_streaming_text_equals_whole_text_across_multibyte_characters(client, model_dir):
    """Byte-level tokens can be pieces of one UTF-8 character: streamed deltas hold such a piece back until
    the character is complete, so the concatenated stream is the non-streamed text."""
    tok = ids_of(model_dir)
    split_chars = 0
    for seed in range(12):
        kw = dict(model=MODEL, prompt="Réponds 🙂", max_tokens=24, temperature=1.5, seed=seed,
                  extra_body={"ignore_eos": True})
        whole = client.completions.create(**kw)
        streamed = "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **kw))
        assert streamed == whole.choices[0].text, seed
        ids = whole.choices[0].model_extra["token_ids"]
        split_chars += sum("\ufffd" in tok.decode([t]) for t in ids)  # a token that is part of a character
        chat = dict(model=MODEL, messages=[{"role": "user", "content": "🙂"}], max_tokens=16, temperature=1.5,
                    seed=seed, extra_body={"ignore_eos": True})
        whole = client.chat.completions.create(**chat)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **chat))
        assert streamed == whole.choices[0].message.content, seed
    assert split_chars >= 3  # the runs did sample pieces of multi-byte characters


def test_stream_include_usage(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 4
    assert all(ch.usage is None for ch in chunks[:-1])
    assert last.usage.total_tokens == last.usage.prompt_tokens + 4


@pytest.mark.parametrize("kind, param, value", [
    ("completions", "presence_penalty", 0.5), ("completions", "frequency_penalty", -1.0),
    ("completions", "logit_bias", {"5": 10}), ("completions", "best_of", 3), ("completions", "suffix", "end"),
    ("completions", "repetition_penalty", 1.2),
    ("chat", "presence_penalty", 1.0), ("chat", "response_format", {"type": "json_object"}),
    ("chat", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("chat", "tool_choice", "required"), ("chat", "logit_bias", {"7": -100}),
    ("completions", "min_p", 0.9), ("completions", "min_tokens", 3), ("chat", "use_beam_search", True),
    ("chat", "guided_json", {"type": "object"}), ("completions", "prompt_logprobs", 1),
    ("completions", "include_stop_str_in_output", True), ("chat", "allowed_token_ids", [1, 2]),
])
def test_unserved_parameters_are_refused_by_name(client, kind, param, value):
    base = (dict(prompt="x", max_tokens=1) if kind == "completions" else
            dict(messages=[{"role": "user", "content": "x"}], max_tokens=1))
    create = client.completions.create if kind == "completions" else client.chat.completions.create
    extra = {param: value} if param not in ("presence_penalty", "frequency_penalty", "logit_bias", "best_of",
                                           "suffix", "response_format", "tools", "tool_choice") else {}
    kw = {} if extra else {param: value}
    with pytest.raises(openai.BadRequestError) as e:
        create(model=MODEL, extra_body=extra or None, **base, **kw)
    assert param in str(e.value) and "not served" in str(e.value)


def test_neutral_values_of_unserved_parameters_are_served(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       presence_penalty=0, frequency_penalty=0.0, logit_bias={},
                                       response_format={"type": "text"}, tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=1, n=2, best_of=2)
    assert len(r.choices) == 2
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={
        "min_p": 0, "min_tokens": 0, "use_beam_search": False, "skip_special_tokens": True, "guided_json": None})
    assert len(r.choices) == 1


def test_null_is_the_default_and_top_k_minus_one_is_off(client, svc):
    """OpenAI's fields are nullable (clients send null for "not given"); vLLM's top_k -1 means no top-k."""
    import httpx

    base = {"model": MODEL, "prompt": "The cat", "max_tokens": 5, "seed": 2, "temperature": 0.8, "ignore_eos": True}
    want = httpx.post(f"{svc[2]}/v1/completions", json=base, timeout=60).json()["choices"][0]["token_ids"]
    for extra in ({"top_p": None, "n": None, "logprobs": None, "stream": None, "echo": None, "top_k": None},
                  {"top_k": -1}, {"top_k": 0}):
        r = httpx.post(f"{svc[2]}/v1/completions", json={**base, **extra}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, (extra, r.text)
    r = httpx.post(f"{svc[2]}/v1/completions", json={**base, "max_tokens": None}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 16  # the completions default
    r = httpx.post(f"{svc[2]}/v1/completions", json={**base, "prompt": None}, timeout=60)
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]  # a required field stays required
    r = httpx.post(f"{svc[2]}/v1/completions", json={**base, "top_k": -2}, timeout=60)
    assert r.status_code == 400 and "top_k" in r.json()["error"]["message"]


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(client, svc):
    """OpenAI's chat max_tokens defaults to what fits: a prompt longer than context - 16 is served."""
    import httpx

    context = client.models.list().data[0].model_extra["max_model_len"]
    words = " ".join(["hello"] * (context - 24))  # (+ the template's ~16 tokens)
    body = {"model": MODEL, "messages": [{"role": "user", "content": words}], "ignore_eos": True}
    r = httpx.post(f"{svc[2]}/v1/chat/completions", json=body, timeout=120)
    prompt = r.json().get("prompt_token_ids", [])
    assert r.status_code == 200 and context - 16 < len(prompt) < context, r.text[:500]
    assert len(r.json()["choices"][0]["token_ids"]) == context - len(prompt)  # (ignore_eos: to the context's end)
    r = httpx.post(f"{svc[2]}/v1/chat/completions", json={**body, "messages": [
        {"role": "user", "content": words + " hello" * 20}]}, timeout=120)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text[:500]


def test_chat_template_kwargs_count_toward_the_text_bound(svc):
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template_kwargs": {"metadata": "ab c" * 500_000}}
    r = httpx.post(f"{svc[2]}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "chat_template_kwargs" in r.json()["error"]["message"], r.text[:500]
    assert r.elapsed.total_seconds() < 1.0  # refused before the template renders 2 MB into a million tokens


@pytest.mark.parametrize("kw, words", [
    (dict(logprobs=21), "logprobs"),
    (dict(prompt=["a", ""]), "prompt is empty"),
    (dict(prompt=[]), "prompt"),
])
def test_completions_refusals(client, kw, words):
    kw = dict(dict(model=MODEL, prompt="x", max_tokens=1), **kw)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw)
    assert words in str(e.value)


@pytest.mark.parametrize("kw, words", [
    (dict(top_logprobs=2), "top_logprobs needs logprobs"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "image_url"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
])
def test_chat_refusals(client, kw, words):
    kw = dict(dict(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1), **kw)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    assert words in str(e.value)


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_logprobs_are_fp32_values(client, learner):
    """The JSON floats are the fp32 logprobs exactly (fp32 -> fp64 -> shortest repr round-trips)."""
    r = client.completions.create(model=MODEL, prompt="ab", max_tokens=3, temperature=0, logprobs=0)
    vals = r.choices[0].logprobs.token_logprobs
    assert torch.tensor(vals, dtype=torch.float32).double().tolist() == vals
