"""Fixtures the serve tests share.

- `rollout`, `learner`, `channels`, `limits` (the refusal suites: test_grpc_refusals, test_rest_refusals,
  test_openapi_fuzz): a rollout with a token and a narrow queue, and a learner on it that does not train
  (steps=0). Module-scoped: each module that asks for them starts its own pair once. Modules that need other
  settings define their own fixtures (a module's fixture of the same name takes precedence over these).
- `bpe_model_dir`: a random-weight Qwen3 whose folder holds a transformers-saved byte-level BPE tokenizer with
  a Qwen3-style chat template and a generation_config.json with two eos ids (test_chat_template_rest,
  test_openai_client).
"""
import dataclasses
import json

import grpc
import pytest

from minite_core.model.random_init import random_checkpoint
from minite_core.rl.tiny import TINY
from tests.helpers_hf import make_bpe_tokenizer_dir, tokenizer_vocab_size, write_generation_config
from tests.service_helpers import MAX_WAITING, TOKEN, learner_service, rollout_service


@pytest.fixture(scope="module")
def bpe_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-bpe")
    make_bpe_tokenizer_dir(path)
    cfg = dataclasses.replace(TINY, vocab_size=tokenizer_vocab_size(path), max_position_embeddings=256)
    random_checkpoint(path, cfg, seed=5)
    write_generation_config(path)
    return path


@pytest.fixture(scope="module")
def limits(service_model):
    """The served model's limits, read from its config.json (not from the services)."""
    cfg = json.loads((service_model / "config.json").read_text())
    return {"context": cfg["max_position_embeddings"], "vocab": cfg["vocab_size"]}


@pytest.fixture(scope="module")
def rollout(service_model):
    with rollout_service(service_model, auth_token=TOKEN, max_waiting=MAX_WAITING, max_slots=4) as s:
        yield s


@pytest.fixture(scope="module")
def learner(service_model, rollout, tmp_path_factory):
    with learner_service(service_model, rollout[1], auth_token=TOKEN, steps=0,
                         run_dir=tmp_path_factory.mktemp("refusals-learner")) as s:
        yield s


@pytest.fixture(scope="module")
def channels(rollout, learner):
    ro, le = grpc.insecure_channel(rollout[1]), grpc.insecure_channel(learner[1])
    yield ro, le
    ro.close()
    le.close()
