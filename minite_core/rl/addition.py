"""The built-in verifiable task: multi-digit addition, with a character-level tokenizer.

It goes through the same door as a user's task: a dataset source (`AdditionRows`, every "<bos>a+b=" prompt
with its `answer` column; `addition_eval_rows` for the fixed evaluation problems) and a reward function with
TRL's signature (`addition`). A completion earns 1.0 when it is exactly the sum followed by "<eos>", else a
partial credit of 0.5 per digit in place (out of the longer of the two strings). The tokenizer is a
`tokenizers` WordLevel model over single characters, saved as a regular tokenizer.json, so the tiny model
loads through the same `load_model` path as a real checkpoint.
"""
from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<pad>", "<bos>", "<eos>"]
CHARS = list("0123456789+=")
VOCAB = SPECIALS + CHARS
PAD, BOS, EOS = 0, 1, 2
_ID = {s: i for i, s in enumerate(VOCAB)}


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(dict(_ID), unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.add_special_tokens(SPECIALS)  # "<bos>" in a text prompt is one token; decode skips specials
    tok.decoder = decoders.Fuse()  # characters back to a string, no separators
    return tok


class AdditionRows:
    """Every (a, b) pair of numbers below 10**digits, row i = (i // 10**digits, i % 10**digits), as dataset rows
    {"prompt": "<bos>a+b=", "answer": "a+b"} (a standard prompt: the text is tokenized as is)."""

    def __init__(self, digits: int = 2):
        if not isinstance(digits, int) or not 1 <= digits <= 9:
            raise ValueError(f"addition: digits must be an integer from 1 to 9, got {digits!r}")
        self.digits = digits

    def __len__(self) -> int:
        return 10 ** (2 * self.digits)

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"addition row {i} out of range ({len(self)} rows)")
        a, b = divmod(i % len(self), 10**self.digits)
        return _row(a, b)


def addition_eval_rows(digits: int = 2, n: int = 128, seed: int = 1234) -> list[dict]:
    """The fixed evaluation problems: a, b = randrange(10**digits) twice per problem from random.Random(seed)."""
    rng, hi = random.Random(seed), 10**digits
    return [_row(rng.randrange(hi), rng.randrange(hi)) for _ in range(n)]


def _row(a: int, b: int) -> dict:
    return {"prompt": f"<bos>{a}+{b}=", "answer": str(a + b)}


def addition(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    """1.0 for exactly the answer's characters followed by <eos>; else 0.5 * digits in place / the longer length,
    compared on the completion decoded up to its first <eos>."""
    return [_addition_reward(list(ids), str(want)) for ids, want in zip(completion_ids, answer)]


def _addition_reward(ids: list[int], want: str) -> float:
    target = [_ID[c] for c in want] + [EOS]
    if ids[: len(target)] == target:
        return 1.0
    bad = [i for i in ids if not 0 <= i < len(VOCAB)]
    if bad:
        raise ValueError(f"token id {bad[0]} is not in the addition task's {len(VOCAB)}-symbol vocabulary")
    got = "".join(VOCAB[i] for i in (ids[: ids.index(EOS)] if EOS in ids else ids) if i >= len(SPECIALS))
    hits = sum(1 for x, y in zip(got, want) if x == y)
    return 0.5 * hits / max(len(want), len(got), 1)
