"""Selective recompute (``checkpoint_core_attention=True``: ``te.checkpoint`` over the
attention core only, as TE's GPT selective-recompute test runs it) gives the same
outputs and gradients as no recompute, bit for bit, with dropout in the attention and
around it, under a Float8BlockScaling autocast (enabled, with and without FP8
weights, or disabled, which is the case TE's test names
``[False-Float8BlockScaling-False-...]``: no FP8 at all). Block scaling keeps no
state to stash, so anything but bit equality is a recompute bug (an RNG not
replayed, a cast that depends on the path, a weight cache) or a nondeterministic
kernel; a control run repeated without recompute tells the two apart."""

import contextlib

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Float8BlockScaling
from transformer_engine.pytorch.attention import dot_product_attention
from helpers import DEVICES, assert_runs_equal, capture, te_modules

HIDDEN, HEADS, SEQ, BATCH = 128, 4, 32, 2
RECIPE = Float8BlockScaling()
CASES = [pytest.param(False, False, id="fp8_off"), pytest.param(True, False, id="fp8"),
         pytest.param(True, True, id="fp8_weights")]


@contextlib.contextmanager
def deterministic_kernels(device):
    """On CUDA, kernels that have a deterministic variant use it (an attention
    backward that accumulates with atomics would make even two runs without recompute
    differ), as a bit-for-bit comparison needs."""
    if device != "cuda":
        yield
        return
    was, warn_only = (torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def run(device, fp8, fp8_weights, selective, monkeypatch, steps=2):
    """``steps`` training steps of one TransformerLayer (bf16, dropout 0.1 in and
    around the attention, causal), selective recompute on or off; one record per step
    and the number of attention-core calls."""
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.manual_seed(0)
    with te.quantized_model_init(enabled=fp8_weights, recipe=RECIPE):
        layer = te.TransformerLayer(HIDDEN, 4 * HIDDEN, HEADS, hidden_dropout=0.1,
                                    attention_dropout=0.1, params_dtype=torch.bfloat16,
                                    fuse_qkv_params=True, device=device)
    calls = [0]
    real = dot_product_attention.DotProductAttention._attend

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(dot_product_attention.DotProductAttention, "_attend", counted)
    mask = torch.triu(torch.ones(SEQ, SEQ, device=device), diagonal=1).bool()
    params = [p for p in layer.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01)
    record = []
    for step in range(steps):
        g = torch.Generator().manual_seed(50 + step)
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(device, torch.bfloat16)
        x.requires_grad_()
        with te.autocast(enabled=fp8, recipe=RECIPE):
            y = layer(x, attention_mask=mask, checkpoint_core_attention=selective)
        y.sum().backward()
        step_record = capture(None, [x], params, te_modules(layer))
        record.append(step_record._replace(loss=y.detach().float().sum()))
        opt.step()
        opt.zero_grad()
    monkeypatch.undo()
    return record, calls[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8,fp8_weights", CASES)
def test_selective_recompute_matches_no_recompute(fp8, fp8_weights, device, monkeypatch):
    """Two steps, selective recompute against none: outputs (their sum, bit for bit),
    input and parameter gradients equal bit for bit; the attention core ran twice a
    step with recompute (so the recompute ran), once without; a second run without
    recompute equals the first (the kernels are deterministic)."""
    with deterministic_kernels(device):
        ref, ref_calls = run(device, fp8, fp8_weights, False, monkeypatch)
        again, _ = run(device, fp8, fp8_weights, False, monkeypatch)
        got, got_calls = run(device, fp8, fp8_weights, True, monkeypatch)
    assert ref_calls == 2 and got_calls == 4
    assert_runs_equal(ref, again, "control: no recompute twice (a nondeterministic kernel)")
    assert_runs_equal(ref, got, "selective recompute")
