"""A Hugging Face tokenizer folder: token ids, eos ids and the chat template, rendered as transformers does.

What is read from the folder (nothing is downloaded, transformers is not needed):
- `tokenizer.json`, through the `tokenizers` library (the same Rust tokenizer transformers' fast tokenizers
  wrap): encode, decode, the vocabulary. No tokenizer.json: `Tokenizer.from_dir` returns None.
- the chat template: `chat_template.jinja` (what transformers 5 writes; or chat_templates/default.jinja) wins
  over `tokenizer_config.json`'s "chat_template" (a string, or a list of {"name", "template"} of which
  "default" is taken), as in transformers' `from_pretrained`.
- the special-token strings of tokenizer_config.json (bos_token, eos_token, unk_token, sep_token, pad_token,
  cls_token, mask_token; a string or an AddedToken dict): the template sees them as variables.
- the eos ids generation stops on: generation_config.json "eos_token_id" (an int or a list) if set, else
  config.json's, else tokenizer_config.json's eos_token looked up in the vocabulary; () when none.

Rendering follows transformers' `apply_chat_template` (transformers/utils/chat_template_utils.py): a Jinja2
`ImmutableSandboxedEnvironment` with trim_blocks and lstrip_blocks, the loopcontrols extension and a
pass-through `{% generation %}` tag; the globals raise_exception, strftime_now, dict and an underscore-
refusing namespace; a `tojson` filter that does not escape HTML or non-ASCII. The template receives
`messages` (keys whose value is None dropped; `reasoning_content` also filled from `thinking` / `reasoning`),
`tools=None`, `documents=None`, `add_generation_prompt`, the special-token strings, then the caller's
keyword arguments (`enable_thinking=False`, ...), which win. The rendered string is encoded with
`add_special_tokens=False`, so the ids equal `AutoTokenizer.from_pretrained(dir).apply_chat_template(
messages, add_generation_prompt=True, **kwargs)`.

Errors: a template that does not compile or fails to render (including its own `raise_exception`) raises
ChatTemplateError naming the file and Jinja's message; messages that are not a list of {"role", "content"}
dicts raise ValueError naming the message; unreadable files raise ValueError naming the file.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# the files of a tokenizer folder (copied with the model on export); chat_templates/*.jinja too
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases, the first is read


class ChatTemplateError(ValueError):
    """No chat template, or the template fails to compile or render; the message names the file."""


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: cannot read it as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_str(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, config: dict) -> tuple[str | None, Path]:
    """(template or None, the file it comes from): template files win over tokenizer_config.json."""
    for file in (path / "chat_template.jinja", path / "chat_templates" / "default.jinja"):
        if file.is_file():
            return file.read_text(encoding="utf-8"), file
    file = path / "tokenizer_config.json"
    t = config.get("chat_template")
    if isinstance(t, list):  # [{"name", "template"}, ...]: the default one
        t = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}.get("default")
    if t is not None and not isinstance(t, str):
        raise ChatTemplateError(f"{file}: chat_template must be a string or a list of {{name, template}}, "
                                f"got {type(t).__name__}")
    return t, file


def _eos_ids(path: Path, config: dict, token_to_id) -> tuple[tuple[int, ...], Path | None]:
    """(eos ids, the file they come from)."""
    for name in ("generation_config.json", "config.json"):
        file = path / name
        eos = _read_json(file).get("eos_token_id")
        if eos is None:
            continue
        ids = [eos] if isinstance(eos, int) else eos
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{file}: eos_token_id must be a token id or a list of them, got {eos!r}")
        return tuple(dict.fromkeys(ids)), file
    eos = _token_str(config.get("eos_token"))
    if eos is None:
        return (), None
    i = token_to_id(eos)
    if i is None:
        raise ValueError(f"{path / 'tokenizer_config.json'}: eos_token {eos!r} is not in the vocabulary of tokenizer.json")
    return (i,), path / "tokenizer_config.json"


def _environment():
    """transformers' sandboxed Jinja environment for chat templates (see the module docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:  # dict(...) without attribute access to the real class
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class Namespace(jinja2.utils.Namespace):  # no underscore attributes (CPython internals)
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=Namespace)
    return env


def _messages(messages) -> list[dict]:
    """Check {"role", "content"} dicts; drop None values and alias the reasoning fields, as transformers."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.200}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"message {i} must be a dict with a string 'role' and a 'content', got {m!r:.200}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode (byte-level BPE writes each byte as one printable character)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:  # the unprintable bytes map to 256, 257, ... in order
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class Tokenizer:
    """An HF tokenizer folder (see the module docstring). Build with `Tokenizer.from_dir(path)`."""

    def __init__(self, path: Path, tok, config: dict):
        self.path = Path(path)
        self._tok = tok
        self.vocab_size: int = tok.get_vocab_size()
        self.chat_template, self.template_file = _chat_template(self.path, config)
        self.special_tokens = {k: s for k in SPECIAL_TOKEN_NAMES if (s := _token_str(config.get(k))) is not None}
        self.eos_token_ids, self.eos_file = _eos_ids(self.path, config, self.token_to_id)
        self.files: list[Path] = [self.path / f for f in TOKENIZER_FILES if (self.path / f).is_file()]
        self.files += sorted((self.path / "chat_templates").glob("*.jinja"))
        self._compiled = None

    @classmethod
    def from_dir(cls, path, vocab_size: int | None = None) -> Tokenizer | None:
        """The tokenizer of folder `path`; None when it has no tokenizer.json. `vocab_size`: the model's
        vocabulary; a tokenizer with more tokens is refused (ValueError naming the file)."""
        from tokenizers import Tokenizer as _Rust

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            return None
        try:
            tok = _Rust.from_file(str(file))
        except Exception as e:  # the Rust side raises plain Exception
            raise ValueError(f"{file}: not a tokenizer the `tokenizers` library can read: {e}") from None
        if vocab_size is not None and tok.get_vocab_size() > vocab_size:
            raise ValueError(f"{file}: the tokenizer has {tok.get_vocab_size()} tokens but the model's vocabulary "
                             f"is {vocab_size}")
        out = cls(path, tok, _read_json(path / "tokenizer_config.json"))
        if vocab_size is not None and (bad := [i for i in out.eos_token_ids if i >= vocab_size]):
            raise ValueError(f"{out.eos_file}: eos token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})")
        return out

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})"

    # -- tokens -----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream(self) -> TextStream:
        """A `TextStream`: the text of a growing completion, one token at a time."""
        return TextStream(self._tok)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i stands for (OpenAI's logprobs `bytes`): a byte-level BPE token's characters mapped
        back through GPT-2's byte table, a byte-fallback token <0xAB> its byte, else its decoded text."""
        piece = self._tok.id_to_token(i)
        if piece is None:
            return b""
        if type(self._tok.decoder).__name__ == "ByteLevel":
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.decode([i], skip_special_tokens=False).encode("utf-8")

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def token_to_id(self, s: str) -> int | None:
        return self._tok.token_to_id(s)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab()

    # -- chat -------------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True, **template_kwargs) -> str:
        """The chat template rendered for `messages` (a string; see the module docstring)."""
        import jinja2

        if self.chat_template is None:
            raise ChatTemplateError(f"{self.path}: no chat template (neither chat_template.jinja nor a "
                                    "\"chat_template\" in tokenizer_config.json)")
        messages = _messages(messages)
        if self._compiled is None:
            try:
                self._compiled = _environment().from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"{self.template_file}: the chat template does not compile: line "
                                        f"{e.lineno}: {e.message}") from None
        context = {**self.special_tokens, "tools": None, "documents": None, **template_kwargs,
                   "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            return self._compiled.render(**context)
        except Exception as e:  # raise_exception, undefined names, the sandbox, a TypeError from 'a' + 1, ...
            raise ChatTemplateError(f"{self.template_file}: the chat template failed to render: "
                                    f"{type(e).__name__}: {e}") from None

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """The rendered chat's token ids (encoded without adding special tokens, as transformers)."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt, **template_kwargs))


class TextStream:
    """The decoded text of a completion that grows token by token, at a bounded cost per token
    (`tokenizers.decoders.DecodeStream`: it decodes a small window, not the whole prefix, so following a
    completion of n tokens costs O(n), where decoding every prefix costs O(n^2)).

    `text` equals `Tokenizer.decode(ids)` of the tokens pushed so far (special tokens skipped), except that a
    trailing character whose UTF-8 bytes are not all there yet is held back until they are (decode shows it
    as U+FFFD). Use `decode` on the whole sequence for the final text."""

    def __init__(self, tok):
        from tokenizers.decoders import DecodeStream

        self._tok, self._stream = tok, DecodeStream(skip_special_tokens=True)
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completes ("" while a character is incomplete)."""
        piece = self._stream.step(self._tok, int(token_id)) or ""
        self.text += piece
        return piece
