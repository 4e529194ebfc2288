"""The rollout service's engine loop: one thread owns the RolloutEngine and steps it while there is
work; request threads (gRPC workers, the REST event loop) submit, cancel and swap weights under the
same lock, between steps. Admission control lives here: requests that could never fit are refused
(ValueError), and beyond `max_waiting` queued sequences new work is refused (Overloaded) rather than
queued without bound. The serving metrics (vLLM's names) are measured here as tokens come out.

Under load: a refusal (queue full, shutting down) is decided without the engine lock, so it comes back
at once instead of after the step in progress; between two steps the loop lets every thread waiting for
the lock in first (Python's lock has no fairness: the loop could take it back at once, step after step,
while a submitter waited); a cancel never waits for a step (it is applied before the next one).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time

import torch

from minite_core.engine import RolloutEngine, SamplingParams
from minite_core.model import load_model

from ..common.metrics import RolloutMetrics
from ..common.turns import CountedLock
from ..common.weights import describe, idle_guarded

log = logging.getLogger("minite.rollout")


class Overloaded(Exception):
    """The queue is full: try again later (HTTP 429 / RESOURCE_EXHAUSTED)."""


class RolloutRuntime:
    def __init__(self, settings, metrics: RolloutMetrics | None = None):
        self.settings = settings
        self.metrics = metrics or RolloutMetrics(settings.model_name)  # (labelled as GET /v1/models names it)
        model = load_model(settings.model_dir, precision=settings.precision, backend=settings.backend,
                           device=settings.device)
        self.tokenizer = model.tokenizer  # minite_core.tokenizer.Tokenizer, or None (token ids only)
        self.eos_token_ids = model.tokenizer.eos_token_ids if model.tokenizer is not None else ()  # REST stops on them
        self.engine = RolloutEngine(model, max_slots=settings.max_slots, max_seq_len=settings.max_seq_len,
                                    overlap=None if settings.overlap else False,  # (None: on where CUDA graphs run)
                                    prefill_graphs=None if settings.prefill_graphs else False)
        self.expected = {n: describe(t) for n, t in model.w.items()}  # what a weight push must contain
        self.lock = threading.Condition()  # an RLock inside: callbacks run on the loop thread, lock held
        self.turns = CountedLock(self.lock)  # threads waiting for it: the loop lets them in between two steps
        self._cancels: collections.deque = collections.deque()  # cancels to apply before the next step
        self.stopping = False
        self.accepting = True
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.metrics.weight_version.set(0)
        self.serving_arena = None  # the memory the serving weights live in (after the first push)
        self.retired: list[tuple[int, torch.Tensor]] = []  # (version, arena) of replaced weight sets
        self.push_idle_timeout = settings.push_idle_timeout  # a stalled push is abandoned after it (its lock freed)
        self.thread.start()

    @contextlib.contextmanager
    def locked(self):
        """The engine lock, taken in turn with the loop (see the module docstring)."""
        with self.turns.held():
            yield

    def check_admission(self, n: int) -> None:
        """Raise Overloaded / RuntimeError if a request of `n` sequences must be refused now. Safe without
        the lock (the numbers may then be a step old; submit repeats it under the lock), so an API can call it
        before handing the submit to a thread: a refusal then costs no thread and no wait."""
        if not self.accepting:
            raise RuntimeError("the service is shutting down")
        waiting = len(self.engine.waiting)
        if waiting + n > self.settings.max_waiting:
            raise Overloaded(f"{waiting} sequences are waiting (limit {self.settings.max_waiting}); retry later")

    @property
    def version(self) -> int:
        return self.engine.weight_version

    @property
    def context(self) -> int:
        return self.engine.max_seq_len

    # -- requests -------------------------------------------------------------------------------
    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Refuse what can never be served, with a message a client can act on (ValueError)."""
        s = self.settings
        params.validate()
        if params.max_tokens > s.max_tokens_limit:
            raise ValueError(f"max_tokens must be <= {s.max_tokens_limit}, got {params.max_tokens}")
        if params.n > min(s.max_n, s.max_waiting):
            raise ValueError(f"n must be <= {min(s.max_n, s.max_waiting)}, got {params.n}")
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.engine.model.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of the vocabulary [0, {vocab})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]  # could never be sampled: a mistake
        if bad:
            raise ValueError(f"stop token id {bad[0]} is out of the vocabulary [0, {vocab})")
        if len(prompt) + params.max_tokens > self.context:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"context of {self.context} tokens")

    def submit(self, prompt: list[int], params: SamplingParams, *, on_token=None, on_done=None, stop=()):
        """Queue a request; callbacks run on the engine thread. `stop`: text stop strings (need a tokenizer).
        Raises ValueError (bad request), Overloaded (queue full) or RuntimeError (shutting down)."""
        self.check(prompt, params)
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a model with a tokenizer; use stop_token_ids")
        arrival = time.perf_counter()
        m = self.metrics
        state = {"first": None, "last": {}, "text": {}}

        def token(i, tok, lp, finish):
            try:
                _token(i, tok, lp, finish)
            except Exception:  # a client's callback must never break the engine loop
                log.exception("token callback failed")

        def _token(i, tok, lp, finish):
            now = time.perf_counter()
            m.generated_tokens.inc()
            if state["first"] is None:
                state["first"] = now
                m.ttft.observe(now - arrival)
            if i in state["last"]:
                m.itl.observe(now - state["last"][i])
            state["last"][i] = now
            hit = False
            if stop and finish in (None, "length"):  # text stop strings: end the sequence once its text has one
                if i not in state["text"]:  # each sample's text, followed token by token
                    state["text"][i] = self.tokenizer.stream()
                text = state["text"][i]
                before = len(text.text)
                # (only a match that ends in the new text is new; on the last token it outranks "length")
                hit = text.push(tok) and any(s_ in text.text[max(0, before - len(s_) + 1):] for s_ in stop)
                finish = "stop" if hit else finish
            if on_token is not None:
                on_token(i, tok, lp, finish)
            if hit:  # after the token's callback: the end calls on_done, which closes a stream
                self.engine.finish(req, i, "stop")

        def done(r):
            m.e2e.observe(time.perf_counter() - arrival)
            if on_done is not None:
                try:
                    on_done(r)
                except Exception:
                    log.exception("completion callback failed")

        self.check_admission(params.n)  # a refusal does not wait for the lock
        with self.locked():
            self.check_admission(params.n)
            req = self.engine.submit(prompt, params, on_token=token, on_done=done)
            m.prompt_tokens.inc(len(prompt) * params.n)
            self._gauges()
            self.lock.notify_all()
        return req

    def prompt_logprobs(self, req) -> tuple[list[float], list]:
        """The request's prompt-token logprobs and top alternatives (the engine's `prompt_logprobs` and
        `prompt_alternatives`), between engine steps."""
        with self.locked():
            return self.engine.prompt_logprobs(req), self.engine.prompt_alternatives(req)

    def cancel(self, req) -> None:
        """Stop a request's unfinished sequences (finish "abort"; its slots free). Never waits for a step:
        while the loop is stepping, the cancel is queued and applied before the next step."""
        if self.lock.acquire(blocking=False):
            try:
                self.engine.cancel(req)
                self._gauges()
            finally:
                self.lock.release()
        else:
            self._cancels.append(req)
            if self.lock.acquire(blocking=False):  # the loop may have gone idle meanwhile: apply it now
                try:
                    self._apply_cancels()
                finally:
                    self.lock.release()

    def _apply_cancels(self) -> None:
        while self._cancels:
            self.engine.cancel(self._cancels.popleft())
        self._gauges()

    def abort_all(self) -> int:
        """Cut every request in flight (finish "abort"; their clients get what was generated). -> sequences cut."""
        with self.locked():
            live = [q for q in list(self.engine.waiting) + self.engine.running if not q.finish]
            for req in {id(q.request): q.request for q in live}.values():
                self.engine.cancel(req)
            self._gauges()
        return len(live)

    # -- weights ----------------------------------------------------------------------------------
    def take_arena(self, nbytes: int) -> torch.Tensor:
        """Memory for an incoming weight set: a retired version's arena once no request uses that version
        any more (its pages are already faulted in), else a new one."""
        with self.locked():
            in_flight = {q.request.version for q in list(self.engine.waiting) + self.engine.running}
            for i, (v, arena) in enumerate(self.retired):
                if v not in in_flight and arena.numel() >= nbytes:
                    del self.retired[i]
                    return arena
        return torch.empty(nbytes, dtype=torch.uint8)

    def give_back_arena(self, arena: torch.Tensor | None) -> None:
        """An arena whose push was refused: nothing references it."""
        if arena is not None:
            with self.locked():
                self.retired.append((-1, arena))

    def push_messages(self, request_iterator, context):
        """An UpdateWeights call's messages, abandoned (WeightError) after push_idle_timeout s without one."""
        return idle_guarded(request_iterator, context, self.push_idle_timeout)

    def update_weights(self, weights: dict, version: int, abort_in_flight: bool, arena=None) -> int:
        with self.locked():
            old_version = self.engine.weight_version
            aborted = self.engine.set_weights(weights, version, abort_in_flight=abort_in_flight)
            if self.serving_arena is not None:
                self.retired = self.retired[-1:] + [(old_version, self.serving_arena)]  # keep at most two
            self.serving_arena = arena
            self.metrics.weight_version.set(version)
            self._gauges()
        log.info("serving weight version %d (%d sequences aborted)", version, aborted)
        return aborted

    # -- the loop ---------------------------------------------------------------------------------
    def _gauges(self) -> None:
        e = self.engine
        self.metrics.running.set(len(e.running))
        self.metrics.waiting.set(len(e.waiting))
        self.metrics.kv_usage.set(1.0 - len(e.free) / self.settings.max_slots)  # (not the engine's scratch row)

    def _loop(self) -> None:
        with self.lock:
            while not self.stopping:
                if self._cancels:
                    self._apply_cancels()
                if not self.engine.busy:
                    self.lock.wait(timeout=1.0)
                    continue
                try:
                    self.engine.step()
                except Exception:  # a bug, not bad input (that is refused at submit): fail the work, keep serving
                    log.exception("engine step failed; aborting the requests in flight")
                    for q in list(self.engine.waiting) + list(self.engine.running):
                        self.engine.cancel(q.request)
                self._gauges()
                # let submitters and weight pushes in between steps: every thread already waiting goes first
                # (bounded: a stream of new arrivals cannot stall the engine)
                self.lock.release()
                try:
                    time.sleep(0)
                    deadline = time.monotonic() + 0.05
                    while self.turns.waiting and time.monotonic() < deadline:
                        time.sleep(0.0005)
                finally:
                    self.lock.acquire()

    def drain(self, timeout: float) -> bool:
        """Stop accepting; wait up to `timeout` s for the requests in flight to finish, then cut what is
        left (finish "abort", so every waiting client and handler gets its answer). True if drained."""
        with self.locked():
            self.accepting = False
            in_flight = len(self.engine.waiting) + len(self.engine.running)
        if in_flight:
            log.info("draining: %d sequences in flight (at most %.0f s)", in_flight, timeout)
        deadline = time.monotonic() + timeout
        while True:
            with self.locked():
                if not self.engine.busy:
                    return True
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        log.warning("drain timed out after %.0f s: %d sequences cut", timeout, self.abort_all())
        return False

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        self.thread.join(timeout=5)
