"""The grouped MoE path (one grouped W4A4 GEMM per projection, device-side routing) gives the bits of the
per-expert loop, layer by layer and for whole forwards, and its stacked-weight cache follows the weights."""
import pytest
import torch
from tests.backends import DEVICE, HAS_TRITON
from tests.helpers_hf import save_hf_checkpoint

from minite_core.model import load_model
from minite_core.model import moe as moe_mod

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"), pytest.mark.interpreter,
              pytest.mark.gpu]
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_hf_checkpoint(tmp_path_factory.mktemp("moe"), moe=True)
    return load_model(path, precision="nvfp4", backend="triton", device=DEVICE)


def _x(model, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, model.cfg.hidden_size, generator=g).to(DEVICE, model.dtype)


def test_grouped_layer_equals_expert_loop(model):
    p = "model.layers.0.mlp."
    for n, seed in ((1, 0), (7, 1), (29, 2)):
        x = _x(model, n, seed)
        with torch.no_grad():
            assert moe_mod.usable(model, p)
            fast = model.moe(x, p)
        with torch.enable_grad():  # gradients wanted: the model takes the loop
            assert not moe_mod.usable(model, p)
            slow = model.moe(x, p)
        assert torch.equal(fast, slow.detach()), (n, (fast.float() - slow.float()).abs().max())


def test_grouped_forward_equals_loop_forward_and_is_batch_invariant(model):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.cfg.vocab_size, (3, 11), generator=g).to(DEVICE)
    with torch.no_grad():
        fast = model(ids)
        alone = model(ids[1:2])
    with torch.enable_grad():
        slow = model(ids).detach()
    assert torch.equal(fast, slow)
    assert torch.equal(alone, fast[1:2])


def test_stack_cache_follows_weight_changes(model):
    p = "model.layers.1.mlp."
    x = _x(model, 9, 4)
    with torch.no_grad():
        before = model.moe(x, p)
        old = model.w
        new = dict(old)  # a new version: expert 0 and 1 swap their weights
        for proj in moe_mod.PROJ:
            a, b = f"{p}experts.0.{proj}.weight", f"{p}experts.1.{proj}.weight"
            new[a], new[b] = old[b], old[a]
        model.w = new
        swapped = model.moe(x, p)
        with torch.enable_grad():
            loop = model.moe(x, p).detach()
        assert torch.equal(swapped, loop) and not torch.equal(swapped, before)
        # in place (what the CUDA-graph weights get): same tensors, new values, then restack
        model.w = old
        model.moe(x, p)
        saved = {n: (t.data.clone(), t.scale.clone(), t.global_scale.clone()) for n, t in old.items()
                 if n.startswith(p + "experts.0.")}
        for proj in moe_mod.PROJ:
            a, b = old[f"{p}experts.0.{proj}.weight"], old[f"{p}experts.1.{proj}.weight"]
            a.data.copy_(b.data), a.scale.copy_(b.scale), a.global_scale.copy_(b.global_scale)
        moe_mod.restack(model, old)
        inplace = model.moe(x, p)
        with torch.enable_grad():
            loop = model.moe(x, p).detach()
        assert torch.equal(inplace, loop)
        for n, (d, s, gs) in saved.items():
            old[n].data.copy_(d), old[n].scale.copy_(s), old[n].global_scale.copy_(gs)
        moe_mod.restack(model, old)
        assert torch.equal(model.moe(x, p), before)
