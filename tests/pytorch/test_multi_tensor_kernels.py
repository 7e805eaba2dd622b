"""The Triton multi-tensor kernels (kernels/multi_tensor.py) against the torch ops of
optimizers/multi_tensor.py: the same bits for scale, Adam (every variant) and SGD, the
L2 norm within 1e-5 relative (NOTE [Multi-tensor paths]). On a GPU the kernels run on
CUDA tensors and the torch ops on CPU copies; without one they run under the Triton
interpreter (``TRITON_INTERPRET=1`` set before Triton is imported;
test_multi_tensor_ops.py runs this file so)."""

import os

import pytest
import torch

from transformer_engine.pytorch.kernel_config import kernel_config
from transformer_engine.pytorch.optimizers import multi_tensor as mt
from transformer_engine.pytorch.optimizers.multi_tensor_apply import MultiTensorApply

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = ("cuda" if torch.cuda.is_available() and HAS_TRITON and not INTERPRET
          else "cpu" if HAS_TRITON and INTERPRET else None)
pytestmark = pytest.mark.skipif(
    DEVICE is None, reason="needs a CUDA GPU and Triton, or Triton's interpreter "
                           "(TRITON_INTERPRET=1) on the CPU")

APPLY = MultiTensorApply(2048)      # small chunks: several per tensor, tails included
SIZES = (5000, 17, 1)
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def both(build):
    """``build(device)`` run through the kernels and through the torch ops (same seed);
    each returns a list of tensors, compared on the CPU."""
    results = []
    for fused in (True, False):
        torch.manual_seed(0)
        device = DEVICE if fused else "cpu"
        with kernel_config(interpret=fused and DEVICE == "cpu"):
            results.append([t.cpu() for t in build(device)])
    return results


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """The bit patterns, every NaN as one (its payload is not part of the result)."""
    if t.is_floating_point() and t.element_size() > 1:
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view(_INT_OF_SIZE[t.element_size()])


def assert_same_bits(fused, ref):
    assert len(fused) == len(ref)
    for a, b in zip(fused, ref):
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), (a, b)


def randn(dtypes, device):
    return [torch.randn(s, dtype=d).to(device) for d in dtypes for s in SIZES]


def split_masters(device):
    """bfloat16 params and int16 remainders that together hold float32 masters drawn
    from the normal distribution (TE's layout: the high half rounded half away from
    zero, so a negative low half means the high half went up). Random remainders
    beside unrelated params would make masters that are NaN, whose payload the GPU
    does not keep."""
    params, rems = [], []
    for size in SIZES:
        bits = torch.randn(size).view(torch.int32)
        lo = (bits & 0xFFFF).to(torch.int16)
        hi = (bits >> 16) + (lo < 0).to(torch.int32)
        params.append(hi.to(torch.int16).view(BF16).to(device))
        rems.append(lo.to(device))
    return params, rems


def randn_like(t):
    """Normal values like ``t``, drawn on the CPU (the CUDA generator draws other
    numbers for the same seed) and moved to ``t``'s device."""
    return torch.randn(t.shape, dtype=t.dtype).to(t.device)


@pytest.mark.parametrize("by_tensor", [False, True], ids=["float", "tensor"])
@pytest.mark.parametrize("src, dst", [(F32, F32), (BF16, F32), (F32, F16), (F16, BF16)])
def test_scale_matches_torch(src, dst, by_tensor):
    def build(device):
        x = randn([src, F32], device)
        x[1][3] = float("nan")
        y = [torch.empty(t.shape, dtype=dst, device=device) for t in x]
        noop = torch.zeros(1, dtype=torch.int32, device=device)
        if by_tensor:
            APPLY(mt.multi_tensor_scale_tensor, noop, [x, y], torch.tensor([0.37], device=device))
        else:
            APPLY(mt.multi_tensor_scale, noop, [x, y], 0.37)
        return y + [noop]
    fused, ref = both(build)
    assert_same_bits(fused, ref)
    assert fused[-1].item() == 1


@pytest.mark.parametrize("unscale", [False, True])
def test_l2norm_matches_torch(unscale):
    def build(device):
        x = randn([F32, BF16, F16], device)
        noop = torch.zeros(1, dtype=torch.int32, device=device)
        if unscale:
            norm, per = APPLY(mt.multi_tensor_unscale_l2norm, noop, [x],
                              torch.tensor([0.5], device=device), True)
        else:
            norm, per = APPLY(mt.multi_tensor_l2norm, noop, [x], True)
        return [norm, per, noop]
    fused, ref = both(build)
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(fused[1], ref[1], rtol=1e-5, atol=0)
    assert fused[2].item() == ref[2].item() == 0


@pytest.mark.parametrize("variant", ["plain", "master", "remainder", "capturable",
                                     "capturable-master", "bf16-states"])
@pytest.mark.parametrize("adamw", [0, 1], ids=["l2", "adamw"])
def test_adam_matches_torch(variant, adamw):
    def build(device):
        low = variant in ("master", "remainder", "capturable-master")
        if variant == "remainder":
            p, rems = split_masters(device)
        else:
            p = randn([BF16 if low else F32], device)
        g = [randn_like(t) for t in p]
        state = BF16 if variant == "bf16-states" else F32
        m = [torch.randn(t.shape, dtype=state).to(device) for t in p]
        v = [torch.rand(t.shape, dtype=state).to(device) for t in p]
        lists = [g, p, m, v]
        if variant in ("master", "capturable-master"):
            lists.append([t.float() + 1e-3 for t in p])
        if variant == "remainder":
            lists.append(rems)
        noop = torch.zeros(1, dtype=torch.int32, device=device)
        for step in (1, 2, 7):
            if variant.startswith("capturable"):
                op = mt.multi_tensor_adam_capturable_master if len(lists) == 5 \
                    else mt.multi_tensor_adam_capturable
                APPLY(op, noop, lists, torch.tensor(1e-2, device=device), 0.9, 0.999, 1e-8,
                      torch.tensor([step], dtype=torch.int32, device=device), adamw, 1, 0.1,
                      torch.tensor([0.5], device=device))
            else:
                op = mt.multi_tensor_adam_param_remainder if variant == "remainder" \
                    else mt.multi_tensor_adam
                APPLY(op, noop, lists, 1e-2, 0.9, 0.999, 1e-8, step, adamw, 1, 0.1)
        return [t for lst in lists for t in lst]
    assert_same_bits(*both(build))


@pytest.mark.parametrize("nesterov, first_run, wd_after, copy", [
    (False, True, False, False), (True, False, True, False), (False, False, False, True)])
def test_sgd_matches_torch(nesterov, first_run, wd_after, copy):
    def build(device):
        p = randn([F32] if copy else [F32, F16], device)
        g = [randn_like(t) for t in p]
        m = [randn_like(t) for t in p]
        lists = [g, p, m] + ([[t.half() for t in p]] if copy else [])
        noop = torch.zeros(1, dtype=torch.int32, device=device)
        APPLY(mt.multi_tensor_sgd, noop, lists, 0.01, 0.9, 0.0 if nesterov else 0.1, 0.1,
              nesterov, first_run, wd_after, 0.5)
        return [t for lst in lists for t in lst]
    assert_same_bits(*both(build))
