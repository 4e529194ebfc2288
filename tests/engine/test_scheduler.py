"""The rollout engine's admission order (issue 17, item 10b): with every slot taken by a large request (n=8), a
small request that arrives later joins at the first free slot instead of waiting for all 8 samples, and its
tokens are exactly those it gets alone (who shares a step never changes a sequence's bits)."""
import torch

from minite_core.engine import RolloutEngine, SamplingParams
from minite_core.model import load_model
from minite_core.model.random_init import random_checkpoint
from minite_core.rl.tiny import TINY, write_tokenizer


def test_a_small_request_is_not_queued_behind_every_sample_of_a_large_one(tmp_path):
    path = random_checkpoint(tmp_path / "m", TINY, seed=1, dtype=torch.float32)
    write_tokenizer(path)
    model = load_model(path, precision="nvfp4")
    engine = RolloutEngine(model, max_slots=2, max_seq_len=32)
    finished_at, step = {}, [0]
    engine.submit([1, 4, 5, 13], SamplingParams(n=8, max_tokens=6, seed=3),
                  on_done=lambda r: finished_at.setdefault("large", step[0]))
    engine.step()
    step[0] += 1
    small = engine.submit([1, 6, 13, 7], SamplingParams(max_tokens=2, seed=5),
                          on_done=lambda r: finished_at.setdefault("small", step[0]))
    while engine.busy:
        engine.step()
        step[0] += 1
    # FIFO admission ran all 8 samples of the large request (4 rounds of 2 slots x 6 tokens) before the small one
    assert finished_at["small"] <= 10 < finished_at["large"], finished_at
    alone = RolloutEngine(model, max_slots=2, max_seq_len=32).generate([[1, 6, 13, 7]], SamplingParams(max_tokens=2, seed=5))
    assert list(small.seqs[0].tokens) == list(alone[0].token_ids)
    assert torch.equal(torch.tensor(small.seqs[0].logprobs), alone[0].logprobs)
