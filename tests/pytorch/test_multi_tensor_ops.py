"""The multi-tensor operations of te.optimizers against float64 reference math, TE's
calling convention through `multi_tensor_applier` (empty tensors left out, the noop
flag set on a non-finite value), and the Triton kernels against the torch ops under the
Triton interpreter (test_multi_tensor_kernels.py, run in a child process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformer_engine.pytorch import optimizers as opt
from transformer_engine.pytorch.optimizers import MultiTensorApply, multi_tensor_applier

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def tensors(dtype=F32, sizes=(300, 7, 1)):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(s, generator=gen).to(dtype) for s in sizes]


def flag():
    return torch.zeros(1, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_l2norm_is_the_norm_of_all_tensors(dtype):
    xs = tensors(dtype)
    noop = flag()
    norm, per = multi_tensor_applier(opt.multi_tensor_l2norm, noop, [xs], True)
    ref = [t.double().norm() for t in xs]
    assert norm.dtype == per.dtype == F32 and norm.shape == (1,)
    torch.testing.assert_close(norm.double(), torch.stack(ref).norm().reshape(1), rtol=1e-6, atol=0)
    torch.testing.assert_close(per.double(), torch.stack(ref), rtol=1e-6, atol=0)
    assert noop.item() == 0
    _, none = multi_tensor_applier(opt.multi_tensor_l2norm, noop, [xs], False)
    assert none.numel() == 0
    norm2, _ = multi_tensor_applier(opt.multi_tensor_unscale_l2norm, noop, [xs],
                                    torch.tensor([0.25]), False)
    torch.testing.assert_close(norm2, norm * 0.25, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("op", ["l2norm", "scale", "scale_tensor"])
def test_noop_flag_is_set_on_a_non_finite_value(op, bad):
    xs = tensors()
    noop = flag()
    call = {"l2norm": lambda: multi_tensor_applier(opt.multi_tensor_l2norm, noop, [xs], False),
            "scale": lambda: multi_tensor_applier(opt.multi_tensor_scale, noop, [xs, xs], 0.5),
            "scale_tensor": lambda: multi_tensor_applier(opt.multi_tensor_scale_tensor, noop,
                                                         [xs, xs], torch.tensor([0.5]))}[op]
    call()
    assert noop.item() == 0
    xs[1][2] = bad
    call()
    assert noop.item() == 1


@pytest.mark.parametrize("src, dst", [(F32, F32), (F32, BF16), (BF16, F32), (F16, F16)])
def test_scale_writes_in_times_scale_rounded(src, dst):
    xs = tensors(src)
    ys = [torch.empty(t.shape, dtype=dst) for t in xs]
    multi_tensor_applier(opt.multi_tensor_scale, flag(), [xs, ys], 0.3)
    for x, y in zip(xs, ys):
        assert torch.equal(y, (x.float() * torch.tensor(0.3, dtype=F32)).to(dst))
    clip = torch.tensor([0.5])
    multi_tensor_applier(opt.multi_tensor_scale_tensor, flag(), [ys, ys], clip)
    for x, y in zip(xs, ys):
        assert torch.equal(y, ((x.float() * torch.tensor(0.3, dtype=F32)).to(dst).float() * 0.5
                               ).to(dst))


def adam_reference(p, g, m, v, step, lr, b1, b2, eps, wd, adamw, bias_correction):
    """Adam in float64, the textbook order."""
    if not adamw:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1 = 1 - b1 ** step if bias_correction else 1.0
    bc2 = 1 - b2 ** step if bias_correction else 1.0
    update = (m / bc1) / ((v / bc2).sqrt() + eps)
    if adamw:
        update = update + wd * p
    return p - lr * update, m, v


@pytest.mark.parametrize("bias_correction", [1, 0])
@pytest.mark.parametrize("adamw", [1, 0])
def test_adam_op_matches_float64_reference(adamw, bias_correction):
    p, g, m = (tensors(torch.float64, (50, 3)) for _ in range(3))
    v = [t.abs() for t in tensors(torch.float64, (50, 3))]
    want = [adam_reference(*args, 4, 1e-2, 0.9, 0.99, 1e-8, 0.1, adamw, bias_correction)
            for args in zip(p, g, m, v)]
    multi_tensor_applier(opt.multi_tensor_adam, flag(), [g, p, m, v], 1e-2, 0.9, 0.99, 1e-8,
                         4, adamw, bias_correction, 0.1)
    for (wp, wm, wv), gp, gm, gv in zip(want, p, m, v):
        torch.testing.assert_close(gp, wp, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(gm, wm, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(gv, wv, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("nesterov, first_run, wd_after", [
    (False, True, False), (False, False, False), (True, False, False), (False, False, True)])
def test_sgd_op_matches_float64_reference(nesterov, first_run, wd_after):
    p, g, m = (tensors(torch.float64, (40, 2)) for _ in range(3))
    wd, mom, damp, lr, scale = 0.01, 0.9, 0.0 if nesterov else 0.2, 0.1, 0.5
    want = []
    for pi, gi, mi in zip(p, g, m):
        d = gi * scale
        if not wd_after:
            d = d + wd * pi
        mi = d if first_run else mom * mi + (1 - damp) * d
        d = d + mom * mi if nesterov else mi
        if wd_after:
            d = d + wd * pi
        want.append((pi - lr * d, mi))
    multi_tensor_applier(opt.multi_tensor_sgd, flag(), [g, p, m], wd, mom, damp, lr, nesterov,
                         first_run, wd_after, scale)
    for (wp, wm), gp, gm in zip(want, p, m):
        torch.testing.assert_close(gp, wp, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(gm, wm, rtol=1e-14, atol=1e-15)
    noop = torch.ones(1, dtype=torch.int32)
    before = [t.clone() for t in p]
    multi_tensor_applier(opt.multi_tensor_sgd, noop, [g, p, m], wd, mom, damp, lr, nesterov,
                         first_run, wd_after, scale)
    assert all(torch.equal(a, b) for a, b in zip(before, p))


def test_applier_leaves_out_empty_tensors_and_checks_its_lists():
    seen = []

    def op(chunk_size, noop, lists, *args):
        seen.append((chunk_size, [len(lst) for lst in lists], args))
        return "done"

    apply = MultiTensorApply(128)
    xs = [torch.ones(3), torch.ones(0), torch.ones(2)]
    assert apply(op, flag(), [xs, list(xs)], 1.5) == "done"
    assert seen == [(128, [2, 2], (1.5,))]
    assert apply(op, flag(), [[torch.ones(0)]]) is None
    with pytest.raises(ValueError, match="the tensor lists must have the same length"):
        apply(op, flag(), [xs, xs[:2]])
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        MultiTensorApply(0)
    assert multi_tensor_applier.chunk_size == 2048 * 32


def test_adam_fp8_op_writes_fp8_bits_amax_and_scale_inv():
    g, w = tensors(F32, (64,)), tensors(F32, (64,))
    m, v = [torch.zeros(64)], [torch.zeros(64)]
    data = [torch.zeros(64, dtype=torch.float8_e4m3fn)]
    scale, amax, scale_inv = torch.tensor([4.0]), torch.zeros(1), torch.ones(1)
    multi_tensor_applier(opt.multi_tensor_adam_fp8, flag(),
                         [g, data, m, v, w, [scale], [amax], [scale_inv]],
                         1e-2, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0, torch.float8_e4m3fn)
    assert torch.equal(data[0].float(), (w[0] * 4.0).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert amax.item() == w[0].abs().max().item() and scale_inv.item() == 0.25


@pytest.mark.skipif(sys.platform == "win32", reason="child process with an environment")
def test_triton_kernels_match_the_torch_ops_under_the_interpreter():
    """Runs test_multi_tensor_kernels.py with TRITON_INTERPRET=1 (it must be set before
    Triton is imported, hence a child process)."""
    pytest.importorskip("triton")
    here = Path(__file__).parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(here / "test_multi_tensor_kernels.py")],
                          cwd=here, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("pow_2, epsilon", [(False, 0.0), (True, 0.0), (False, 100.0)])
def test_compute_scale_and_scale_inv_against_float64(fp8_dtype, pow_2, epsilon):
    """Current-scaling scales of many amaxes at once: ``max / max(amax, eps)`` in float64
    rounded to float32 (exact: the quotient of two float32 rounds once), 1 for a zero or
    infinite amax, the float32 maximum where the quotient overflows, the power of two at
    or below it with ``pow_2``; ``scale_inv = 1 / scale``."""
    max_fp8 = torch.finfo(fp8_dtype).max
    gen = torch.Generator().manual_seed(3)
    amaxes = [torch.rand(s, generator=gen) * 10 ** torch.randint(-6, 4, (s,), generator=gen)
              for s in (5, 1, 33)]
    amaxes[0][:3] = torch.tensor([0.0, float("inf"), 1e-40])
    scales = [torch.empty_like(a) for a in amaxes]
    scale_invs = [torch.empty_like(a) for a in amaxes]
    noop = flag()
    multi_tensor_applier(opt.multi_tensor_compute_scale_and_scale_inv, noop,
                         [amaxes, scales, scale_invs], max_fp8, pow_2, epsilon)
    for a, s, s_inv in zip(amaxes, scales, scale_invs):
        a64 = a.double().clamp(min=epsilon)
        want = (max_fp8 / a64).clamp(max=torch.finfo(F32).max)
        want = torch.where((a64 > 0) & torch.isfinite(a64), want, torch.ones_like(want)).float()
        if pow_2:
            want = torch.exp2(torch.floor(torch.log2(want.double()))).float()
        assert torch.equal(s, want), (a, s, want)
        assert torch.equal(s_inv, torch.reciprocal(want))
    assert noop.item() == 0
    with pytest.raises(ValueError, match="max_fp8 must be an FP8 format's largest value"):
        multi_tensor_applier(opt.multi_tensor_compute_scale_and_scale_inv, noop,
                             [amaxes, scales, scale_invs], 100.0, False, 0.0)
