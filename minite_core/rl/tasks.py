"""The built-in verifiable task: multi-digit addition, with a character-level tokenizer.

A prompt is "<bos>a+b=" and the answer is the decimal sum followed by "<eos>"; rewards are checked
exactly (1.0 for the right sum, else 0.0), with an optional partial credit for each correct digit in
place. The tokenizer is a `tokenizers` WordLevel model over single characters, saved as a regular
tokenizer.json, so the tiny model loads through the same `load_model` path as a real checkpoint.
"""
from __future__ import annotations

import dataclasses
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<pad>", "<bos>", "<eos>"]
CHARS = list("0123456789+=")
VOCAB = SPECIALS + CHARS
PAD, BOS, EOS = 0, 1, 2


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({s: i for i, s in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.add_special_tokens(SPECIALS)  # "<bos>" in a text prompt is one token; decode skips specials
    tok.decoder = decoders.Fuse()  # characters back to a string, no separators
    return tok


@dataclasses.dataclass
class AdditionTask:
    digits: int = 2
    partial_credit: bool = False
    seed: int = 0

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.tokenizer = build_tokenizer()

    def sample(self) -> tuple[int, int]:
        hi = 10**self.digits
        return self.rng.randrange(hi), self.rng.randrange(hi)

    def prompt_ids(self, a: int, b: int) -> list[int]:
        return [BOS] + self.tokenizer.encode(f"{a}+{b}=").ids

    def answer_ids(self, a: int, b: int) -> list[int]:
        return self.tokenizer.encode(str(a + b)).ids + [EOS]

    def decode(self, ids: list[int]) -> str:
        return "".join(VOCAB[i] for i in ids if i >= len(SPECIALS))

    def reward(self, a: int, b: int, completion: list[int]) -> float:
        """1.0 for exactly the sum followed by <eos>; partial credit: the fraction of digits in place."""
        target = self.answer_ids(a, b)
        if completion[: len(target)] == target:
            return 1.0
        if not self.partial_credit:
            return 0.0
        want = str(a + b)
        got = self.decode(completion[: completion.index(EOS)] if EOS in completion else completion)
        hits = sum(1 for x, y in zip(got, want) if x == y)
        return 0.5 * hits / max(len(want), len(got), 1)
