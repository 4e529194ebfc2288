"""The rollout engine: token-by-token sampling with a slot KV cache and continuous batching.

Requests wait in a queue; whenever a KV-cache slot is free, a waiting sequence joins (the first one of the
request with the fewest sequences running, so a small request does not wait behind every sample of a
large one): its prompt is
prefilled into its slot (a forward over the prompt alone), then it takes part in the batched decode
steps with every other running sequence until it stops, and its slot is freed for the next one. The
cache is bounded (`max_slots` x `max_seq_len`): more requests queue, never crash; a request that could
never fit is rejected with a ValueError.

Two ways to drive it: `generate(prompts)` runs a batch of requests to completion (the in-process RL
loop, tests); a service calls `submit` (with per-token and completion callbacks), `step` in its own
loop, `cancel`, and `set_weights`. Weight versions: a request is pinned at submission to the version
then serving, and every token of it is computed with those weights, so no sequence mixes versions.
`set_weights` installs a new version atomically between steps; requests in flight either finish on
their version (both weight sets are held until they do) or are aborted. Sequences on different
versions decode in separate forwards: every op is batch-invariant, so splitting a batch changes no bit.

The logprob of a sampled token is log_softmax(logits / temperature) over the full vocabulary, at that
token (temperature 0, greedy, reports temperature 1); top-k and top-p only shape the distribution the
token is drawn from. On request (SamplingParams.logprobs = N) each step also reports the N most likely
tokens with their logprobs, and `prompt_logprobs` scores a request's prompt, both by the learner's functions. Sampling is batched (`sampler`): Gumbel-max with counter-based noise keyed by the
sequence's seed (from the request's seed and the sample's index among its n) and the token's index, so
a seeded request gives the same tokens whatever runs beside it.

Speed: sequences that join in the same step are prefilled together (right-padded; positions beyond a
prompt write cache entries that no query of the sequence reads before its decode step overwrites
them), and on CUDA the decode step of the newest weight version replays a captured CUDA graph
(`graphs`). Each step synchronizes with the host once, to read the sampled tokens; on CUDA the host reads
them while the device runs the next step, whose input ids it takes from them on the device (`OVERLAP`).
Because every op of the model is batch-invariant and decode == prefill, these logprobs equal, bit for
bit, those `Learner.logprobs` computes from the full sequence.
"""
from __future__ import annotations

import collections
import dataclasses
import math

import torch

from ..model.qwen3 import KVCache, Qwen3
from .graphs import StepGraphs, graph_capturable
from .learner import Learner
from .sampler import sample_batch, seed_key, top_alternatives

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"


MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3  # beyond these, logits / T overflow or flatten to nothing
MAX_TOP_LOGPROBS = 20  # alternatives per token (as vLLM and OpenAI allow)
# Overlapped decode (the default on CUDA): a decode step is launched before the host reads the previous step's
# tokens, its input ids taken from them on the device, so the GPU runs step t + 1 while the host appends step t's
# tokens, checks stops and calls back. A sequence that stops on a token the host had not read yet (a stop id, a
# client's stop string, a cancel) has had one more token computed for it, which is dropped (its cache write lies
# past what any later owner of the slot reads before writing). The same tokens and bits as step by step. (A step with
# a request for top alternatives waits for its logits at the draw, as do top-k / top-p rows: no overlap for it.)
OVERLAP = True
# Prefill graphs (`graphs.StepGraphs.prefill`): a prefill replays a graph of its (rows, length) bucket instead of
# launching its kernels from Python (CUDA only; it needs the decode graphs). On by default since 2026-12-08: the GPU
# test passed and an H100 run took the 0.6B b16 prefill from 37.5 to 11.3 ms, 1.7B b16 from 53.8 to 25.4 ms (NVFP4;
# docs/benchmarks.md); `RolloutEngine(prefill_graphs=False)` launches eagerly. Only prefills of at most
# PREFILL_GRAPH_TOKENS padded tokens (rows bucket x length bucket): a larger one is GPU-bound (b64 x 128 tokens gained
# 3-5%), and each graph keeps its logits and the pool its activations, so the bound caps both; larger ones run eagerly.
PREFILL_GRAPHS = True
PREFILL_GRAPH_TOKENS = 8192


def check_temperature(t) -> float:
    """0 (greedy) or a finite number in [MIN_TEMPERATURE, MAX_TEMPERATURE]; raises ValueError otherwise."""
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or \
            not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
        raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {t!r}")
    return float(t)


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: the whole vocabulary
    seed: int | None = None
    stop_token_ids: tuple = ()
    n: int = 1
    logprobs: int = 0  # the N most likely tokens reported with each sampled one (OpenAI's top_logprobs), <= 20

    def validate(self) -> None:
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check_temperature(self.temperature)
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (isinstance(self.n, int) and self.n >= 1):
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs (top alternatives) must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")


@dataclasses.dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: torch.Tensor  # fp32 [len(token_ids)], on the CPU (whatever the model's device)
    finish_reason: str
    weight_version: int
    request_index: int = 0
    sample_index: int = 0
    top_logprobs: list | None = None  # per token, [(token id, logprob), ...] most likely first (params.logprobs > 0)


@dataclasses.dataclass
class _Seq:
    prompt: list[int]
    params: SamplingParams
    seed: int
    request: "Request"
    sample_index: int
    seed_key: int = 0
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    top: list = dataclasses.field(default_factory=list)  # per token: [(id, logprob), ...] (params.logprobs > 0)
    slot: int = -1
    finish: str | None = None
    ahead: int = 0  # tokens drawn on the device that the host has not read yet (0 or 1: see `_Step`)

    @property
    def key(self) -> tuple[int, int]:
        return self.request.index, self.sample_index


@dataclasses.dataclass(eq=False)
class Request:
    """A submitted request: its n sequences, the weight version they use, and the callbacks (called on
    the thread that runs `step`): on_token(seq_index, token, logprob, finish_reason or None) and
    on_done(request)."""
    index: int
    prompt: list[int]
    params: SamplingParams
    version: int
    weights: dict
    on_token: object = None
    on_done: object = None
    seqs: list = dataclasses.field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(q.finish for q in self.seqs)

    def completions(self) -> list[Completion]:
        return [Completion(self.prompt, q.tokens, torch.tensor(q.logprobs, dtype=torch.float32),
                           q.finish, self.version, self.index, q.sample_index,
                           list(q.top) if self.params.logprobs else None) for q in self.seqs]


@dataclasses.dataclass(eq=False)
class _Step:
    """Tokens drawn on the device for `seqs` that the host has not read yet: `tokens` [b] int64 on the device
    (the next decode step's input ids), `drawn` float64 [2, b] (tokens, logprobs), on the host once `ready` has
    completed (a CUDA event; None on the CPU, where the copy is done at once), `tops` the top alternatives by
    row (computed at once: they sync)."""
    seqs: list
    tokens: torch.Tensor
    drawn: torch.Tensor
    ready: object = None
    tops: dict = dataclasses.field(default_factory=dict)


def _available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can take on `device` (free GPU memory; MemAvailable on the host); None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_cache_fits(model: Qwen3, rows: int, seq: int) -> None:
    """ValueError with the figures when the KV cache (rows x seq positions, K and V of every layer) would not
    fit in the memory left: refused before allocating, not killed by the OOM killer after."""
    c = model.cfg
    need = 2 * c.num_hidden_layers * rows * seq * c.num_key_value_heads * c.head_dim * model.dtype.itemsize
    have = _available_bytes(model.device)
    if have is not None and need > 0.9 * have:
        raise ValueError(f"the KV cache needs {need / 2**30:.1f} GiB ({rows - 1} slots x {seq} tokens x "
                         f"{c.num_hidden_layers} layers x {c.num_key_value_heads} KV heads x {c.head_dim} x 2 x "
                         f"{model.dtype.itemsize} bytes), more than the {have / 2**30:.1f} GiB available on "
                         f"{model.device}: lower max_slots or max_seq_len")


class RolloutEngine:
    PREFILL_TOKENS = 16384  # at most this many (padded) prompt tokens per prefill forward

    def __init__(self, model: Qwen3, *, max_slots: int = 16, max_seq_len: int | None = None,
                 cuda_graphs: bool | None = None, overlap: bool | None = None, prefill_graphs: bool | None = None):
        self.model = model
        self.max_seq_len = max_seq_len or min(model.cfg.max_position_embeddings, 4096)
        if max_slots < 1 or self.max_seq_len < 2:
            raise ValueError("max_slots must be >= 1 and max_seq_len >= 2")
        if self.max_seq_len > model.cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {self.max_seq_len} is longer than the model's context "
                             f"(max_position_embeddings {model.cfg.max_position_embeddings})")
        _check_cache_fits(model, max_slots + 1, self.max_seq_len)
        # one cache row more than slots: the scratch row the padding rows of a graph bucket write to
        self.cache = KVCache(model.cfg, max_slots + 1, self.max_seq_len, model.dtype, model.device)
        capturable = graph_capturable(model)
        if cuda_graphs is None:
            cuda_graphs = model.device.type == "cuda" and capturable
        if cuda_graphs and model.device.type != "cuda":
            raise ValueError("cuda_graphs needs the model on a CUDA device")
        if cuda_graphs and not capturable:
            raise ValueError("cuda_graphs: this model's MoE layers take the per-expert loop (host syncs, not "
                             "capturable); the grouped path needs backend='triton' and NVFP4 experts")
        self.graphs = StepGraphs(model, self.cache, max_slots, scratch_slot=max_slots) if cuda_graphs else None
        self.overlap = (OVERLAP and model.device.type == "cuda") if overlap is None else overlap
        if prefill_graphs and self.graphs is None:
            raise ValueError("prefill_graphs needs the decode's CUDA graphs: a model on a CUDA device whose decode "
                             "can be captured (cuda_graphs)")
        self.prefill_graphs = self.graphs is not None and (PREFILL_GRAPHS if prefill_graphs is None else prefill_graphs)
        self._pending: _Step | None = None  # the decode step in flight whose tokens the host reads next (overlap)
        self._version = 0
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.running: list[_Seq] = []
        self.free = list(range(max_slots))
        self._requests = 0

    # -- weights --------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    @weight_version.setter
    def weight_version(self, v: int) -> None:
        """Relabel the serving weights (the in-process loop updates `model.w` in place between batches)."""
        if self.busy:
            raise RuntimeError("cannot relabel the weight version while requests are in flight; use set_weights")
        self._version = v

    def set_weights(self, weights: dict, version: int, *, abort_in_flight: bool = False) -> int:
        """Serve `weights` (a complete dict by weight name) as `version` from now on. In-flight requests
        finish on their own version, or are aborted (finish_reason "abort"). Returns how many sequences
        were aborted. The caller validates the weights (names, shapes, formats) beforehand."""
        if version <= self._version:
            raise ValueError(f"weight version {version} is not newer than the serving version {self._version}")
        aborted = 0
        if abort_in_flight:
            for q in list(self.waiting) + self.running:
                if not q.finish:
                    q.finish = FINISH_ABORT
                    aborted += 1
            self._reap()
        self.model.w = weights
        self._version = version
        return aborted

    # -- requests -------------------------------------------------------------------------------
    def _check_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
            raise ValueError("a prompt must be a non-empty list of token ids")
        vocab = self.model.cfg.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context of {self.max_seq_len} tokens")
        return list(prompt)

    def submit(self, prompt, params: SamplingParams | None = None, *, on_token=None, on_done=None,
               index: int | None = None) -> Request:
        """Queue one request (its n samples) on the serving weight version. Raises ValueError on bad input."""
        params = params or SamplingParams()
        params.validate()
        prompt = self._check_prompt(prompt)
        if index is None:
            index = self._requests
        self._requests += 1
        req = Request(index, prompt, params, self._version, self.model.w, on_token, on_done)
        for s in range(params.n):
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**31, ()))
            q_seed = (seed * 1_000_003 + s) % 2**63
            req.seqs.append(_Seq(prompt, params, q_seed, req, s, seed_key(q_seed)))
        self.waiting.extend(req.seqs)
        return req

    def prompt_logprobs(self, req: Request) -> list[float]:
        """The logprobs of the request's prompt tokens after the first (vLLM's prompt_logprobs), under the
        weights and temperature the request was sampled with (1 for greedy): the learner engine's
        definition, computed by it (`Learner.logprobs`) on this engine's model."""
        if len(req.prompt) < 2:
            return []
        t = req.params.temperature if req.params.temperature > 0 else 1.0
        with torch.no_grad(), self.model.using(req.weights):
            return Learner(self.model).logprobs(req.prompt[:1], req.prompt[1:], t).tolist()

    def prompt_alternatives(self, req: Request) -> list[list[tuple[int, float]]]:
        """At each prompt position after the first, the req.params.logprobs most likely tokens with their logprobs
        (`top_alternatives`, as for sampled tokens) on the learner's logits of the prompt, under the weights and
        temperature of `prompt_logprobs`; [] per position when the request asks for none."""
        n = len(req.prompt) - 1
        if n < 1 or not req.params.logprobs:
            return [[] for _ in range(max(n, 0))]
        ids = torch.tensor([req.prompt], device=self.model.device)
        with torch.no_grad(), self.model.using(req.weights):
            logits = self.model.logits(ids, logits_dtype=self.model.dtype)[0, :-1]  # (Learner.batch_logprobs' rows)
            return top_alternatives(logits, list(range(n)), [req.params] * n, self.model.backend)

    def cancel(self, req: Request) -> None:
        """Stop a request's unfinished sequences (finish_reason "abort"); its slots free at once."""
        for q in req.seqs:
            if not q.finish:
                q.finish = FINISH_ABORT
        self._reap()

    def finish(self, req: Request, sample_index: int, reason: str = FINISH_STOP) -> None:
        """End one sequence now with `reason` (a service's text stop strings); no more tokens for it. Called
        from the token callback of a sequence's last token (it reached max_tokens), a stop still outranks
        "length", as in vLLM."""
        q = req.seqs[sample_index]
        if not q.finish or (q.finish == FINISH_LENGTH and reason == FINISH_STOP and q.slot >= 0):
            q.finish = reason
        self._reap()

    def _next_waiting(self) -> _Seq:
        """The waiting sequence to admit next: the first one of the request with the fewest sequences running, so
        a small request is not queued behind every sequence of a large one (n=64 x 1000 tokens) that came first.
        Which sequences share a step never changes their tokens (the kernels are batch-invariant)."""
        running = collections.Counter(id(q.request) for q in self.running)
        i = min(range(len(self.waiting)), key=lambda j: (running[id(self.waiting[j].request)], j))
        seq = self.waiting[i]
        del self.waiting[i]
        return seq

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, *,
                 capture=None) -> list[Completion]:
        """Complete every prompt (n samples each); results in request order, then sample order.

        `capture((request_index, sample_index), op_name, rows)` receives every op's output rows of each
        sequence as the engine computes them (prefill rows, then one row per decode step)."""
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
            plist = params
        else:
            plist = [params or SamplingParams()] * len(prompts)
        if self.busy:
            raise RuntimeError("generate() needs an idle engine (a service drives it with submit/step)")
        for p, prompt in zip(plist, prompts):  # validate all before queueing any
            p.validate()
            self._check_prompt(prompt)
        reqs = [self.submit(prompt, p, index=r) for r, (prompt, p) in enumerate(zip(prompts, plist))]
        while self.busy:
            self.step(capture)
        return [c for r in reqs for c in r.completions()]

    # -- the scheduler --------------------------------------------------------------------------
    def _draw(self, seqs: list[_Seq], logits: torch.Tensor) -> _Step:
        """Draw every sequence's next token from its logits row [len(seqs), V] on the device; the host reads
        them with `_read` (one sync). A sequence's draw is indexed by its token count, counting a token drawn
        ahead (`_Seq.ahead`) that the host has not read yet."""
        rows = [(q.params.temperature, q.params.top_k, q.params.top_p, q.seed_key, len(q.tokens) + q.ahead)
                for q in seqs]
        tokens, logprobs = sample_batch(logits, rows, self.model.backend)
        both = torch.stack([tokens.double(), logprobs.double()])  # fp32 -> fp64 is exact
        ready = None
        if both.is_cuda:  # (into pinned memory; the event marks the copy's end)
            both = both.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        wants = [i for i, q in enumerate(seqs) if q.params.logprobs]
        tops = {}
        if wants:  # (a sync of its own, only for requests that asked for alternatives)
            alternatives = top_alternatives(logits, wants, [seqs[i].params for i in wants], self.model.backend)
            tops = dict(zip(wants, alternatives))
        for q in seqs:
            q.ahead += 1
        return _Step(seqs, tokens, both, ready, tops)

    def _read(self, step: _Step) -> None:
        """Wait for a draw's tokens and append them, except to sequences that ended meanwhile."""
        if step.ready is not None:
            step.ready.synchronize()
        drawn = step.drawn.tolist()
        for i, (q, tok, lp) in enumerate(zip(step.seqs, drawn[0], drawn[1])):
            q.ahead -= 1
            if not q.finish:
                if i in step.tops:
                    q.top.append(step.tops[i])
                self._append(q, int(tok), lp)

    def _append(self, seq: _Seq, tok: int, lp: float) -> None:
        seq.tokens.append(tok)
        seq.logprobs.append(lp)
        if tok in seq.params.stop_token_ids:
            seq.finish = FINISH_STOP
        elif self._reaches_length(seq, len(seq.tokens)):
            seq.finish = FINISH_LENGTH
        if seq.request.on_token is not None:
            seq.request.on_token(seq.sample_index, tok, lp, seq.finish)

    def _reap(self) -> None:
        """Retire finished sequences: free their slots; call on_done for each request now complete."""
        done = [q for q in self.running if q.finish] + [q for q in self.waiting if q.finish]
        if not done:
            return
        self.running = [q for q in self.running if not q.finish]
        self.waiting = collections.deque(q for q in self.waiting if not q.finish)
        for q in done:
            if q.slot >= 0:
                self.free.append(q.slot)
                q.slot = -1
        for req in {id(q.request): q.request for q in done}.values():
            if req.done and req.on_done is not None:
                req.on_done(req)

    @staticmethod
    def _capture_rows(capture, seqs: list[_Seq], lengths: list[int] | None = None):
        if capture is None:
            return None
        if lengths is None:
            return lambda name, t: [capture(q.key, name, t[j]) for j, q in enumerate(seqs)]
        return lambda name, t: [capture(q.key, name, t[j, :n]) for j, (q, n) in enumerate(zip(seqs, lengths))]

    def _forward(self, seqs: list[_Seq], ids: torch.Tensor, pos: torch.Tensor, capture, lengths=None, logits_at=None):
        """One eager forward over `seqs` (all on one weight version) with that version's weights."""
        slots = torch.tensor([q.slot for q in seqs]).to(self.model.device, non_blocking=True)
        with self.model.using(seqs[0].request.weights):
            # logits in the model dtype, exactly as the Learner takes them: on the GPU the log-softmax
            # kernel's final reduction follows the load width, so fp32 and bf16 inputs holding the same
            # values can differ in the last bit
            return self.model(ids, pos, self.cache, slots, capture=self._capture_rows(capture, seqs, lengths),
                              check_ids=False, logits_at=logits_at, logits_dtype=self.model.dtype)

    def _prefill(self, seqs: list[_Seq], capture) -> None:
        """Prefill sequences of one version together, right-padded to the longest prompt (in chunks of at
        most PREFILL_TOKENS padded tokens), and draw each one's first token."""
        dev = self.model.device
        seqs = sorted(seqs, key=lambda q: len(q.prompt))
        lo = 0
        while lo < len(seqs):
            hi = lo + 1
            while hi < len(seqs) and (hi + 1 - lo) * len(seqs[hi].prompt) <= self.PREFILL_TOKENS:
                hi += 1
            group = seqs[lo:hi]
            t = len(group[-1].prompt)
            ids = torch.tensor([q.prompt + [0] * (t - len(q.prompt)) for q in group]).to(dev, non_blocking=True)
            last = torch.tensor([len(q.prompt) - 1 for q in group]).to(dev, non_blocking=True)
            version = group[0].request.version
            if (self.prefill_graphs and capture is None and version == self._version
                    and self.graphs.prefill_tokens(len(group), t) <= PREFILL_GRAPH_TOKENS):
                self.graphs.load(group[0].request.weights, version)
                slots = torch.tensor([q.slot for q in group]).to(dev, non_blocking=True)
                logits = self.graphs.prefill(ids, slots, last)
            else:
                pos = torch.arange(t, device=dev).expand(len(group), t)
                if capture is None:  # only the last prompt position's logits
                    logits = self._forward(group, ids, pos, None, logits_at=last)[:, 0]
                else:  # diagnostics see every prompt row
                    logits = self._forward(group, ids, pos, capture, [len(q.prompt) for q in group])[
                        torch.arange(len(group), device=dev), last]
            self._read(self._draw(group, logits))
            lo = hi

    def _decode(self, seqs: list[_Seq], capture, ahead: _Step | None = None) -> _Step:
        """Launch one decode step for `seqs` and draw their next tokens (read them with `_read`). `ahead`: the
        step in flight that drew every one of seqs' last tokens, whose host copy is not read yet: the input ids
        are taken from it on the device."""
        dev = self.model.device
        if ahead is None:
            ids = torch.tensor([[q.tokens[-1]] for q in seqs]).to(dev, non_blocking=True)
        elif len(ahead.seqs) == len(seqs) and all(a is q for a, q in zip(ahead.seqs, seqs)):
            ids = ahead.tokens.view(-1, 1)
        else:  # (some of ahead's sequences have ended)
            row = {id(q): i for i, q in enumerate(ahead.seqs)}
            index = torch.tensor([row[id(q)] for q in seqs]).to(dev, non_blocking=True)
            ids = ahead.tokens.index_select(0, index).view(-1, 1)
        pos = torch.tensor([[len(q.prompt) + len(q.tokens) + q.ahead - 1] for q in seqs]).to(dev, non_blocking=True)
        req = seqs[0].request
        if self.graphs is not None and capture is None and req.version == self._version:
            self.graphs.load(req.weights, req.version)
            slots = torch.tensor([q.slot for q in seqs]).to(dev, non_blocking=True)
            logits = self.graphs.run(ids, pos, slots)
        else:
            logits = self._forward(seqs, ids, pos, capture)[:, 0]
        return self._draw(seqs, logits)

    def _reaches_length(self, q: _Seq, n: int) -> bool:
        """Whether n tokens of q reach its max_tokens or the context (it then ends, FINISH_LENGTH)."""
        return n >= q.params.max_tokens or len(q.prompt) + n >= self.max_seq_len

    @torch.no_grad()
    def step(self, capture=None) -> None:
        """One scheduler iteration: waiting sequences join free slots (prefilled together, per weight
        version), then one decode step for every running sequence, one forward per version in flight."""
        joining: dict[int, list[_Seq]] = {}
        while self.waiting and self.free:
            seq = self._next_waiting()
            seq.slot = self.free.pop(0)
            self.running.append(seq)  # before the forward: if it raises, cancel() still finds the sequence
            joining.setdefault(seq.request.version, []).append(seq)
        for seqs in joining.values():
            self._prefill(seqs, capture)
        self._reap()
        if self.waiting and self.free:
            return  # let waiting sequences join before the next decode step
        groups = self._groups()
        ahead, self._pending = self._pending, None
        overlap = self.overlap and capture is None and len(groups) == 1
        if ahead is not None and not (overlap and all(q.ahead for q in self.running)):
            self._read(ahead)  # (sequences joined, versions differ, or a capture: this step's ids from the host)
            ahead = None
            self._reap()
            groups = self._groups()
            overlap = overlap and len(groups) == 1
        if overlap:  # launch this step, then read the previous one while the device runs it
            # (not those that the tokens drawn ahead end by length)
            seqs = [q for q in next(iter(groups.values())) if not self._reaches_length(q, len(q.tokens) + q.ahead)]
            self._pending = self._decode(seqs, None, ahead) if seqs else None
            if ahead is not None:
                self._read(ahead)
        else:
            for seqs in groups.values():
                self._read(self._decode(seqs, capture))
        self._reap()
        if not self.running and self._pending is not None:  # every sequence ended: drop the step in flight
            self._read(self._pending)
            self._pending = None

    def _groups(self) -> dict[int, list[_Seq]]:
        """The running sequences by weight version (each version decodes in its own forward)."""
        groups: dict[int, list[_Seq]] = {}
        for q in self.running:
            groups.setdefault(q.request.version, []).append(q)
        return groups
