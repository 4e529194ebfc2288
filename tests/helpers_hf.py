"""An offline HF tokenizer folder like Qwen3's, for tests: a byte-level BPE trained with the `tokenizers`
library on synthetic sentences, Qwen3's special tokens, and a Qwen3-style chat template (system prompt,
several turns, reasoning kept only after the last user turn, the `enable_thinking` switch), saved by
transformers itself (`PreTrainedTokenizerFast.save_pretrained`), so the files are the ones a user has.

    make_bpe_tokenizer_dir(path)                    # chat_template.jinja (what transformers 5 writes)
    make_bpe_tokenizer_dir(path, jinja_file=False)  # the template inside tokenizer_config.json
    write_generation_config(path)                   # eos_token_id [<|im_end|>, <|endoftext|>] as Qwen3's

A random-weight Qwen3 for this tokenizer: `vocab_size=tokenizer_vocab_size(path)`. A tiny random Qwen3 or
Qwen3-MoE saved by transformers itself: `save_hf_checkpoint(path, moe=...)`.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # special: skipped when decoding
THINK = ["<think>", "</think>"]  # added but not special (as in Qwen3)

# Qwen3's template, tool-free and written again: the system prompt first (else raise_exception), the
# assistant's reasoning (`reasoning_content` or a <think> block in its content) shown only after the last
# user turn, and with the generation prompt an empty think block when enable_thinking is false. It also
# uses the special-token variables (eos_token), `tojson`, `namespace`, and `strftime_now`.
QWEN3_STYLE_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content }}
    {%- if metadata is defined %}
        {{- '\\nmetadata: ' + metadata | tojson }}
    {%- endif %}
    {%- if show_date is defined and show_date %}
        {{- '\\ntoday: ' + strftime_now('%Y-%m-%d') }}
    {%- endif %}
    {{- eos_token + '\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if not ns.found and message.role == 'user' %}
        {%- set ns.found = true %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' and not loop.first %}
        {{- raise_exception('the system message must come first') }}
    {%- endif %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- eos_token + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

_WORDS = ("the cat dog sum of two numbers is what answer think carefully step first then add carry digit result "
          "please compute solve reason final box equals plus minus times hello world model reward train policy "
          "été naïve über 数学 答案 🙂").split()


def sentences(n: int = 400, seed: int = 0) -> list[str]:
    """Synthetic training text: words, numbers, arithmetic, punctuation and a little unicode."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        out.append(f"{' '.join(words).capitalize()}: {a}+{b}={a + b}{rng.choice('.?!')}\n")
    return out


def build_bpe_tokenizer(vocab_size: int = 600):
    """A byte-level BPE (Qwen's pre-tokenizer family) trained here; the special tokens come first."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sentences(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    return tok


def make_bpe_tokenizer_dir(path, *, jinja_file: bool = True, chat_template: str | None = QWEN3_STYLE_TEMPLATE) -> Path:
    """Write the tokenizer files into `path` (created; other files there are kept) through transformers'
    `save_pretrained`: the template in chat_template.jinja (`jinja_file`, transformers 5's default) or in
    tokenizer_config.json. eos_token "<|im_end|>", pad_token "<|endoftext|>", no bos, as Qwen3."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kw = {"chat_template": chat_template} if chat_template is not None else {}
    hf = PreTrainedTokenizerFast(tokenizer_object=build_bpe_tokenizer(), eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", **kw)
    hf.save_pretrained(str(path), save_jinja_files=jinja_file)
    return path


def tokenizer_vocab_size(path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json")).get_vocab_size()


def write_generation_config(path, eos=("<|im_end|>", "<|endoftext|>")) -> list[int]:
    """generation_config.json with eos_token_id as a list (Qwen3's form) -> those ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    ids = [tok.token_to_id(t) for t in eos]
    (Path(path) / "generation_config.json").write_text(json.dumps({"eos_token_id": ids, "pad_token_id": ids[-1]}))
    return ids


HF_TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


def save_hf_checkpoint(path, *, moe: bool = False, random_norms: bool = False, **overrides):
    """A tiny random Qwen3 / Qwen3-MoE saved by HF transformers itself (the peer's own layout and config)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = dict(HF_TINY, **overrides)
    if moe:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **cfg, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
    if random_norms:  # norms start at 1: random ones make parity tests mean more
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path
