"""Reward functions for the addition example, with TRL's signature: they would run unchanged in TRL's
GRPOTrainer. `completions` are strings here (the prompts are standard strings); the columns of each row
(`answer`, `data_source`) arrive as keyword arguments, one value per completion."""


def correct(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    """1 for exactly the answer, else half a point for each digit in its place."""
    out = []
    for text, want in zip(completions, answer):
        got = text.strip()
        if got == want:
            out.append(1.0)
        else:
            hits = sum(x == y for x, y in zip(got, want))
            out.append(0.5 * hits / max(len(got), len(want), 1))
    return out


def short(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """A small cost per token past the shortest possible answer (two digits and eos)."""
    return [-max(0, len(ids) - 3) / 4 for ids in completion_ids]
