"""minite_core.tokenizer against transformers itself: a BPE tokenizer trained here with a Qwen3-style chat
template, saved by transformers (template in chat_template.jinja and in tokenizer_config.json); the ids of
`Tokenizer.apply_chat_template` must equal `AutoTokenizer.apply_chat_template`'s for many conversations and
template arguments. Also the eos ids' sources, errors naming the file, and encode/decode."""
import json
import shutil

import pytest

from minite_core.tokenizer import ChatTemplateError, Tokenizer
from tests.helpers_hf import make_bpe_tokenizer_dir, write_generation_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["chat_template.jinja", "tokenizer_config.json"])
def folder(request, tmp_path_factory):
    path = make_bpe_tokenizer_dir(tmp_path_factory.mktemp("tok"), jinja_file=request.param == "chat_template.jinja")
    assert (path / "chat_template.jinja").is_file() == (request.param == "chat_template.jinja")
    assert ("chat_template" in json.loads((path / "tokenizer_config.json").read_text())) == \
        (request.param == "tokenizer_config.json")
    return path


@pytest.fixture(scope="module")
def pair(folder):
    """(ours, transformers') for the same folder."""
    return Tokenizer.from_dir(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


def hf_ids(hf, messages, **kw):
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # transformers 5: a BatchEncoding


SYSTEM = {"role": "system", "content": "You are a careful assistant. Think step by step."}
CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "What is 12+34?"}],
    "system prompt": [SYSTEM, {"role": "user", "content": "What is 12+34?"}],
    "multi-turn": [SYSTEM, {"role": "user", "content": "What is 1+2?"},
                   {"role": "assistant", "content": "1+2=3."}, {"role": "user", "content": "And 3+4?"},
                   {"role": "assistant", "content": "7"}, {"role": "user", "content": "Now 100+23?"}],
    "reasoning in content": [{"role": "user", "content": "1+1?"},
                             {"role": "assistant", "content": "<think>\none and one\n</think>\n\n2"},
                             {"role": "user", "content": "2+2?"}],
    "reasoning after the last user turn": [SYSTEM, {"role": "user", "content": "5+5?"},
                                           {"role": "assistant", "content": "10", "reasoning_content": "five twice"}],
    "reasoning under another name": [{"role": "user", "content": "5+5?"},
                                     {"role": "assistant", "content": "10", "thinking": "five twice"}],
    "unicode": [{"role": "system", "content": "Réponds en français, s'il te plaît. 数学 🙂"},
                {"role": "user", "content": "  Combien font 7×8 ?\n\tÜber naïve été — 答案?  "}],
    "special-token text in content": [{"role": "user", "content": "say <|im_end|> then <think>ok</think>"}],
    "None values dropped": [{"role": "user", "content": "hi", "name": None}],
}
KWARGS = {"default": {}, "thinking off": {"enable_thinking": False}, "thinking on": {"enable_thinking": True},
          "tojson and a special-token override": {"metadata": {"lang": "fr", "note": "<é> & ü"}, "eos_token": "<|im_end|>"}}


@pytest.mark.parametrize("kw", KWARGS.values(), ids=KWARGS.keys())
@pytest.mark.parametrize("messages", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
def test_chat_ids_equal_transformers(pair, messages, kw):
    ours, hf = pair
    ids = ours.apply_chat_template(messages, add_generation_prompt=True, **kw)
    assert ids == hf_ids(hf, messages, add_generation_prompt=True, **kw)
    assert ours.render_chat(messages, **kw) == hf.apply_chat_template(messages, add_generation_prompt=True,
                                                                       tokenize=False, **kw)


def test_thinking_switch_changes_the_ids(pair):
    ours, hf = pair
    msgs = CONVERSATIONS["system prompt"]
    on, off = ours.apply_chat_template(msgs), ours.apply_chat_template(msgs, enable_thinking=False)
    assert off[: len(on)] == on and len(off) > len(on)  # the empty think block is appended
    assert ours.decode(off[len(on):], skip_special_tokens=False) == "<think>\n\n</think>\n\n"


@pytest.mark.parametrize("name", ["multi-turn", "reasoning in content"])
def test_without_generation_prompt(pair, name):
    ours, hf = pair
    msgs = CONVERSATIONS[name]
    assert ours.apply_chat_template(msgs, add_generation_prompt=False) == hf_ids(hf, msgs, add_generation_prompt=False)


def test_strftime_now(pair):
    ours, hf = pair
    msgs = CONVERSATIONS["system prompt"]
    assert ours.render_chat(msgs, show_date=True) == hf.apply_chat_template(msgs, add_generation_prompt=True,
                                                                             tokenize=False, show_date=True)


TEXTS = ["What is 12+34? The answer is 46.", "  leading and trailing spaces  \n\n", "été naïve über 数学 答案 🙂",
         "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n", "tabs\tand\r\nnewlines", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal_transformers(pair, text):
    ours, hf = pair
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text == hf.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)  # the special tokens dropped


@pytest.mark.parametrize("seed", range(6))
def test_text_stream_follows_decode(pair, seed):
    """TextStream's text after each token is decode() of the tokens so far, less a trailing incomplete
    character: on real text (multi-byte characters split over tokens, special tokens) and on random ids
    (invalid UTF-8, ids past the tokenizer's vocabulary, as a model with a padded vocabulary can sample)."""
    import random

    ours, _ = pair
    rng = random.Random(seed)
    text_ids = ours.encode("".join(TEXTS) + "été 数学 🙂 答案", add_special_tokens=False)
    ids = text_ids if seed == 0 else [rng.randrange(ours.vocab_size + 8) for _ in range(200)]
    stream, pieces = ours.stream(), []
    for k, t in enumerate(ids):
        pieces.append(stream.push(t))
        full = ours.decode(ids[: k + 1])
        assert stream.text == "".join(pieces)
        if full.endswith("\ufffd"):  # held back: a prefix of the decode
            assert full.startswith(stream.text) and len(stream.text) < len(full)
        else:
            assert stream.text == full
    if seed == 0:
        assert stream.text == ours.decode(text_ids) and any(p == "" for p in pieces)  # some character was split


def test_vocabulary(pair):
    ours, hf = pair
    assert ours.get_vocab() == hf.get_vocab() and ours.vocab_size == len(hf)
    for tok in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"):
        i = ours.token_to_id(tok)
        assert i == hf.convert_tokens_to_ids(tok) and ours.id_to_token(i) == tok
    assert ours.token_to_id("no such token") is None and ours.id_to_token(10**6) is None


def test_files(folder):
    tok = Tokenizer.from_dir(folder)
    names = {p.name for p in tok.files}
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    assert ("chat_template.jinja" in names) == (folder / "chat_template.jinja").is_file()


# -- eos ids -----------------------------------------------------------------------------------------
@pytest.fixture
def local(folder, tmp_path):
    """A copy of the folder a test may change."""
    return shutil.copytree(folder, tmp_path / "tok")


def test_eos_from_generation_config_list(local):
    tok = Tokenizer.from_dir(local)
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert tok.eos_token_ids == (im_end,)  # tokenizer_config.json's eos_token
    (local / "config.json").write_text(json.dumps({"eos_token_id": eot}))
    assert Tokenizer.from_dir(local).eos_token_ids == (eot,)  # config.json wins over the tokenizer
    assert write_generation_config(local) == [im_end, eot]
    tok = Tokenizer.from_dir(local)
    assert tok.eos_token_ids == (im_end, eot) and tok.eos_file == local / "generation_config.json"
    (local / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_dir(local).eos_token_ids == (7,)


def test_no_eos(local):
    cfg = json.loads((local / "tokenizer_config.json").read_text())
    del cfg["eos_token"]
    (local / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(local).eos_token_ids == ()
    cfg["eos_token"] = {"content": "<|endoftext|>", "__type": "AddedToken"}  # the AddedToken dict form
    (local / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(local).eos_token_ids == (Tokenizer.from_dir(local).token_to_id("<|endoftext|>"),)


@pytest.mark.parametrize("content, words", [
    ({"eos_token_id": "<|im_end|>"}, "eos_token_id must be"),
    ({"eos_token_id": [1, -2]}, "eos_token_id must be"),
    ({"eos_token_id": 10**6}, "outside the model's vocabulary"),
])
def test_bad_eos(local, content, words):
    (local / "generation_config.json").write_text(json.dumps(content))
    with pytest.raises(ValueError, match=words) as e:
        Tokenizer.from_dir(local, vocab_size=1000)
    assert "generation_config.json" in str(e.value)


def test_sizes_and_missing(local, tmp_path):
    assert Tokenizer.from_dir(tmp_path / "nothing here") is None
    n = Tokenizer.from_dir(local).vocab_size
    assert Tokenizer.from_dir(local, vocab_size=n).vocab_size == n
    with pytest.raises(ValueError, match=f"tokenizer has {n} tokens but the model's vocabulary is {n - 1}") as e:
        Tokenizer.from_dir(local, vocab_size=n - 1)
    assert str(local / "tokenizer.json") in str(e.value)
    (local / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: cannot read it as JSON"):
        Tokenizer.from_dir(local)
    (local / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json: not a tokenizer"):
        Tokenizer.from_dir(local)


# -- templates -------------------------------------------------------------------------------------------
def test_template_list_form_takes_default(local):
    (local / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((local / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ messages[0].content }}!"}]
    (local / "tokenizer_config.json").write_text(json.dumps(cfg))
    msgs = [{"role": "user", "content": "hi"}]
    assert Tokenizer.from_dir(local).render_chat(msgs) == "hi!" == \
        transformers.AutoTokenizer.from_pretrained(str(local)).apply_chat_template(msgs, tokenize=False)


def test_jinja_file_wins_over_the_config(local):
    cfg = json.loads((local / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "from the config"
    (local / "tokenizer_config.json").write_text(json.dumps(cfg))
    (local / "chat_template.jinja").write_text("from the file")
    msgs = [{"role": "user", "content": "hi"}]
    tok = Tokenizer.from_dir(local)
    assert tok.render_chat(msgs) == "from the file" == \
        transformers.AutoTokenizer.from_pretrained(str(local)).apply_chat_template(msgs, tokenize=False)
    assert tok.template_file == local / "chat_template.jinja"


def _with_template(local, template):
    (local / "chat_template.jinja").write_text(template)
    return Tokenizer.from_dir(local)


@pytest.mark.parametrize("template, words", [
    ("{% for m in messages %}{{ m.content }", "does not compile: line 1"),
    ("{% if %}", "does not compile"),
    ("{{ raise_exception('only user messages, please') }}", "only user messages, please"),
    ("{{ messages[0].content + 1 }}", "TypeError"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError"),  # the sandbox
    ("{% set ns = namespace(_secret=1) %}", "underscore"),
    ("{{ messages.append(1) }}", "SecurityError"),  # immutable: the template cannot change the messages
])
def test_bad_template_names_the_file(local, template, words):
    tok = _with_template(local, template)
    with pytest.raises(ChatTemplateError, match=words) as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(local / "chat_template.jinja") in str(e.value)
    with pytest.raises(Exception):  # transformers refuses it too
        transformers.AutoTokenizer.from_pretrained(str(local)).apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False)


def test_template_raise_exception_on_input(pair):
    ours, hf = pair
    msgs = [{"role": "user", "content": "hi"}, SYSTEM]  # the template wants the system message first
    with pytest.raises(ChatTemplateError, match="the system message must come first"):
        ours.apply_chat_template(msgs)
    with pytest.raises(Exception, match="the system message must come first"):
        hf.apply_chat_template(msgs, tokenize=False)


def test_no_template(local):
    (local / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((local / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (local / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(local)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template") as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(local) in str(e.value)


@pytest.mark.parametrize("messages, words", [
    ("hi", "list of"),
    ([], "non-empty list"),
    (["hi"], "message 0"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], "message 1"),
    ([{"role": 3, "content": "a"}], "message 0"),
    ([{"role": "user"}], "content"),
])
def test_bad_messages(pair, messages, words):
    with pytest.raises(ValueError, match=words):
        pair[0].apply_chat_template(messages)


# A template in the older style (no `-` whitespace control: trim_blocks / lstrip_blocks decide the layout),
# with loop controls, a {% generation %} block, `tools`, `bos_token` and `dict`.
PLAIN_STYLE = """{{ bos_token if bos_token is defined else '' }}
{% for message in messages %}
    {% if message.role == 'stop' %}{% break %}{% endif %}
    {% if message.content == 'skip' %}{% continue %}{% endif %}
<|im_start|>{{ message.role }}
    {% if message.role == 'assistant' %}
{% generation %}{{ message.content }}{% endgeneration %}
    {% else %}
{{ message.content | trim }}
    {% endif %}
<|im_end|>
{% endfor %}
{% if tools %}tools!{% endif %}
{% set d = dict(a=1) %}{{ d | tojson }}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def test_block_whitespace_and_extensions_as_transformers(local):
    tok = _with_template(local, PLAIN_STYLE)
    hf = transformers.AutoTokenizer.from_pretrained(str(local))
    msgs = [SYSTEM, {"role": "user", "content": "  hi  "}, {"role": "user", "content": "skip"},
            {"role": "assistant", "content": "yes"}, {"role": "stop", "content": "x"}, {"role": "user", "content": "z"}]
    for agp in (True, False):
        text = tok.render_chat(msgs, add_generation_prompt=agp)
        assert text == hf.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=False)
        assert tok.apply_chat_template(msgs, add_generation_prompt=agp) == hf_ids(hf, msgs, add_generation_prompt=agp)
    assert "skip" not in text and "z" not in text and '{"a": 1}' in text
