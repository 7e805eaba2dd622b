"""A stack of te.TransformerLayers trained for several steps: per-layer checkpointing
with the FP8 autocast opened *inside* each checkpointed layer, and
``checkpoint_core_attention``, are bit-identical (torch.equal) to the same run
without checkpointing: losses, input and parameter gradients, and every module's
FP8 scaling state after every step. A run resumed from a state_dict continues
bit-identically to the uninterrupted run, FP8 scales included. And one layer, in each
of its variants, against a float64 reference written with plain torch ops.
"""

import io

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch import distributed
from helpers import (DEVICES, RECIPE, REENTRANT, assert_runs_equal, assert_states_equal, capture,
                     fp8_state_snapshot, te_modules)
from references import assert_close, layer_ref, norm_rel_err, randomize_, rel_err

SEQ, BATCH, HIDDEN, LAYERS = 16, 2, 64, 3


def build(seed=0, tracker=None, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(
        te.TransformerLayer(HIDDEN, 128, 4, num_gqa_groups=2, hidden_dropout=0.1,
                            attention_dropout=0.1, layer_number=i + 1, device=device,
                            get_rng_state_tracker=(lambda: tracker) if tracker else None)
        for i in range(LAYERS))


def layer_uses_fp8(precision, i):
    """"fp8": every layer; "mixed": first and last in high precision, as the main job."""
    return precision == "fp8" or (precision == "mixed" and 0 < i < LAYERS - 1)


def forward(model, x, precision, layer_ckpt, core_ckpt, tracker=None):
    """``layer_ckpt``: None (no per-layer checkpoint) or the use_reentrant flag."""
    h = x
    for i, layer in enumerate(model):
        fp8 = layer_uses_fp8(precision, i)

        def run(hidden, layer=layer, fp8=fp8):
            with te.autocast(enabled=fp8, recipe=RECIPE):       # inside the checkpoint
                return layer(hidden, checkpoint_core_attention=core_ckpt)

        if layer_ckpt is None:
            h = run(h)
        else:
            h = te.checkpoint(run, h, use_reentrant=layer_ckpt,
                              get_rng_state_tracker=(lambda: tracker) if tracker else None)
    return h


def step_input(step, device="cpu"):
    g = torch.Generator(device=device).manual_seed(100 + step)
    return (torch.randn(SEQ, BATCH, HIDDEN, generator=g, device=device)
            * 2.0 ** step).requires_grad_()


def train(model, opt, steps, precision="fp8", layer_ckpt=None, core_ckpt=False, tracker=None):
    record = []
    device = next(model.parameters()).device
    for step in steps:
        x = step_input(step, device)
        loss = forward(model, x, precision, layer_ckpt, core_ckpt, tracker).float().pow(2).mean()
        loss.backward()
        record.append(capture(loss, [x], model.parameters(), te_modules(model)))
        opt.step()
        opt.zero_grad()
    return record


def run(precision="fp8", layer_ckpt=None, core_ckpt=False, use_tracker=False, steps=3,
        device="cpu"):
    """A fresh model and Adam, trained ``steps`` steps; returns the record and how many
    times each layer's forward ran."""
    tracker = None
    if use_tracker:
        tracker = te.CudaRNGStatesTracker(device="cpu")
        tracker.add("model-parallel-rng", 4321)
    model = build(tracker=tracker, device=device)
    calls = [0] * LAYERS
    for i, layer in enumerate(model):
        layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    torch.manual_seed(11)                                    # the dropout streams
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return train(model, opt, range(steps), precision, layer_ckpt, core_ckpt, tracker), calls, model


def assert_scales_moved(record, model, precision):
    """Each FP8 layer's forward scales left 1 after step 0, so a recompute that used the
    live (updated) scales instead of the stashed ones would differ."""
    for i, layer in enumerate(model):
        for m in te_modules(layer):
            state = m.fp8_meta["scaling_fwd"]
            if layer_uses_fp8(precision, i):
                assert not torch.equal(state.scale, torch.ones_like(state.scale)), f"layer {i}"
            else:
                assert state is None, f"layer {i} ran in high precision but has FP8 state"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp8", "mixed"])
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_per_layer_checkpoint_is_bit_identical(use_reentrant, precision, device):
    ref, ref_calls, _ = run(precision, device=device)
    got, calls, model = run(precision, layer_ckpt=use_reentrant, device=device)
    assert ref_calls == [3] * LAYERS and calls == [6] * LAYERS     # every layer recomputed
    assert_runs_equal(ref, got)
    assert_scales_moved(got, model, precision)
    assert distributed.recompute_stash_count() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layer_ckpt", [None, True, False],
                         ids=["core-only", "core+reentrant-layer", "core+non-reentrant-layer"])
def test_checkpoint_core_attention_is_bit_identical(layer_ckpt, device):
    ref, _, _ = run("fp8", device=device)
    got, _, _ = run("fp8", layer_ckpt=layer_ckpt, core_ckpt=True, device=device)
    assert_runs_equal(ref, got)
    assert distributed.recompute_stash_count() == 0


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_attention_dropout_under_rng_tracker_is_bit_identical(use_reentrant):
    ref, _, _ = run("mixed", use_tracker=True)
    got, _, _ = run("mixed", layer_ckpt=use_reentrant, core_ckpt=True, use_tracker=True)
    assert_runs_equal(ref, got)


def test_dropout_is_live():
    """The equality above is not vacuous: dropout changes the loss, in training only."""
    model = build()
    x = step_input(0)
    losses = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        losses.append(forward(model, x, "fp8", None, False).pow(2).mean())
    assert not torch.equal(losses[0], losses[1])
    model.eval()
    with torch.no_grad():        # no amax recorded, so no delayed-scale update between the two
        assert torch.equal(forward(model, x, "fp8", None, False),
                           forward(model, x, "fp8", None, False))


# ---- one layer against float64 -------------------------------------------------------

LAYER_VARIANTS = {
    "pre-ln": {},
    "post-ln-residual": {"apply_residual_connection_post_layernorm": True},
    "output-layernorm": {"output_layernorm": True},
    "rmsnorm-swiglu-gqa": {"normalization": "RMSNorm", "activation": "swiglu", "num_gqa_groups": 2},
}


@pytest.mark.parametrize("variant", list(LAYER_VARIANTS))
def test_transformer_layer_matches_float64(variant):
    kw = LAYER_VARIANTS[variant]
    layer = te.TransformerLayer(64, 128, 4, device="cpu", **kw)
    randomize_(layer)
    layer.eval()
    x = torch.randn(16, 2, 64)
    ref = layer_ref(layer, x.double(), kw.get("apply_residual_connection_post_layernorm", False),
                    kw.get("output_layernorm", False), kw.get("normalization", "LayerNorm"),
                    kw.get("activation", "gelu"), kw.get("num_gqa_groups", 4))
    assert_close(layer(x), ref, 1e-5, "out")
    with te.autocast(recipe=DelayedScaling()):
        layer(x)                                          # calibrates the delayed scales
        y_fp8 = layer(x)
    assert norm_rel_err(y_fp8, ref) < 0.05
    layer.train()
    torch.manual_seed(3)
    assert rel_err(layer(x), ref) > 1e-2, "hidden/attention dropout had no effect in training"


def test_transformer_layer_bshd_matches_sbhd():
    torch.manual_seed(5)
    a = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, device="cpu")
    b = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, device="cpu",
                            attn_input_format="bshd")
    b.load_state_dict(a.state_dict())
    x = torch.randn(16, 2, 64)
    torch.testing.assert_close(b(x.transpose(0, 1)).transpose(0, 1), a(x), rtol=1e-5, atol=1e-5)


# ---- state_dict: FP8 state travels, resume is bit-identical -----------------------------

def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_resume_from_state_dict_is_bit_identical(use_reentrant):
    kw = dict(precision="mixed", layer_ckpt=use_reentrant)
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(11)
    train(model, opt, range(2), **kw)
    saved = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict(),
                        "rng": torch.get_rng_state()})
    uninterrupted = train(model, opt, range(2, 4), **kw)

    fresh = build(seed=99)                           # different weights, no FP8 state yet
    assert all(m.fp8_meta["scaling_fwd"] is None for m in te_modules(fresh))
    fresh.load_state_dict(saved["model"])
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    fresh_opt.load_state_dict(saved["opt"])
    torch.set_rng_state(saved["rng"])
    loaded = {name: m for name, m in fresh.named_modules()
              if isinstance(m, te.TransformerEngineBaseModule)}
    fp8_names = [n for n, m in loaded.items() if m.fp8_meta["scaling_fwd"] is not None]
    assert fp8_names and all(loaded[n].fp8_meta["recipe"] == RECIPE for n in fp8_names)
    assert all(not torch.equal(loaded[n].fp8_meta["scaling_fwd"].scale,
                               torch.ones_like(loaded[n].fp8_meta["scaling_fwd"].scale))
               for n in fp8_names)                   # the loaded scales are the trained ones
    resumed = train(fresh, fresh_opt, range(2, 4), **kw)
    assert_runs_equal(uninterrupted, resumed)


def test_state_dict_round_trip_restores_fp8_state():
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(11)
    train(model, opt, range(2))
    other = build(seed=5)
    other.load_state_dict(_roundtrip(model.state_dict()))
    assert_states_equal(fp8_state_snapshot(te_modules(model)), fp8_state_snapshot(te_modules(other)),
                        "after load_state_dict")
    keys = [k for k in model.state_dict() if k.endswith("_extra_state")]
    assert keys == [f"{i}.{sub}._extra_state" for i in range(LAYERS) for sub in
                    ("self_attention.layernorm_qkv", "self_attention.core_attention",
                     "self_attention.proj", "layernorm_mlp")]
