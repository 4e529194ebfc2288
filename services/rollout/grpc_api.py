"""minite.v1.RolloutService over gRPC: Generate, GenerateStream, UpdateWeights, UpdateWeightsShared,
GetWeightVersion.

Bad input -> INVALID_ARGUMENT, a full queue -> RESOURCE_EXHAUSTED, a stale or unsound weight push ->
FAILED_PRECONDITION / INVALID_ARGUMENT (the serving weights stay as they were), a missing token ->
UNAUTHENTICATED (rpc.TokenInterceptor). UpdateWeightsShared (a learner on the same host:
services/common/shared_weights.py) answers like UpdateWeights, plus FAILED_PRECONDITION "shared weight
sync unavailable: ..." when it cannot open the learner's arena (the learner then streams). Deadlines: a request whose deadline passes is cancelled in the
engine (its KV-cache slot freed) and ends DEADLINE_EXCEEDED; so does a client that goes away.

Bounds (rest.InputBounds, as REST): a `text` longer than could fit the context (in characters), `prompt_ids`
longer than the context and more than --max-stop-token-ids `stop_token_ids` are refused (INVALID_ARGUMENT)
before any work; the message size is bounded by --max-message-mb.

Prompts and stopping: a `text` prompt is encoded by the model's tokenizer (`minite_core.tokenizer`, with its
special tokens, as REST's /v1/completions); generation stops only on the request's `stop_token_ids` (the
learner sends the model's eos ids itself; unlike REST, which adds them unless `ignore_eos`).
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from minite.v1 import rollout_pb2 as pb
from minite.v1 import rollout_pb2_grpc as pb_grpc
from minite_core.engine import SamplingParams

from ..common.shared_weights import UNAVAILABLE, SharedUnavailable, receive_shared
from ..common.weights import StalePush, WeightAssembler, WeightError
from .rest import InputBounds
from .runtime import Overloaded, RolloutRuntime

log = logging.getLogger("minite.rollout")
PROTECTED = {"/minite.v1.RolloutService/UpdateWeights", "/minite.v1.RolloutService/UpdateWeightsShared"}
_DONE = object()
NO_DEADLINE = 86400.0  # grpc reports a huge time_remaining() when the client set no deadline


def _remaining(context) -> float | None:
    r = context.time_remaining()
    return None if r is None or r > NO_DEADLINE else r


def sampling_params(p: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=p.max_tokens or 16,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k, seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids), n=p.n or 1, logprobs=p.top_logprobs)


def top_logprobs(alternatives) -> pb.TopLogprobs:
    """[(token id, logprob), ...] of one position (the engine's `top`, most likely first) as the message."""
    return pb.TopLogprobs(token_ids=[t for t, _ in alternatives], logprobs=[lp for _, lp in alternatives])


MODES = set(pb.UpdateMode.values())


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    def __init__(self, runtime: RolloutRuntime):
        self.rt = runtime
        self.update_lock = threading.Lock()  # one weight push at a time
        self.bounds = InputBounds(runtime.settings, runtime.tokenizer, runtime.context)

    def _prompt(self, request, context) -> list[int]:
        if request.model and request.model != self.rt.settings.model_name:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model!r}; this service serves "
                          f"{self.rt.settings.model_name!r}")
        which = request.WhichOneof("prompt")
        try:  # sizes first: nothing is copied or tokenized before they are known to be bounded
            self.bounds.stops(len(request.params.stop_token_ids))
            if which == "prompt_ids":
                self.bounds.prompt_ids(len(request.prompt_ids.ids))
            elif which == "text":
                self.bounds.text(len(request.text))
        except ValueError as e:
            self.rt.metrics.requests.labels("grpc", "error").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if which == "prompt_ids":
            return list(request.prompt_ids.ids)
        if which == "text":
            if self.rt.tokenizer is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "this model has no tokenizer: send prompt_ids")
            try:
                return self.rt.tokenizer.encode(request.text, add_special_tokens=True)
            except Exception as e:  # the tokenizer refuses what it cannot read (e.g. lone surrogates)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot tokenize the prompt text: {e}")
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request has no prompt: set prompt_ids or text")

    def _submit(self, request, context, on_token=None, on_done=None):
        prompt = self._prompt(request, context)
        try:
            params = sampling_params(request.params)
            req = self.rt.submit(prompt, params, on_token=on_token, on_done=on_done)
        except ValueError as e:
            self.rt.metrics.requests.labels("grpc", "error").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            self.rt.metrics.requests.labels("grpc", "error").inc()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except RuntimeError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        context.add_callback(lambda: self.rt.cancel(req))  # the client went away or the deadline passed
        return req

    def _text(self, ids) -> str:
        return self.rt.tokenizer.decode(list(ids)) if self.rt.tokenizer is not None else ""

    def Generate(self, request, context):
        finished = threading.Event()
        req = self._submit(request, context, on_done=lambda r: finished.set())
        if not finished.wait(timeout=_remaining(context)):
            self.rt.cancel(req)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before the completion finished")
        self.rt.metrics.requests.labels("grpc", "ok").inc()
        choices = [pb.Choice(index=c.sample_index, token_ids=c.token_ids, logprobs=c.logprobs.tolist(),
                             finish_reason=c.finish_reason, weight_version=c.weight_version,
                             text=self._text(c.token_ids), top_logprobs=[top_logprobs(a) for a in c.top_logprobs or ()])
                   for c in req.completions()]
        return pb.GenerateResponse(prompt_ids=req.prompt, choices=choices, weight_version=req.version,
                                   model=self.rt.settings.model_name)

    def GenerateStream(self, request, context):
        events: queue.Queue = queue.Queue()
        req = self._submit(request, context, on_token=lambda *a: events.put(a), on_done=lambda r: events.put(_DONE))
        remaining = _remaining(context)
        deadline = None if remaining is None else time.monotonic() + remaining
        ended: set[int] = set()
        sent = [0] * len(req.seqs)  # tokens streamed per sample: the index of its next alternatives
        while True:
            try:
                ev = events.get(timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                self.rt.cancel(req)
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded while streaming")
            if ev is _DONE:
                break
            i, tok, lp, finish = ev
            if finish:
                ended.add(i)
            # (the engine appends a token's alternatives before it reports the token)
            top = top_logprobs(req.seqs[i].top[sent[i]]) if req.params.logprobs else None
            sent[i] += 1
            yield pb.GenerateStreamResponse(index=i, token_id=tok, logprob=lp, finish_reason=finish or "",
                                            weight_version=req.version, text=self._text([tok]), top_logprobs=top)
        for q in req.seqs:  # samples that ended without a token of their own (aborted): say so, token unset
            if q.sample_index not in ended:
                yield pb.GenerateStreamResponse(index=q.sample_index, finish_reason=q.finish or "abort",
                                                weight_version=req.version)
        self.rt.metrics.requests.labels("grpc", "ok").inc()

    def UpdateWeights(self, request_iterator, context):
        t0 = time.perf_counter()
        with self.update_lock:
            on_cpu = self.rt.engine.model.device.type == "cpu"  # (on a GPU the arena is only a staging buffer)
            asm = WeightAssembler(self.rt.expected, self.rt.version, arena_pool=self.rt.take_arena if on_cpu else None)
            try:
                for msg in self.rt.push_messages(request_iterator, context):
                    if msg.WhichOneof("kind") == "begin" and msg.begin.mode not in MODES:
                        raise WeightError(f"unknown update mode {msg.begin.mode} (modes: {sorted(MODES)})")
                    asm.feed(msg)
                version, abort, weights = asm.result()
            except WeightError as e:
                self.rt.give_back_arena(getattr(asm, "arena", None) if on_cpu else None)
                self._refuse(context, e)
            # tensors for the model's device, then the swap (between two engine steps)
            device = self.rt.engine.model.device
            weights = {n: t.to(device) for n, t in weights.items()}
            return self._apply(context, t0, weights, version, abort, asm.arena if on_cpu else None, asm.bytes)

    def UpdateWeightsShared(self, request, context):
        t0 = time.perf_counter()
        with self.update_lock:
            device = self.rt.engine.model.device
            try:
                version, abort, weights, nbytes, arena = receive_shared(
                    request, self.rt.expected, self.rt.version, device=device,
                    arena_pool=self.rt.take_arena, give_back=self.rt.give_back_arena)
            except WeightError as e:
                self._refuse(context, e)
            except SharedUnavailable as e:
                log.info("%s: %s", UNAVAILABLE, e)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{UNAVAILABLE}: {e}")
            return self._apply(context, t0, weights, version, abort, arena, nbytes)

    def _refuse(self, context, e: WeightError):
        self.rt.metrics.sync_rejected.inc()
        log.warning("weight push refused: %s", e)
        code = grpc.StatusCode.FAILED_PRECONDITION if isinstance(e, StalePush) else grpc.StatusCode.INVALID_ARGUMENT
        context.abort(code, f"weight push refused, still serving version {self.rt.version}: {e}")

    def _apply(self, context, t0, weights, version, abort, arena, nbytes) -> pb.UpdateWeightsResponse:
        """The swap (between two engine steps) of a checked weight set, and the answer."""
        m = self.rt.metrics
        try:
            aborted = self.rt.update_weights(weights, version, abort, arena)
        except ValueError as e:  # a concurrent newer push won
            self.rt.give_back_arena(arena)
            m.sync_rejected.inc()
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        seconds = time.perf_counter() - t0
        m.sync_seconds.observe(seconds)
        m.sync_bytes.inc(nbytes)
        return pb.UpdateWeightsResponse(version=version, bytes=nbytes, tensors=len(weights), seconds=seconds,
                                        aborted_sequences=aborted)

    def GetWeightVersion(self, request, context):
        return pb.WeightVersion(version=self.rt.version)
