"""The rollout engine's admission order (issue 17, item 10b): with every slot taken by a large request (n=8), a
small request that arrives later joins at the first free slot instead of waiting for all 8 samples, and its
tokens are exactly those it gets alone (who shares a step never changes a sequence's bits)."""
import torch
from tests.backends import DEVICE

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


def _overlap_run(model, overlap: bool, events: list, pending: list):
    """Requests that join as slots free (more than the slots), stop on stop ids, by length, by a stop the
    caller sets from a token callback (a service's stop string) and by a cancel, with top alternatives on one,
    and two more on a weight version installed mid-run; -> the completions; `events` gets every callback in order, `pending` whether a step was left in flight."""
    engine = RolloutEngine(model, max_slots=3, max_seq_len=24, overlap=overlap)
    g, vocab = torch.Generator().manual_seed(7), model.cfg.vocab_size
    reqs = {}

    def on_token(r, i, tok, lp, finish):
        events.append((r, i, tok, lp, finish))
        if r == 2 and i == 0 and len(reqs[2].seqs[0].tokens) == 3:
            engine.finish(reqs[2], 0)  # (the service's text stop strings end a sequence this way)
        if r == 3 and len(reqs[3].seqs[1].tokens) == 2:
            engine.cancel(reqs[3])

    def submit(r):
        prompt = torch.randint(0, vocab, (int(torch.randint(2, 9, (), generator=g)),), generator=g).tolist()
        params = SamplingParams(max_tokens=4 + 3 * (r % 4), temperature=[1.0, 0.0, 0.7][r % 3], seed=r,
                                n=1 + r % 2, stop_token_ids=(r, r + 6) if r % 3 == 1 else (),
                                logprobs=3 if r == 5 else 0)
        reqs[r] = engine.submit(prompt, params, on_token=lambda i, tok, lp, fin, r=r: on_token(r, i, tok, lp, fin))

    for r in range(7):
        submit(r)
    served = model.w
    try:
        while engine.busy:
            engine.step()
            pending.append(engine._pending is not None)
            if len(pending) == 4:  # a new weight version mid-run: two versions decode side by side for a while
                engine.set_weights({n: t * 1.01 if n.endswith("norm.weight") else t for n, t in served.items()}, 1)
                submit(7)
                submit(8)
    finally:
        model.w = served  # (set_weights installed the new version on the shared model)
    assert engine._pending is None and all(q.ahead == 0 for r in reqs.values() for q in r.seqs)
    assert {r.version for r in reqs.values()} == {0, 1}
    return [(c.token_ids, c.logprobs.tolist(), c.finish_reason, c.top_logprobs)
            for r in reqs.values() for c in r.completions()]


def test_overlapped_decode_gives_the_tokens_of_step_by_step_decode(tmp_path):
    """The decode step launched before the host reads the previous step's tokens (its ids taken from them on
    the device): the same tokens, logprobs, finish reasons, alternatives and callbacks as step by step, with
    sequences joining, ending on stop ids, on a caller's stop, by a cancel and by length while a step is in flight."""
    path = random_checkpoint(tmp_path / "m", TINY, seed=2, dtype=torch.float32)
    model = load_model(path, precision="nvfp4", device=DEVICE)  # (on a GPU: CUDA graphs, pinned copies, events)
    events, overlapped_events, pending, overlapped_pending = [], [], [], []
    plain = _overlap_run(model, False, events, pending)
    overlapped = _overlap_run(model, True, overlapped_events, overlapped_pending)
    assert overlapped == plain
    by_seq = lambda evs: {key: [e for e in evs if e[:2] == key] for key in {e[:2] for e in evs}}  # noqa: E731
    assert by_seq(overlapped_events) == by_seq(events)  # (slots free a step later: the interleaving may differ)
    assert not any(pending) and sum(overlapped_pending) >= 10  # (the overlap ran: steps ended with one in flight)
    reasons = [c[2] for c in plain]
    assert {"stop", "length", "abort"} <= set(reasons), reasons


def test_prompt_logprobs_of_an_older_version_leave_new_requests_on_the_serving_weights(tmp_path):
    """A request's prompt logprobs (REST `echo`) are computed with the weights it was sampled with; a request
    submitted after them, once a newer version serves, runs on the newer weights (it once ran on the old ones
    under the new version's label until the next push)."""
    path = random_checkpoint(tmp_path / "m", TINY, seed=1, dtype=torch.float32)
    old, new = load_model(path, precision="nvfp4"), load_model(random_checkpoint(tmp_path / "m2", TINY, seed=2,
                                                                                 dtype=torch.float32), precision="nvfp4")
    engine = RolloutEngine(old, max_slots=2, max_seq_len=32)
    prompt, params = [1, 4, 5, 13, 7], SamplingParams(max_tokens=3, temperature=0.0)
    first = engine.submit(prompt, params)
    while engine.busy:
        engine.step()
    at_v0 = engine.prompt_logprobs(first)
    engine.set_weights(new.w, version=1)
    assert engine.prompt_logprobs(first) == at_v0  # still the version it was sampled with
    later = engine.submit(prompt, params)
    while engine.busy:
        engine.step()
    assert engine.model.w is new.w and later.weights is new.w and later.version == 1
    on_new = RolloutEngine(new, max_slots=2, max_seq_len=32).generate([prompt], params)[0]
    assert torch.equal(torch.tensor(later.seqs[0].logprobs), on_new.logprobs)
