"""Qwen3 and Qwen3-MoE, built only from `minite_core.ops`.

The forward pass follows HF transformers' eager implementation op for op (RMSNorm in fp32 then cast,
q/k RMSNorm over head_dim before RoPE, NeoX rotate-half RoPE with fp32 frequencies, GQA, SwiGLU,
MoE softmax-top-k routing with optional renormalisation and experts combined in ascending expert
order), but every reduction is one of miniTE's fixed-order ops, so a token's logits do not depend on
its batch mates, and a decode step over a KV cache gives the bits of the full-sequence forward.

Per layer it runs the fused ops (`ops` docstring): add + RMSNorm (+ the NVFP4 quantize of its output when
the next linears are NVFP4), q/k/v in one `linears` call, `qk_norm_rope` (which also writes the KV cache),
attention (at a decode step also the o_proj input's quantize), o_proj, add + RMSNorm, gate/up in one call, SiLU*up (+ quantize), down_proj; the residual
add of a sublayer's output happens in the next norm's kernel. Both engines run this one function, so
they run the same kernels.

`Qwen3.forward(input_ids, positions, cache=None)` serves both engines:
- learner / prefill: positions [B, T], no cache: attention over the sequence itself;
- rollout decode: `cache` is a `KVCache` and `slots` name the cache rows of the batch; the new keys and
  values are written at `positions`, and attention runs over each slot's cache.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from .. import ops, reference
from . import moe as moe_grouped
from ..knobs import Knobs, library_linear, sdpa_attention
from ..nvfp4 import NVFP4Tensor
from ..reduce import tree_sum

ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


# config.json keys: (lowest, highest) allowed. The bounds are far beyond any Qwen3 (235B: 94 layers, 151,936
# tokens, 128 experts) and keep a typo such as num_hidden_layers = 1e9 from allocating before it is caught.
_INT_BOUNDS = {"vocab_size": (1, 1 << 24), "hidden_size": (1, 1 << 16), "intermediate_size": (1, 1 << 20),
               "num_hidden_layers": (1, 1024), "num_attention_heads": (1, 1024), "num_key_value_heads": (1, 1024),
               "head_dim": (1, 1024), "max_position_embeddings": (2, 1 << 24), "num_experts": (0, 4096),
               "num_local_experts": (0, 4096), "num_experts_per_tok": (0, 4096), "moe_intermediate_size": (0, 1 << 20),
               "decoder_sparse_step": (1, 1024)}


def _check_types(cfg: dict, rope: dict) -> None:
    """ValueError naming the config.json key whose value has the wrong type or lies outside its range."""
    for key, (lo, hi) in _INT_BOUNDS.items():
        v = cfg.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"config.json: {key} must be an integer, got {v!r}")
        if not lo <= v <= hi:
            raise ValueError(f"config.json: {key} = {v} is outside [{lo}, {hi}]")
    for key, v in (("rms_norm_eps", cfg.get("rms_norm_eps")), ("rope_theta", rope.get("rope_theta", cfg.get("rope_theta")))):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"config.json: {key} must be a finite positive number, got {v!r}")
    if cfg.get("rms_norm_eps") is not None and cfg["rms_norm_eps"] >= 1:
        raise ValueError(f"config.json: rms_norm_eps = {cfg['rms_norm_eps']} is not a small epsilon (< 1)")
    for key in ("tie_word_embeddings", "attention_bias", "norm_topk_prob"):
        if key in cfg and not isinstance(cfg[key], bool):
            raise ValueError(f"config.json: {key} must be true or false, got {cfg[key]!r}")


@dataclasses.dataclass
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # MoE (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen3Config":
        """From a HF config.json dict; raises ValueError for other architectures or unsupported options."""
        arch = (cfg.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES and cfg.get("model_type") not in ("qwen3", "qwen3_moe"):
            raise ValueError(f"unsupported architecture {arch!r} (model_type {cfg.get('model_type')!r}): expected one of {ARCHITECTURES}")
        moe = arch == "Qwen3MoeForCausalLM" or cfg.get("model_type") == "qwen3_moe"
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
            raise ValueError("only the default RoPE is supported (no rope scaling)")
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        _check_types(cfg, rope)
        try:
            heads = cfg["num_attention_heads"]
            out = cls(
                vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
                max_position_embeddings=cfg.get("max_position_embeddings", 32768),
                tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                attention_bias=cfg.get("attention_bias", False),
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks {e.args[0]!r}") from None
        if moe:
            out.num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
            out.num_experts_per_tok = cfg.get("num_experts_per_tok", 0)
            out.moe_intermediate_size = cfg.get("moe_intermediate_size", 0)
            out.norm_topk_prob = cfg.get("norm_topk_prob", False)
            out.decoder_sparse_step = cfg.get("decoder_sparse_step", 1)
            out.mlp_only_layers = tuple(cfg.get("mlp_only_layers") or ())
            if not (out.num_experts > 0 and 0 < out.num_experts_per_tok <= out.num_experts):
                raise ValueError(f"bad MoE config: {out.num_experts} experts, top-{out.num_experts_per_tok}")
        if out.num_attention_heads % out.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return out

    def to_hf(self) -> dict:
        """The config.json dict HF transformers writes for this model."""
        moe = self.num_experts > 0
        out = {
            "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if moe else "qwen3",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias, "hidden_act": "silu", "dtype": "bfloat16",
        }
        if moe:
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers))
        return out

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def expected_shapes(self) -> dict[str, tuple]:
        """Every tensor the model needs, by its HF name, with its shape (per-expert MoE layout)."""
        h, d = self.hidden_size, self.head_dim
        s = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            s["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            s.update({
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (self.num_attention_heads * d, h),
                p + "self_attn.k_proj.weight": (self.num_key_value_heads * d, h),
                p + "self_attn.v_proj.weight": (self.num_key_value_heads * d, h),
                p + "self_attn.o_proj.weight": (h, self.num_attention_heads * d),
                p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            })
            if self.attention_bias:
                for n, rows in (("q", self.num_attention_heads * d), ("k", self.num_key_value_heads * d),
                                ("v", self.num_key_value_heads * d), ("o", h)):
                    s[p + f"self_attn.{n}_proj.bias"] = (rows,)
            if self.is_moe_layer(i):
                m = self.moe_intermediate_size
                s[p + "mlp.gate.weight"] = (self.num_experts, h)
                for e in range(self.num_experts):
                    q = p + f"mlp.experts.{e}."
                    s.update({q + "gate_proj.weight": (m, h), q + "up_proj.weight": (m, h), q + "down_proj.weight": (h, m)})
            else:
                m = self.intermediate_size
                s.update({p + "mlp.gate_proj.weight": (m, h), p + "mlp.up_proj.weight": (m, h), p + "mlp.down_proj.weight": (h, m)})
        return s


_rotate_half = reference.rotate_half  # the torch backend's RoPE: reference.rope


class KVCache:
    """Slot KV cache: per layer, K and V buffers [slots, kv_heads, capacity, head_dim]."""

    def __init__(self, cfg: Qwen3Config, slots: int, capacity: int, dtype: torch.dtype, device):
        shape = (slots, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.slots, self.capacity = slots, capacity

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class Qwen3:
    """The model: a config, a dict of weights by HF name (plain tensors or NVFP4Tensors), a backend."""

    def __init__(self, cfg: Qwen3Config, weights: dict, *, dtype: torch.dtype, backend: str = "torch",
                 knobs: dict | None = None):
        self.cfg, self.w, self.dtype, self.backend = cfg, weights, dtype, backend
        self.knobs = Knobs.parse(knobs)  # all off: the aligned model
        self.cache_dtype = self.knobs.cache_dtype(dtype)
        self.masters: dict | None = None  # training: fp32 master weights that receive the gradients
        self.backward = "ste"  # the NVFP4 linears' backward (ops.linear)
        self.device = weights["model.embed_tokens.weight"].device
        self.input_observer = None  # fn(x, names) or None: set by `observing_inputs`
        d = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=self.device) / d))

    # -- building blocks ------------------------------------------------------------------------
    def param(self, name: str):
        """The weight `name` for the forward. While training (`self.masters` set), plain weights are the
        fp32 masters cast to the model dtype (the same values the rollout holds, with a gradient path)."""
        w = self.w.get(name)
        if self.masters is not None and name in self.masters and not isinstance(w, NVFP4Tensor):
            return self.masters[name].to(self.dtype)
        return w

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.linears(x, name)[0]

    @contextlib.contextmanager
    def using(self, weights: dict):
        """Within the block the model computes with `weights` (another version of its weights, same names and
        formats: a rollout request's, a CUDA graph's copy); its own again after it, whatever happens inside."""
        own, self.w = self.w, weights
        try:
            yield self
        finally:
            self.w = own

    @contextlib.contextmanager
    def observing_inputs(self, fn):
        """Within the block, `fn(x, names)` sees the input x of every linear the forward runs (q/k/v at once;
        an MoE expert the tokens routed to it, on the per-expert path). export.calibrate measures the
        activation ranges with it."""
        outer, self.input_observer = self.input_observer, fn
        try:
            yield self
        finally:
            self.input_observer = outer

    def linears(self, x: torch.Tensor, *names: str, xq: NVFP4Tensor | None = None) -> list[torch.Tensor]:
        """The projections `names` of one input (q/k/v, gate/up): one activation quantize and one GEMM
        launch for all of them (`ops.linears`), the bits of separate `ops.linear` calls. `xq`: x's NVFP4,
        made by the op that produced x (see `quantizes_input`)."""
        if self.input_observer is not None:
            self.input_observer(x, names)
        ws = [self.param(n + ".weight") for n in names]
        biases = [self.param(n + ".bias") for n in names]
        if self.knobs.matmul == "library":
            return [library_linear(x, w, b, out_dtype=self.dtype, scale_mode=self.knobs.act_scale) for w, b in zip(ws, biases)]
        masters = [self.masters.get(n + ".weight") if self.masters is not None and isinstance(w, NVFP4Tensor) else None
                   for n, w in zip(names, ws)]
        return ops.linears(x, ws, biases, out_dtype=self.dtype, backend=self.backend, scale_mode=self.knobs.act_scale,
                           check_finite=False, masters=masters, backward=self.backward, xq=xq)

    def quantizes_input(self, *names: str) -> bool:
        """Do the linears `names` quantize their input per row (NVFP4 weights, the aligned knobs)? Then the
        op that produces the input (RMSNorm, SiLU * up) quantizes it in the same kernel and hands it over:
        one launch and one pass over the activation less, the same bits."""
        return (bool(names) and self.knobs.matmul == "invariant" and self.knobs.act_scale == "row"
                and all(isinstance(self.w.get(n + ".weight"), NVFP4Tensor) for n in names))

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return ops.rms_norm(x, self.param(name + ".weight"), self.cfg.rms_norm_eps, backend=self.backend)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, name: str, *consumers: str):
        """The residual stream x plus the last sublayer's output `delta` (None: nothing to add), and the RMSNorm
        `name` of the sum for the linears `consumers` -> (x + delta, y, y's NVFP4 if they quantize it, else
        None): one kernel on the triton backend (`ops.add_rms_norm`, `ops.rms_norm`)."""
        w, quant = self.param(name + ".weight"), self.quantizes_input(*consumers)
        if delta is not None:
            return ops.add_rms_norm(x, delta, w, self.cfg.rms_norm_eps, backend=self.backend, quantize=quant)
        if quant:
            return (x, *ops.rms_norm(x, w, self.cfg.rms_norm_eps, backend=self.backend, quantize=True))
        return x, self.norm(x, name), None

    def rope(self, positions: torch.Tensor):
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def mlp(self, x: torch.Tensor, p: str, xq: NVFP4Tensor | None = None) -> torch.Tensor:
        gate, up = self.linears(x, p + "gate_proj", p + "up_proj", xq=xq)
        if self.quantizes_input(p + "down_proj"):
            h, h_q = ops.silu_mul(gate, up, backend=self.backend, quantize=True)
        else:
            h, h_q = ops.silu_mul(gate, up, backend=self.backend), None
        return self.linears(h, p + "down_proj", xq=h_q)[0]

    def moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """Top-k routing; each token sums its experts' outputs in ascending expert order (as HF's eager path)."""
        cfg = self.cfg
        flat = x.reshape(-1, x.shape[-1])
        router = self.linear(flat, p + "gate")
        probs = torch.exp(ops.log_softmax(router, backend=self.backend))
        top_v, top_i = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
        if cfg.norm_topk_prob:
            top_v = top_v / tree_sum(top_v).unsqueeze(-1)
        top_v = top_v.to(self.dtype)
        if moe_grouped.usable(self, p):  # inference on the Triton backend: one grouped GEMM per projection, same bits
            return moe_grouped.grouped_moe(self, flat, p, top_v, top_i).view_as(x)
        out = torch.zeros_like(flat)
        for e in range(cfg.num_experts):
            tok, slot = torch.where(top_i == e)
            if tok.numel() == 0:
                continue
            y = self.mlp(flat[tok], p + f"experts.{e}.")
            out.index_add_(0, tok, (y * top_v[tok, slot].unsqueeze(-1)).to(out.dtype))
        return out.view_as(x)

    # -- forward --------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None,
                slots: torch.Tensor | None = None, capture=None, *, logits_dtype: torch.dtype = torch.float32,
                check_ids: bool = True, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [B, T] (default 0..T-1) -> logits [B, T, V] (fp32 unless `logits_dtype`).
        `capture(name, tensor)` sees every op's output. `logits_dtype`: the logits' dtype (the lm_head
        computes them in the model dtype, so `logits_dtype=self.dtype` gives the same values without an
        fp32 copy). `check_ids=False` skips the token-id range check, which syncs with the host (a
        captured CUDA graph must not). `logits_at` [B]: only the logits at that position of each row,
        [B, 1, V] (a prefill needs the last prompt position's; the final norm and lm_head are row-local)."""
        cfg = self.cfg
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError("input_ids must be an integer tensor [B, T]")
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        if check_ids and t and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size):
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size})")
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        def emit(name, value):  # hand every op's output [B, T, features] to `capture`, if any
            if capture is not None:
                capture(name, value)
            return value

        x = emit("embed", torch.nn.functional.embedding(input_ids, self.param("model.embed_tokens.weight")).to(self.dtype))
        cos, sin = self.rope(positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if cache is None:
            kv_len = torch.full((b,), t, device=input_ids.device)
        else:
            kv_len = positions[:, -1] + 1
        # the attention kernel's int32 indices, converted once per forward instead of in every layer
        att_pos, att_len = positions.to(torch.int32), kv_len.to(torch.int32)
        att_rows = slots.to(torch.int32) if slots is not None else None
        delta = None  # the last sublayer's output, added to the residual stream x by the next norm's kernel
        for i in range(cfg.num_hidden_layers):
            p, n = f"model.layers.{i}.", f"layers.{i}."
            qkv = [p + f"self_attn.{z}_proj" for z in "qkv"]
            x, h, h_q = self.add_norm(x, delta, p + "input_layernorm", *qkv)  # h_q: h's NVFP4, or None
            q, k, v = self.linears(emit(n + "input_norm", h), *qkv, xq=h_q)
            q, k, v = emit(n + "q_proj", q), emit(n + "k_proj", k), emit(n + "v_proj", v)
            # q/k RMSNorm per head, RoPE, and (decode) the new keys/values written into the cache: one op
            into_cache = cache is not None and self.cache_dtype == self.dtype
            heads = ops.qk_norm_rope(q.view(b, t, hq, d), k.view(b, t, hkv, d), v.view(b, t, hkv, d),
                                     self.param(p + "self_attn.q_norm.weight"), self.param(p + "self_attn.k_norm.weight"),
                                     cfg.rms_norm_eps, cos, sin, backend=self.backend, norm_out=capture is not None,
                                     cache=(cache.k[i], cache.v[i], slots, positions) if into_cache else None)
            q, k, v = heads.q, heads.k, heads.v
            rows = slots.view(-1, 1).expand(b, t) if cache is not None else None
            if capture is not None:
                emit(n + "q_norm", heads.q_norm.flatten(2))
                emit(n + "k_norm", heads.k_norm.flatten(2))
                k_rot = k.transpose(1, 2) if k is not None else cache.k[i][rows, :, positions]
                emit(n + "rope", torch.cat([q.transpose(1, 2), k_rot], 2).flatten(2))
            if cache is not None and not into_cache:  # knob: the cache holds values rounded to another dtype
                k, v = k.to(self.cache_dtype).to(self.dtype), v.to(self.cache_dtype).to(self.dtype)
                cache.k[i][rows, :, positions] = k.transpose(1, 2)
                cache.v[i][rows, :, positions] = v.transpose(1, 2)
            a_q = None  # the o_proj input's NVFP4, when the attention op makes it
            if self.knobs.attention == "sdpa":
                if cache is not None:
                    k, v = cache.k[i][slots], cache.v[i][slots]
                a = sdpa_attention(q, k, v, positions, kv_len)
            elif cache is not None:  # attend over each sequence's cache row in place (no gather)
                # inference: a decode step's attention kernel also quantizes the o_proj input (one launch fewer)
                if not torch.is_grad_enabled() and self.quantizes_input(p + "self_attn.o_proj"):
                    a, a_q = ops.attention(q, cache.k[i], cache.v[i], att_pos, att_len, backend=self.backend,
                                           kv_rows=att_rows, out_dtype=self.dtype, quantize=True)
                else:
                    a = ops.attention(q, cache.k[i], cache.v[i], att_pos, att_len, backend=self.backend,
                                      kv_rows=att_rows, out_dtype=self.dtype)
            else:
                a = ops.attention(q, k, v, att_pos, att_len, backend=self.backend, out_dtype=self.dtype)
            a = emit(n + "attention", a.to(self.dtype).transpose(1, 2).reshape(b, t, hq * d))
            delta = emit(n + "o_proj", self.linears(a, p + "self_attn.o_proj", xq=a_q)[0])
            if cfg.is_moe_layer(i):
                x, h, _ = self.add_norm(x, delta, p + "post_attention_layernorm")
                delta = emit(n + "mlp", self.moe(emit(n + "post_norm", h), p + "mlp."))
            else:
                x, h, h_q = self.add_norm(x, delta, p + "post_attention_layernorm", p + "mlp.gate_proj", p + "mlp.up_proj")
                delta = emit(n + "mlp", self.mlp(emit(n + "post_norm", h), p + "mlp.", xq=h_q))
        if logits_at is not None:
            at = (torch.arange(b, device=x.device), logits_at)
            x, delta = x[at].unsqueeze(1), (delta[at].unsqueeze(1) if delta is not None else None)
        head = "model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"
        _, h, h_q = self.add_norm(x, delta, "model.norm", head)
        return emit("lm_head", self.linears(emit("final_norm", h), head, xq=h_q)[0].to(logits_dtype))

    __call__ = forward

    def logits(self, input_ids: torch.Tensor, *, logits_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Logits [B, T, V] of a [B, T] batch of full sequences (the same as model(input_ids)).
        `logits_dtype=self.dtype`: the same values without the fp32 copy (the log-softmax ops upcast)."""
        return self.forward(input_ids, logits_dtype=logits_dtype)

