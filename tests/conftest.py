"""Fixtures every test folder shares. Importing tests.backends first sets TRITON_INTERPRET=1 on a machine
without a GPU, before any Triton kernel is defined."""
import pytest

from tests.backends import DEVICE


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(scope="session")
def service_model(tmp_path_factory):
    """The built-in tiny architecture with random weights and the task's tokenizer: what the service
    tests serve (the mechanics do not need the warmed-up model; the RL tests build that one)."""
    from minite_core.model.random_init import random_checkpoint
    from minite_core.rl.tiny import TINY, write_tokenizer

    path = random_checkpoint(tmp_path_factory.mktemp("service-model"), TINY, seed=3)
    write_tokenizer(path)
    return path
