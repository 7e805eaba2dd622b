"""Every specialization of the package's Triton kernels that the tests and benchmarks
reach compiles, for a Hopper GPU, to PTX that reads no register it never writes: the
code Triton 3.6's ptxas miscompiles (NOTE [FP8 stores] in kernels/common.py). No GPU is
needed: the kernels are compiled for sm_90 on the CPU (ptx_audit.py), with whatever
Triton is installed (CI: the one Megatron Core pins; the GPU job: the machine's).

The full grid is the one the GPU tests cover: one row, odd row counts, multiples of
16; row lengths that are and are not multiples of 16; float32, bfloat16 and float16
inputs, contiguous and strided; E4M3 and E5M2; with and without the transposed copy;
delayed, current and block scaling; every fused activation. It compiles some 1,500
specializations (minutes on two cores), so it runs in the GPU job and wherever
``TE_PTX_AUDIT=full`` is set; elsewhere (CI) float32 inputs of odd row count and a row
length that is a multiple of 16, E4M3, two activations: among them the pair cast of a
float32 operand with its transposed copy, the case a GPU run once flagged. A second group of tests shows
a suspect specialization is refused before any launch and that the callers then take
the torch path.
"""

import itertools
import os
import warnings

import pytest
import torch

from transformer_engine.pytorch import quantize
from transformer_engine.pytorch.kernel_config import SuspectCompile
import ptx_audit

AVAILABLE, WHY = ptx_audit.available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = [
    pytest.mark.skipif(not AVAILABLE, reason=f"cannot compile for sm_90 here: {WHY}"),
    pytest.mark.skipif(INTERPRET, reason="compiles kernels: not under the Triton interpreter"),
]

FULL = os.environ.get("TE_PTX_AUDIT") == "full" or torch.cuda.is_available()
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
HP = list(NAMES) if FULL else [torch.float32]
HP_IDS = [NAMES[d] for d in HP]
# (rows, columns): one row, odd rows and a row length not a multiple of 16, multiples of 16
SHAPES = [(1, 64), (37, 48), (33, 40), (64, 96)] if FULL else [(33, 48)]
FP8S = (E4M3, E5M2) if FULL else (E4M3,)


def _kernels():
    from transformer_engine.pytorch.kernels import (act_cast, casts, dact_cast,  # noqa: F401
                                                    norm_cast)
    return casts, norm_cast, act_cast, dact_cast


def _inputs(shape, dtype):
    """A contiguous tensor of ``shape`` and a strided view of the same shape."""
    rows, cols = shape
    return [torch.randn(rows, cols).to(dtype), torch.randn(cols, rows).to(dtype).t()]


def _clean(seen):
    suspect = [(name, key) for name, key, bad in seen if bad]
    assert seen, "nothing was compiled: the audit did not reach the kernels"
    assert not suspect, f"suspect specializations: {suspect}"


@pytest.mark.parametrize("hp", HP, ids=HP_IDS)
def test_plain_casts_compile_clean(hp):
    casts = _kernels()[0]
    with ptx_audit.compile_only() as seen:
        for shape, fp8 in itertools.product(SHAPES, FP8S):
            for x in _inputs(shape, hp):
                scale = torch.ones(4)
                for data, transpose, history in ((True, False, True), (False, True, False),
                                                 (True, True, True)):
                    casts.cast_transpose(x, scale, fp8, index=1,
                                         amax_history=torch.zeros(2, 4) if history else None,
                                         data=data, transpose=transpose)
                    casts.current_cast(x, fp8, False, 0.0, torch.zeros((), dtype=torch.int32),
                                       data, transpose)
                casts.current_cast(x, fp8, True, 1e-3, None, True, True)
                for block_rows in (1, 128):
                    casts.block_cast(x, fp8, block_rows, False, 0.0)
                casts.block_cast(x, fp8, 1, True, 1e-3)
            casts.amax(_inputs(shape, hp)[0])
            casts.transpose(torch.zeros(shape, dtype=torch.uint8).view(fp8))
    _clean(seen)


PAIR_HP = HP if FULL else [torch.float32]


@pytest.mark.parametrize("hp_b", PAIR_HP, ids=[NAMES[d] for d in PAIR_HP])
@pytest.mark.parametrize("hp_a", HP, ids=HP_IDS)
def test_cast_pair_compiles_clean(hp_a, hp_b):
    """The pair cast of a GEMM's forward operands (the kernel a first GPU run flagged:
    a float32 operand with its transposed copy)."""
    casts = _kernels()[0]
    with ptx_audit.compile_only() as seen:
        for (rows, cols), fp8 in itertools.product(SHAPES, FP8S):
            x = torch.randn(rows, cols).to(hp_a)
            for w in _inputs((cols + 16, cols), hp_b):
                for tx, tw in itertools.product((False, True), repeat=2):
                    for history in (torch.zeros(3, 4), None):
                        casts.cast_pair(x, w, torch.ones(4), fp8, 1, 2, history, tx, tw)
    _clean(seen)


def test_delayed_update_compiles_clean():
    casts = _kernels()[0]
    with ptx_audit.compile_only() as seen:
        for length, algo, count in itertools.product((1, 4, 16), ("max", "most_recent"),
                                                     (False, True)):
            states = [(torch.rand(length, n), torch.ones(n), torch.ones(n)) for n in (3, 6)]
            casts.delayed_update_(*zip(*states), 448.0, 0, algo,
                                  torch.zeros((), dtype=torch.int32) if count else None)
    _clean(seen)


def _scalings(n_slots: int = 3):
    yield {"scale": torch.ones(n_slots), "index": 1, "amax_history": torch.zeros(2, n_slots)}
    yield {"scale": torch.ones(n_slots), "index": 0, "amax_history": None}
    yield {"power_2_scale": False, "amax_epsilon": 0.0,
           "non_finite": torch.zeros((), dtype=torch.int32)}
    yield {"power_2_scale": True, "amax_epsilon": 1e-3, "non_finite": None}


@pytest.mark.parametrize("hp", HP, ids=HP_IDS)
def test_norm_cast_compiles_clean(hp):
    norm_cast = _kernels()[1]
    with ptx_audit.compile_only() as seen:
        for (rows, cols), fp8, normalization in itertools.product(
                SHAPES[:3], FP8S, ("LayerNorm", "RMSNorm")):
            x = torch.randn(rows, cols).to(hp)
            weight, bias = torch.randn(cols).to(hp), torch.randn(cols).to(hp)
            for scaling, (write_y, transpose) in zip(
                    _scalings(), ((False, True), (True, False), (False, True), (True, True))):
                norm_cast.norm_cast(x, weight, bias if normalization == "LayerNorm" else None,
                                    normalization, 1e-5, False, hp, fp8, write_y=write_y,
                                    transpose=transpose, **scaling)
    _clean(seen)


@pytest.mark.parametrize("hp", HP, ids=HP_IDS)
def test_activation_casts_compile_clean(hp):
    from transformer_engine.pytorch.module.activations import ACTIVATIONS, is_gated
    _, _, act_cast, dact_cast = _kernels()
    with ptx_audit.compile_only() as seen:
        for activation in (ACTIVATIONS if FULL else ("gelu", "swiglu")):
            width = 2 if is_gated(activation) else 1
            for rows, cols in SHAPES[:2]:
                x = torch.randn(rows, width * cols).to(hp)
                dy = torch.randn(rows, cols).to(hp)
                for scaling, transpose in zip(_scalings(), (True, False, True, False)):
                    act_cast.act_cast(x, activation, E4M3, transpose=transpose, **scaling)
                    dact_cast.dact_cast(x, dy, activation, E5M2, data=True, transpose=True,
                                        dbias_dtype=hp if transpose else None, **scaling)
    _clean(seen)


# ---- a suspect specialization is refused, and its callers take the torch path ---------

def _refuse_everything(monkeypatch):
    """Make every compile look suspect (the PTX check sees an unwritten register)."""
    from transformer_engine.pytorch.kernels import launch
    monkeypatch.setattr(launch, "undefined_registers", lambda ptx: ["%r99"])
    monkeypatch.setattr(launch, "_SUSPECT", [])
    monkeypatch.setattr(launch, "_WARNED", set())
    return launch


def test_suspect_compile_is_refused_before_launch_and_every_later_launch(monkeypatch):
    casts = _kernels()[0]
    launch = _refuse_everything(monkeypatch)
    x = torch.randn(32, 64)
    with ptx_audit.compile_only() as seen:
        with pytest.warns(RuntimeWarning, match="_cast_transpose_kernel.*not used"):
            with pytest.raises(SuspectCompile):
                casts.cast_transpose(x, torch.ones(1), E4M3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # one warning per kernel, not per call
            with pytest.raises(SuspectCompile):
                casts.cast_transpose(x, torch.ones(1), E4M3)
    assert [(name, bad) for name, _, bad in seen] == [("_cast_transpose_kernel", True)]
    assert launch.suspect_compiles() == [("_cast_transpose_kernel", ("%r99",))]


def test_refused_cast_takes_the_torch_path(monkeypatch):
    """`quantize` catches the refusal and casts with torch ops: the reference bits, the
    amax recorded once. (The kernels compile for sm_90 here, so the fused path is forced
    onto CPU tensors the way the interpreter tests force it.)"""
    _kernels()
    _refuse_everything(monkeypatch)
    monkeypatch.setattr(quantize, "_INTERPRETER", True)
    x = torch.randn(48, 64) * 3
    scale = torch.tensor([0.5, 2.0])
    history = torch.zeros(2, 2)
    expected_history = history.clone()
    from transformer_engine.pytorch.kernel_config import kernel_config
    with kernel_config(fused=False):
        ref, ref_t = quantize.cast_transpose_to_fp8(x, scale, E4M3, index=1,
                                                    amax_history=expected_history,
                                                    transpose=True)
    with ptx_audit.compile_only(), kernel_config(interpret=True):
        with pytest.warns(RuntimeWarning, match="not used"):
            got, got_t = quantize.cast_transpose_to_fp8(x, scale, E4M3, index=1,
                                                        amax_history=history, transpose=True)
            amax = quantize.amax(x)
    assert torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(got_t.data.view(torch.uint8), ref_t.data.view(torch.uint8))
    assert torch.equal(history, expected_history) and history[0, 1] == x.abs().max()
    assert amax == x.abs().max()
