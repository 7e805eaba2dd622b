"""Every TE module pickles, deep-copies and ``torch.save``s at any point, including
after an FP8 ``te.checkpoint`` forward under ``torch.no_grad`` (whose stash left the
module's scaling state shared with a copy-on-write snapshot), and the copy computes
exactly what the original does."""

import copy
import io
import pickle

import pytest
import torch

import transformer_engine.pytorch as te
from helpers import RECIPE, assert_states_equal, fp8_state_snapshot, te_modules

MODULES = {
    "Linear": (lambda: te.Linear(32, 32, device="cpu"), (16, 32)),
    "LayerNorm": (lambda: te.LayerNorm(32, device="cpu"), (16, 32)),
    "RMSNorm": (lambda: te.RMSNorm(32, device="cpu"), (16, 32)),
    "LayerNormLinear": (lambda: te.LayerNormLinear(32, 32, device="cpu"), (16, 32)),
    "LayerNormMLP": (lambda: te.LayerNormMLP(32, 64, device="cpu"), (16, 32)),
    "MultiheadAttention": (lambda: te.MultiheadAttention(32, 2, attention_dropout=0.0,
                                                         device="cpu"), (8, 2, 32)),
    "TransformerLayer": (lambda: te.TransformerLayer(32, 64, 2, hidden_dropout=0.0,
                                                     attention_dropout=0.0, device="cpu"),
                         (8, 2, 32)),
}

COPIES = {
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "deepcopy": copy.deepcopy,
    "torch.save": lambda m: _torch_roundtrip(m),
}


def _torch_roundtrip(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _forward(m, x):
    with torch.no_grad(), te.autocast(recipe=RECIPE):
        out = m(x)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("point", ["fresh", "after-training-step", "after-no-grad-checkpoint"])
@pytest.mark.parametrize("name", list(MODULES))
def test_copy_at_any_point(name, point, how):
    build, shape = MODULES[name]
    torch.manual_seed(0)
    m = build()
    x = torch.randn(*shape)
    if point == "after-training-step":
        with te.autocast(recipe=RECIPE):
            out = m(x.requires_grad_())
        (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()
    elif point == "after-no-grad-checkpoint":
        with torch.no_grad(), te.autocast(recipe=RECIPE):
            te.checkpoint(m, x, use_reentrant=False)
    clone = COPIES[how](m)
    x = x.detach()
    assert torch.equal(_forward(clone, x), _forward(m, x))
    originals, copies = te_modules(m), te_modules(clone)
    assert_states_equal(fp8_state_snapshot(originals), fp8_state_snapshot(copies), "the copy")
    for u, v in zip(originals, copies):         # the copy's state is its own
        for key in ("scaling_fwd", "scaling_bwd"):
            assert u.fp8_meta[key] is None or u.fp8_meta[key] is not v.fp8_meta[key], key


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP", "TransformerLayer"])
def test_copies_of_fp8_weight_modules_keep_fp8_weights_of_their_own(name, how):
    """A module with FP8 primary weights copies with its weights still FP8 (bits and
    scale_inv equal), and a write into the copy's weight quantizes with the copy's
    own scaling state, leaving the original's untouched."""
    from transformer_engine.pytorch.tensor import Float8Tensor
    build, shape = MODULES[name]
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=RECIPE):
        m = build()
    x = torch.randn(*shape)
    with te.autocast(recipe=RECIPE):
        out = m(x.requires_grad_())
    (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()
    clone = COPIES[how](m)
    x = x.detach()
    assert torch.equal(_forward(clone, x), _forward(m, x))
    pairs = [(p, q) for p, q in zip(m.parameters(), clone.parameters())
             if isinstance(p, Float8Tensor)]
    assert pairs and all(isinstance(q, Float8Tensor) and isinstance(q, torch.nn.Parameter)
                         for _, q in pairs)
    for p, q in pairs:
        assert torch.equal(p._data.view(torch.uint8), q._data.view(torch.uint8))
        assert torch.equal(p._scale_inv, q._scale_inv) and q._data is not p._data
    before = fp8_state_snapshot(te_modules(m))
    with torch.no_grad():
        for _, q in pairs:
            q.mul_(2.0)                     # writes record amaxes in the copy's state only
    assert_states_equal(before, fp8_state_snapshot(te_modules(m)), "the original")
    assert any(not torch.equal(a.fwd.amax_history, b.fwd.amax_history)
               for a, b in zip(before, fp8_state_snapshot(te_modules(clone))))
