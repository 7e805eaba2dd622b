"""The fused Triton casts (NOTE [Fused casts] in quantize.py) against the torch
reference ops, bit for bit; and the CPU path never loading Triton.

The CUDA cases run only on a GPU with FP8 and Triton; each compares the fused
path with the same call under ``kernel_config(fused=False)``.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format
from transformer_engine.pytorch import delayed_scaling, quantize
from transformer_engine.pytorch.kernel_config import (KernelConfig, get_kernel_config,
                                                     kernel_config)
from helpers import HAS_CUDA_FP8, assert_runs_equal, assert_tensors_equal, capture, params

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

cuda_triton = pytest.mark.skipif(not (HAS_CUDA_FP8 and HAS_TRITON),
                                 reason="needs a CUDA GPU with FP8 and Triton")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HP = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (16, 16), (100, 37), (256, 512), (333, 1040)]


def _bits(t):
    return t.view(torch.uint8)


def _sample(shape, dtype, special: bool):
    """Random data over many binades (subnormal FP8 results up to saturation)."""
    x = torch.randn(shape, device="cuda") * torch.exp2(torch.randint(-12, 12, shape, device="cuda"))
    if special:
        flat = x.view(-1)
        flat[:: 7] = float("inf")
        flat[3:: 11] = float("-inf")
        flat[5:: 13] = 1e30
    return x.to(dtype)


@pytest.fixture(autouse=True)
def fused_kernels_on():
    """These tests exercise the fused kernels whatever the environment says."""
    with kernel_config(fused=True, direct_launch=True):
        yield


def _spy(monkeypatch):
    """Count the casts of the fused kernels (a pair launch counts its two casts), to
    prove the fused path ran; ``calls.pairs`` counts the pair launches,
    ``calls.current`` the current-scaling casts."""
    from transformer_engine.pytorch.kernels import casts as triton_kernels
    calls = _Calls()
    real, real_pair = triton_kernels.cast_transpose, triton_kernels.cast_pair
    real_current = triton_kernels.current_cast

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def counting_current(*args, **kwargs):
        calls.append(1)
        calls.current += 1
        return real_current(*args, **kwargs)

    def counting_pair(*args, **kwargs):
        calls.extend((1, 1))
        calls.pairs += 1
        return real_pair(*args, **kwargs)
    monkeypatch.setattr(triton_kernels, "cast_transpose", counting)
    monkeypatch.setattr(triton_kernels, "cast_pair", counting_pair)
    monkeypatch.setattr(triton_kernels, "current_cast", counting_current)
    return calls


class _Calls(list):
    pairs = 0
    current = 0


@cuda_triton
@pytest.mark.parametrize("special", [False, True], ids=["finite", "inf"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("hp", HP, ids=["fp32", "bf16", "fp16"])
def test_cast_transpose_bitwise(hp, fp8, shape, special, monkeypatch):
    calls = _spy(monkeypatch)
    x = _sample(shape, hp, special)
    scale = torch.tensor([0.25, 3.7, 9.0], device="cuda")       # index 1 is used
    history = torch.full((4, 3), 1e-20, device="cuda")          # below max|x|: the amax wins
    hist_f, hist_r = history.clone(), history.clone()
    q_f, qt_f = quantize.cast_transpose_to_fp8(x, scale, fp8, index=1, amax_history=hist_f,
                                               transpose=True)
    with kernel_config(fused=False):
        q_r, qt_r = quantize.cast_transpose_to_fp8(x, scale, fp8, index=1, amax_history=hist_r,
                                                   transpose=True)
    assert len(calls) == 1
    assert torch.equal(_bits(q_f.data), _bits(q_r.data))
    assert torch.equal(_bits(qt_f.data), _bits(qt_r.data))
    assert qt_f.data.shape == (shape[1], shape[0])
    assert torch.equal(q_f.scale_inv, q_r.scale_inv) and qt_f.scale_inv is q_f.scale_inv
    assert torch.equal(hist_f, hist_r) and hist_f[0, 1].item() > 1e-20
    hist_f[0, 1] = 1e-20
    assert torch.equal(hist_f, history)          # nothing else was written


@cuda_triton
@pytest.mark.parametrize("shape", SHAPES + [(4096, 64), (64, 4100)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_transpose_is_torch_transpose_bit_for_bit(fp8, shape):
    """The Triton transposition of FP8 data (the dgrad operand of an FP8 primary
    weight, a cached weight cast without its transpose) moves bits: every byte
    pattern, NaN, inf and -0 included, lands where torch's transposed copy puts it."""
    g = torch.Generator(device="cuda").manual_seed(shape[0] * 7919 + shape[1])
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=g)
    q = quantize.Float8Data(raw.view(fp8), torch.tensor([0.5], device="cuda"))
    got = quantize.transpose_fp8(q)
    assert got.scale_inv is q.scale_inv
    assert torch.equal(_bits(got.data), _bits(q.data).t().contiguous())
    with kernel_config(fused=False):
        assert torch.equal(_bits(quantize.transpose_fp8(q).data), _bits(got.data))


@cuda_triton
def test_amax_slot_keeps_larger_prior_and_scale_inv_is_fresh():
    x = torch.randn(64, 48, device="cuda")
    history = torch.tensor([[1e6]], device="cuda")
    scale = torch.tensor([2.0], device="cuda")
    q, none = quantize.cast_transpose_to_fp8(x, scale, E4M3, amax_history=history)
    assert none is None and history.item() == 1e6
    scale.fill_(8.0)
    assert q.scale_inv.item() == 0.5


def _histories(length, widths):
    """Amax histories over many binades, with the cases the update must keep right."""
    out = []
    for n in widths:
        h = torch.rand(length, n, device="cuda") * torch.exp2(
            torch.randint(-20, 20, (length, n), device="cuda").float())
        h[:, 0] = 0                                  # amax 0: keep the old scale
        if n > 1:
            h[0, 1] = float("nan")                   # NaN / inf amax: keep the old scale
        if n > 2:
            h[length // 2, 2] = float("inf")
        if n > 3:
            h[:, 3] = 1e-44                          # tiny amax: scale clamped to the float32 max
        out.append(h)
    return out


@cuda_triton
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length, widths", [(1, [2]), (16, [2, 1, 4]), (1024, [2, 2, 4, 40]),
                                            (100, [70]), (65, [17, 3])],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("margin, max_value", [(0, 448.0), (2, 57344.0)])
def test_delayed_scaling_update_in_place_bitwise(algo, length, widths, margin, max_value,
                                                 monkeypatch):
    """One launch updates several states in place, bit for bit as the formulas."""
    from transformer_engine.pytorch.kernels import casts as triton_kernels
    calls = []
    real = triton_kernels.delayed_update_
    monkeypatch.setattr(triton_kernels, "delayed_update_",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    hists = _histories(length, widths)
    scales = [torch.rand(n, device="cuda") + 0.5 for n in widths]
    scale_invs = [torch.full((n,), -3.0, device="cuda") for n in widths]
    expect = [delayed_scaling.delayed_scaling_update(h, s, max_value, margin, algo)
              for h, s in zip(hists, scales)]
    ids = [id(t) for t in hists + scales + scale_invs]
    counter = torch.zeros((), dtype=torch.int32, device="cuda")
    non_finite = 0
    for _ in range(2):       # the second call reuses the cached table
        non_finite += sum(int((~h[0].isfinite()).sum()) for h in hists)
        delayed_scaling.delayed_scaling_update_(hists, scales, scale_invs, max_value, margin, algo,
                                                non_finite=counter)
        assert counter.item() == non_finite       # non-finite live amaxes, counted in-kernel
        for (e_scale, e_inv, e_hist), s, si, h in zip(expect, scales, scale_invs, hists):
            assert torch.equal(s, e_scale) and torch.equal(si, e_inv)
            assert torch.equal(h.nan_to_num(-7.0), e_hist.nan_to_num(-7.0))
            assert s.isfinite().all()
        expect = [delayed_scaling.delayed_scaling_update(e_hist, e_scale, max_value, margin, algo)
                  for e_scale, _, e_hist in expect]
    assert len(calls) == 2
    assert ids == [id(t) for t in hists + scales + scale_invs]      # in place


@cuda_triton
def test_delayed_scaling_update_in_place_reference_path_matches():
    """The torch path of `delayed_scaling_update_` (CPU, or fused kernels off) gives
    the same state as the kernel."""
    hists = _histories(32, [2, 4, 1])
    scales = [torch.rand(h.shape[1], device="cuda") + 0.5 for h in hists]
    invs = [torch.empty_like(s) for s in scales]
    ref = [[t.clone() for t in ts] for ts in (hists, scales, invs)]
    counts = [torch.zeros((), dtype=torch.int32, device="cuda") for _ in range(2)]
    delayed_scaling.delayed_scaling_update_(hists, scales, invs, 448.0, 0, "max", non_finite=counts[0])
    with kernel_config(fused=False):
        delayed_scaling.delayed_scaling_update_(*ref, 448.0, 0, "max", non_finite=counts[1])
    for a, b in zip(hists + scales + invs, ref[0] + ref[1] + ref[2]):
        assert torch.equal(a.nan_to_num(-7.0), b.nan_to_num(-7.0))
    assert counts[0].item() == counts[1].item() == 2       # the two NaN live amaxes


@cuda_triton
@pytest.mark.parametrize("hp", HP, ids=["fp32", "bf16", "fp16"])
def test_nan_propagates_like_reference(hp):
    x = torch.randn(128, 64, device="cuda").to(hp)
    x[7, 9] = float("nan")
    scale = torch.ones(1, device="cuda")
    slot_f, slot_r = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    q_f, _ = quantize.cast_transpose_to_fp8(x, scale, E4M3, amax_history=slot_f)
    with kernel_config(fused=False):
        q_r, _ = quantize.cast_transpose_to_fp8(x, scale, E4M3, amax_history=slot_r)
    assert slot_f.isnan().all() and slot_r.isnan().all()
    assert torch.equal(q_f.data.float().isnan(), q_r.data.float().isnan())
    assert quantize.amax(x).isnan()


@cuda_triton
@pytest.mark.parametrize("hp", HP, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("numel", [1, 4095, 4097, 1 << 20])
def test_amax_bitwise(hp, numel):
    x = _sample((numel,), hp, special=False)
    fused = quantize.amax(x)
    with kernel_config(fused=False):
        ref = quantize.amax(x)
    assert fused.shape == () and fused.dtype == torch.float32
    assert torch.equal(fused, ref)


@cuda_triton
def test_cast_to_fp8_non_contiguous_and_3d():
    x = torch.randn(48, 32, device="cuda", dtype=torch.bfloat16).t()   # strides (1, 32)
    y = torch.randn(2, 16, 48, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor([5.0], device="cuda")
    for t in (x, y):
        f = quantize.cast_to_fp8(t, scale, E4M3)
        with kernel_config(fused=False):
            r = quantize.cast_to_fp8(t, scale, E4M3)
        assert f.data.shape == t.shape and torch.equal(_bits(f.data), _bits(r.data))


@cuda_triton
@pytest.mark.parametrize("special", [False, True], ids=["finite", "inf"])
@pytest.mark.parametrize("transposes", [(True, True), (False, True), (True, False),
                                        (False, False)], ids=["tt", "ft", "tf", "ff"])
@pytest.mark.parametrize("shapes, dtypes", [
    (((16, 64), (48, 64)), (torch.bfloat16, torch.bfloat16)),
    (((100, 37), (333, 37)), (torch.float16, torch.float32)),     # partial tiles, mixed
    (((1, 1040), (8, 1040)), (torch.float32, torch.bfloat16)),
    (((256, 512), (64, 512)), (torch.bfloat16, torch.float32))], ids=["bf16", "fp16-fp32",
                                                                      "rows-1", "bf16-fp32"])
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_pair_bitwise(fp8, shapes, dtypes, transposes, special, monkeypatch):
    """One launch casting a GEMM's two forward operands (slots i and i + 1 of one scale
    vector and history) gives the bits of two reference casts: data, transposes,
    scale_inv and both amax slots; ``w`` also as a transposed (strided) view."""
    calls = _spy(monkeypatch)
    (shape_x, shape_w), (dtype_x, dtype_w) = shapes, dtypes
    tx, tw = transposes
    x = _sample(shape_x, dtype_x, special)
    for w in (_sample(shape_w, dtype_w, special),
              _sample(shape_w[::-1], dtype_w, special).t()):
        scale = torch.tensor([0.25, 3.7, 9.0, 0.5], device="cuda")       # slots 1 and 2
        for history in (True, False):
            hist_f = torch.full((3, 4), 0.5, device="cuda") if history else None
            hist_r = hist_f.clone() if history else None
            (xf, xf_t), (wf, wf_t) = quantize.cast_pair_unchecked(x, w, scale, fp8, 1, hist_f,
                                                                  tx, tw)
            with kernel_config(fused=False):
                xr, xr_t = quantize.cast_transpose_to_fp8(x, scale, fp8, index=1,
                                                          amax_history=hist_r, transpose=tx)
                wr, wr_t = quantize.cast_transpose_to_fp8(w, scale, fp8, index=2,
                                                          amax_history=hist_r, transpose=tw)
            for f, r in ((xf, xr), (wf, wr), (xf_t, xr_t), (wf_t, wr_t)):
                assert (f is None) == (r is None)
                if f is not None:
                    assert f.data.shape == r.data.shape
                    assert torch.equal(_bits(f.data), _bits(r.data))
                    assert torch.equal(f.scale_inv, r.scale_inv)
            if history:
                assert torch.equal(hist_f.nan_to_num(-7.0), hist_r.nan_to_num(-7.0))
    assert calls.pairs == 4 and len(calls) == 8


@cuda_triton
@pytest.mark.parametrize("direct", [True, False], ids=["direct-launch", "jit-launch"])
def test_cached_launches_keep_specializations_apart(direct):
    """Launches whose arguments differ only in what Triton specializes on (16-byte
    alignment, divisibility by 16, ints equal to 1) each match the reference, in an
    order where a too-coarse launch cache would reuse the wrong binary."""
    from transformer_engine.pytorch.kernels import casts as triton_kernels
    if direct:
        assert triton_kernels.direct_launch_supported(triton.__version__), \
            f"direct launch not checked on Triton {triton.__version__}"
    with kernel_config(direct_launch=direct):
        _launch_cases(triton_kernels, direct)


def _launch_cases(triton_kernels, direct):
    base = torch.randn(64 * 64 + 8, device="cuda", dtype=torch.bfloat16)
    cases = [base[:64 * 64].view(64, 64),            # aligned, all dims divisible by 16
             base[1:1 + 64 * 64].view(64, 64),       # same shape, pointer off by 2 bytes
             base[:64 * 64].view(64, 64),            # back to the first binary
             base[:63 * 64].view(63, 64),            # M not divisible by 16
             base[:64 * 63].view(64, 63),            # N (and the row stride) not
             base[:64].view(1, 64),                  # M == 1
             base[:64 * 64].view(64, 64)[:, :48]]    # a row stride unlike N
    scale = torch.tensor([0.5, 7.0], device="cuda")
    for round_ in range(2):                          # the second round hits the cache
        for i, x in enumerate(cases):
            hist_f, hist_r = torch.zeros(2, 2, device="cuda"), torch.zeros(2, 2, device="cuda")
            q_f, qt_f = quantize.cast_transpose_to_fp8(x, scale, E4M3, index=1,
                                                       amax_history=hist_f, transpose=True)
            with kernel_config(fused=False):
                q_r, qt_r = quantize.cast_transpose_to_fp8(x, scale, E4M3, index=1,
                                                           amax_history=hist_r, transpose=True)
            what = f"round {round_}, case {i}"
            assert torch.equal(_bits(q_f.data), _bits(q_r.data)), what
            assert torch.equal(_bits(qt_f.data), _bits(qt_r.data)), what
            assert torch.equal(hist_f, hist_r) and hist_f[0, 1] > 0, what
    if direct:      # aligned, misaligned, N, row stride: the row count is not specialized
        assert len(triton_kernels._launch_cast.compiled) >= 4


def _train(config: KernelConfig, recipe, bias: bool, steps: int = 3):
    """Two te.Linear in sequence (so each update covers two states), three steps; returns
    each step's output and record."""
    torch.manual_seed(7)
    layers = [te.Linear(64, 96, bias=bias, params_dtype=torch.bfloat16, device="cuda"),
              te.Linear(96, 48, bias=bias, params_dtype=torch.bfloat16, device="cuda")]
    outputs, record = [], []
    with kernel_config(fused=config.fused, direct_launch=config.direct_launch):
        for _ in range(steps):
            x = torch.randn(80, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            with te.autocast(recipe=recipe):
                y = layers[1](layers[0](x))
            loss = y.float().pow(2).sum()
            loss.backward()
            outputs.append(y.detach())
            record.append(capture(loss, [x], params(layers), layers))
            for layer in layers:
                layer.zero_grad()
    return outputs, record


@cuda_triton
@pytest.mark.parametrize("recipe", [DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4),
                                    DelayedScaling(fp8_format=Format.E4M3, margin=1),
                                    Float8CurrentScaling()], ids=["delayed-hybrid",
                                                                  "delayed-e4m3", "current"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("launch", ["direct", "jit"])
def test_linear_training_fused_equals_reference(recipe, bias, launch, monkeypatch):
    calls = _spy(monkeypatch)
    fused_outputs, fused = _train(KernelConfig(direct_launch=launch == "direct"), recipe, bias)
    assert len(calls) == 18   # x, W, dy of two layers in each of three steps
    # delayed scaling casts x and W in one launch (quantize.cast_pair_unchecked)
    assert calls.pairs == (6 if recipe.delayed() else 0)
    assert calls.current == (0 if recipe.delayed() else 18)
    ref_outputs, ref = _train(KernelConfig(fused=False), recipe, bias)
    assert len(calls) == 18
    assert_tensors_equal(fused_outputs, ref_outputs, "outputs")
    assert_runs_equal(ref, fused, "fused kernels against the reference,")


def test_kernel_config_restores_and_validates():
    before = get_kernel_config()
    with kernel_config(fused=not before.fused) as inside:
        assert get_kernel_config() is inside and inside.fused is (not before.fused)
        with pytest.raises(RuntimeError):
            with kernel_config(fused=before.fused):
                raise RuntimeError("inside")
        assert get_kernel_config() is inside
    assert get_kernel_config() is before
    with pytest.raises(TypeError, match=r"KernelConfig: fused must be a bool, got 1"):
        with kernel_config(fused=1):
            raise AssertionError("kernel_config should have refused 1")
    with pytest.raises(ValueError, match=r"cpu_gemm must be one of \('upcast', 'scaled_mm'\)"):
        KernelConfig(cpu_gemm="fast")
    assert get_kernel_config() is before


def test_kernel_config_from_environment():
    assert KernelConfig.from_environment({}) == KernelConfig()
    assert KernelConfig.from_environment({"NVTE_FUSED_FP8_KERNELS": "0"}).fused is False
    assert KernelConfig.from_environment({"NVTE_CPU_FP8_GEMM": "scaled_mm"}).cpu_gemm == "scaled_mm"
    assert KernelConfig.from_environment(
        {"NVTE_BLOCK_FP8_GEMM": "emulation"}).block_gemm == "emulation"
    with pytest.raises(ValueError, match=r"block_gemm must be one of \('hardware', 'emulation'\)"):
        KernelConfig.from_environment({"NVTE_BLOCK_FP8_GEMM": "cublas"})
    with pytest.raises(ValueError, match="NVTE_FUSED_FP8_KERNELS must be 0 or 1, got 'yes'"):
        KernelConfig.from_environment({"NVTE_FUSED_FP8_KERNELS": "yes"})


@pytest.mark.parametrize("version, ok", [("3.6.0", True), ("3.6.1+git1234", True),
                                         ("3.5.1", False), ("3.7.0", False), ("4.0", False),
                                         ("", False), (None, False), ("nightly", False)])
def test_direct_launch_guarded_by_triton_version(version, ok):
    """The direct launch relies on Triton internals checked on some versions only; any
    other Triton (an upgrade) launches through the JIT."""
    from transformer_engine.pytorch.kernels import launch as triton_launch
    assert triton_launch.direct_launch_supported(version) is ok


@cuda_triton
def test_unchecked_triton_version_launches_through_the_jit(monkeypatch):
    from transformer_engine.pytorch.kernels import casts as triton_kernels, launch as triton_launch
    monkeypatch.setattr(triton_launch, "_DIRECT_LAUNCH_OK", False)
    launcher = triton_launch.Launcher(triton_kernels._amax_kernel)
    x = torch.randn(4096, device="cuda")
    out = torch.zeros((), dtype=torch.int32, device="cuda")
    for _ in range(2):
        launcher((1, 1, 1), 8, (x.dtype,), x, out, x.numel(), 4096)
    assert launcher.compiled == {}                       # nothing cached: JIT every time
    assert torch.equal(out.view(torch.float32), x.abs().max())


def test_cast_transpose_rejects_bad_arguments():
    with pytest.raises(ValueError,
                       match=r"cast_transpose_to_fp8: x must be 2-D \[M, N\], got shape \(2, 3, 4\)"):
        quantize.cast_transpose_to_fp8(torch.ones(2, 3, 4), torch.ones(1), E4M3)
    with pytest.raises(ValueError, match="amax_history must be a float32 .* with n > index=2"):
        quantize.cast_transpose_to_fp8(torch.ones(2, 3), torch.ones(3), E4M3, index=2,
                                       amax_history=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="index 1 is out of range for a scale of 1 element"):
        quantize.cast_transpose_to_fp8(torch.ones(2, 3), torch.ones(1), E4M3, index=1)
    with pytest.raises(TypeError, match="cast_transpose_to_fp8: dtype must be one of"):
        quantize.cast_transpose_to_fp8(torch.ones(2, 3), torch.ones(1), torch.bfloat16)


def test_cpu_reference_cast_transpose_matches_parts():
    x = torch.randn(48, 32) * 10
    history = torch.ones(3, 2)
    q, qt = quantize.cast_transpose_to_fp8(x, torch.tensor([5.0, 2.0]), E5M2, index=1,
                                           amax_history=history, transpose=True)
    ref = quantize.cast_to_fp8(x, torch.tensor([2.0]), E5M2)
    assert torch.equal(_bits(q.data), _bits(ref.data))
    assert torch.equal(_bits(qt.data), _bits(ref.data.t().contiguous()))
    expect = torch.ones(3, 2)
    expect[0, 1] = x.abs().max()
    assert torch.equal(history, expect)


def test_cpu_delayed_scaling_update_is_the_formulas():
    h = torch.tensor([[2.0, 0.0, 0.0], [8.0, 1.0, 0.0], [4.0, 4.0, 0.0]])
    s = torch.tensor([1.0, 5.0, 7.0])
    scale, scale_inv, hist = delayed_scaling.delayed_scaling_update(h, s, 448.0, 1, "max")
    # a live amax of 0 (columns 1, 2: none recorded) keeps the scale and the history
    assert torch.equal(scale, torch.tensor([448.0 / 8 / 2, 5.0, 7.0]))
    assert torch.equal(scale_inv, 1 / scale)
    assert torch.equal(hist, torch.tensor([[0.0, 0.0, 0.0], [4.0, 1.0, 0.0], [2.0, 4.0, 0.0]]))


def test_cpu_path_imports_no_triton():
    code = textwrap.dedent("""
        import sys, torch
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling
        m = te.Linear(32, 32, device="cpu")
        x = torch.randn(16, 32, requires_grad=True)
        with te.autocast(recipe=DelayedScaling()):
            y = m(x)
        y.sum().backward()
        bad = [n for n in ("triton", "transformer_engine.pytorch.kernels")
               if n in sys.modules]
        print("LOADED", bad)
        sys.exit(1 if bad else 0)
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr
