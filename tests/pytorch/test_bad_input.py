"""Bad input to the public API, one case per argument: each raises the documented
exception type with a message that names the API and the argument (pinned with
``match=``). After every case the FP8 and recompute global state must be clean (the
autouse fixture of conftest.py) and a small FP8 training step must still work (the
autouse fixture below): a refused call leaves nothing behind.
"""

import collections
import contextlib
import io
import pickle
import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format, Recipe
from helpers import assert_states_equal, fp8_state_snapshot, fp8_training_steps

CPU = "cpu"


@pytest.fixture(autouse=True)
def fp8_training_still_works():
    """After the case: one FP8 training step on a fresh module has a finite loss and
    updates its forward and backward scales."""
    yield
    m = te.Linear(16, 16, device=CPU)
    x = torch.randn(16, 16, requires_grad=True)
    with te.autocast(recipe=DelayedScaling(amax_history_len=2)):
        y = m(x)
    loss = y.pow(2).mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(x.grad).all() and torch.isfinite(m.weight.grad).all()
    for key, n in (("scaling_fwd", 2), ("scaling_bwd", 1)):
        scale = m.fp8_meta[key].scale
        assert torch.isfinite(scale).all() and not torch.equal(scale, torch.ones(n)), key


def _case(fn, exc, match, id):
    return pytest.param(fn, exc, match, id=id)


def _fp8(fn, recipe=None):
    """``fn()`` inside an FP8 autocast (training forward)."""
    def run():
        with te.autocast(recipe=recipe or DelayedScaling()):
            fn()
    return run


def _qkv(dtype=torch.float32, heads=4):
    return torch.randn(16, 2, heads, 16, dtype=dtype)


# ---- recipes ------------------------------------------------------------------------------

RECIPE_CASES = [
    _case(lambda: DelayedScaling(margin=-1), ValueError,
          "DelayedScaling: margin must be >= 0, got -1", "margin-negative"),
    _case(lambda: DelayedScaling(margin=1.5), TypeError,
          "DelayedScaling: margin must be an int, got 1.5", "margin-float"),
    _case(lambda: DelayedScaling(margin=True), TypeError,
          "DelayedScaling: margin must be an int, got True", "margin-bool"),
    _case(lambda: DelayedScaling(margin=7), ValueError,
          r"DelayedScaling: margin must be <= 6 for fp8_format=Format.HYBRID, got 7: the scale "
          r"\(fp8_max / amax\) / 2\*\*margin would underflow", "margin-7-underflows-e4m3"),
    _case(lambda: DelayedScaling(margin=200, fp8_format=Format.E4M3), ValueError,
          "margin must be <= 6 for fp8_format=Format.E4M3, got 200", "margin-200-zero-scale"),
    _case(lambda: DelayedScaling(margin=2000), ValueError,
          "margin must be <= 6 for fp8_format=Format.HYBRID, got 2000", "margin-2000-overflow"),
    _case(lambda: DelayedScaling(amax_history_len=0), ValueError,
          r"DelayedScaling: amax_history_len must be in \[1, 65536\], got 0", "history-len-zero"),
    _case(lambda: DelayedScaling(amax_history_len=2 ** 62), ValueError,
          r"amax_history_len must be in \[1, 65536\], got 4611686018427387904", "history-len-huge"),
    _case(lambda: DelayedScaling(amax_history_len="8"), TypeError,
          "DelayedScaling: amax_history_len must be an int, got '8'", "history-len-str"),
    _case(lambda: DelayedScaling(amax_compute_algo="mean"), ValueError,
          r"DelayedScaling: amax_compute_algo must be one of \('max', 'most_recent'\) or a "
          "callable, got 'mean'", "amax-algo-unknown"),
    _case(lambda: DelayedScaling(scaling_factor_compute_algo=3), TypeError,
          "DelayedScaling: scaling_factor_compute_algo must be callable or None, got 3",
          "scale-algo-not-callable"),
    _case(lambda: DelayedScaling(fp8_format="HYBRID"), TypeError,
          "DelayedScaling: fp8_format must be a transformer_engine.common.recipe.Format, "
          "got 'HYBRID'", "format-str"),
    _case(lambda: DelayedScaling(fp8_format=Format.E5M2), ValueError,
          "DelayedScaling: fp8_format=Format.E5M2 is not supported for training", "format-e5m2"),
    _case(lambda: DelayedScaling(reduce_amax=1), TypeError,
          "DelayedScaling: reduce_amax must be a bool, got 1", "reduce-amax-int"),
    _case(lambda: DelayedScaling(fp8_dpa=1), TypeError,
          "DelayedScaling: fp8_dpa must be a bool, got 1", "fp8-dpa-int"),
    _case(lambda: Float8CurrentScaling(fp8_format=Format.E5M2), ValueError,
          "Float8CurrentScaling: fp8_format=Format.E5M2 is not supported", "current-format-e5m2"),
    _case(lambda: Float8CurrentScaling(fp8_format=None), TypeError,
          "Float8CurrentScaling: fp8_format must be a transformer_engine.common.recipe.Format",
          "current-format-none"),
]


@pytest.mark.parametrize("fn, exc, match", RECIPE_CASES)
def test_recipe_construction(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


# ---- recipe callables: their results are checked at the update ------------------------------

def _scale_algo(result):
    return DelayedScaling(amax_history_len=2,
                          scaling_factor_compute_algo=lambda amax, scale, fp8_max, r: result(amax))


def _amax_algo(result):
    return DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: result(h))


SCALE_ALGO = "DelayedScaling.scaling_factor_compute_algo: the callable"
AMAX_ALGO = "DelayedScaling.amax_compute_algo: the callable"
CALLABLE_CASES = [
    _case(_scale_algo(torch.zeros_like), ValueError,
          SCALE_ALGO + r" returned 0.0 for tensor 0 \(its amax was .*\); a scale must be finite "
          r"and >= 1.17\d*e-38 \(the smallest normal float32\)", "scale-algo-zeros"),
    _case(_scale_algo(lambda a: torch.full_like(a, float("nan"))), ValueError,
          SCALE_ALGO + " returned nan for tensor 0", "scale-algo-nan"),
    _case(_scale_algo(lambda a: torch.full_like(a, float("inf"))), ValueError,
          SCALE_ALGO + " returned inf for tensor 0", "scale-algo-inf"),
    _case(_scale_algo(lambda a: -torch.ones_like(a)), ValueError,
          SCALE_ALGO + " returned -1.0 for tensor 0", "scale-algo-negative"),
    _case(_scale_algo(lambda a: torch.full_like(a, 1e-40)), ValueError,
          SCALE_ALGO + " returned 9.99\\d*e-41 for tensor 0", "scale-algo-subnormal"),
    _case(_scale_algo(lambda a: torch.ones(a.numel() + 1)), ValueError,
          SCALE_ALGO + r" must return a tensor of shape \(2,\) \(one value per tensor\), "
          r"got \(3,\)", "scale-algo-wrong-shape"),
    _case(_scale_algo(lambda a: torch.ones(1)), ValueError,
          SCALE_ALGO + r" must return a tensor of shape \(2,\) .*got \(1,\)", "scale-algo-one"),
    _case(_scale_algo(lambda a: [1.0, 1.0]), TypeError,
          SCALE_ALGO + r" must return a torch.Tensor of shape \(2,\), got list", "scale-algo-list"),
    _case(_scale_algo(lambda a: torch.ones_like(a, dtype=torch.bool)), TypeError,
          SCALE_ALGO + " must return a real-valued tensor .*got dtype torch.bool",
          "scale-algo-bool"),
    _case(_scale_algo(lambda a: torch.ones_like(a, dtype=torch.complex64)), TypeError,
          SCALE_ALGO + " must return a real-valued tensor .*got dtype torch.complex64",
          "scale-algo-complex"),
    _case(_amax_algo(lambda h: -h.amax(0) - 1), ValueError,
          AMAX_ALGO + r" returned -\d.* for tensor 0; an amax must be finite and >= 0",
          "amax-algo-negative"),
    _case(_amax_algo(lambda h: h.amax(0) / 0), ValueError,
          AMAX_ALGO + " returned inf for tensor 0", "amax-algo-inf"),
    _case(_amax_algo(lambda h: h.amax(0) * float("nan")), ValueError,
          AMAX_ALGO + " returned nan for tensor 0", "amax-algo-nan"),
    _case(_amax_algo(lambda h: h), ValueError,
          AMAX_ALGO + r" must return a tensor of shape \(2,\) .*got \(2, 2\)", "amax-algo-2d"),
    _case(_amax_algo(lambda h: h.amax(0).tolist()), TypeError,
          AMAX_ALGO + r" must return a torch.Tensor of shape \(2,\), got list", "amax-algo-list"),
]


@pytest.mark.parametrize("recipe, exc, match", CALLABLE_CASES)
def test_recipe_callable_result_refused_at_update(recipe, exc, match):
    """The bad result is refused before it reaches the state: the module keeps its
    scales and history (the update did not run) and a later good step works."""
    m = te.Linear(16, 16, device=CPU)
    with te.autocast(recipe=DelayedScaling(amax_history_len=2)):
        m(torch.randn(16, 16)).sum().backward()
    # the module's next forward adopts the callable recipe (same history length)
    with te.autocast(recipe=recipe), torch.no_grad():
        m(torch.randn(16, 16))
    before = fp8_state_snapshot([m])
    with pytest.raises(exc, match=match):
        with te.autocast(recipe=recipe):
            m(torch.randn(16, 16))
    after = fp8_state_snapshot([m])
    for direction in ("fwd", "bwd"):
        b, a = getattr(before[0], direction), getattr(after[0], direction)
        assert torch.equal(a.scale, b.scale) and torch.equal(a.scale_inv, b.scale_inv), direction
    assert torch.equal(after[0].bwd.amax_history, before[0].bwd.amax_history)
    # the forward state's history was not rolled: only its live row saw the refused step
    assert torch.equal(after[0].fwd.amax_history[1:], before[0].fwd.amax_history[1:])


def test_non_finite_input_with_a_callable_amax_algo_keeps_the_scale():
    """An inf in the data is not the callable's fault: the step keeps the old scale
    (NOTE [Non-finite amaxes] in amax_update.py), the result checks do not refuse it."""
    m = te.Linear(16, 16, device=CPU)
    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: h.sum(0))
    with te.autocast(recipe=recipe):
        m(torch.randn(16, 16))
    before = m.fp8_meta["scaling_fwd"].scale.clone()
    x = torch.randn(16, 16)
    x[0, 0] = float("inf")
    seen = te.FP8GlobalStateManager.get_non_finite_amax_count()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)       # issued once per process
        with te.autocast(recipe=recipe):
            m(x)
    assert te.FP8GlobalStateManager.get_non_finite_amax_count() == seen + 1
    after = m.fp8_meta["scaling_fwd"].scale
    assert after[0] == before[0] and after[1] != before[1]
    assert torch.isfinite(m.fp8_meta["scaling_fwd"].amax_history).all()


# ---- te.autocast / te.fp8_autocast ----------------------------------------------------------

def _enter(cm_factory):
    def run():
        with cm_factory():
            return None
    return run


AUTOCAST_CASES = [
    _case(_enter(lambda: te.autocast(enabled="yes")), TypeError,
          "te.autocast: enabled must be a bool, got 'yes'", "autocast-enabled-str"),
    _case(_enter(lambda: te.autocast(calibrating=1)), TypeError,
          "te.autocast: calibrating must be a bool, got 1", "autocast-calibrating-int"),
    _case(_enter(lambda: te.autocast(recipe="delayed")), TypeError,
          "te.autocast: the recipe must be a transformer_engine.common.recipe.Recipe .*got str",
          "autocast-recipe-str"),
    _case(_enter(lambda: te.autocast(recipe=DelayedScaling)), TypeError,
          "te.autocast: the recipe must be .*got type", "autocast-recipe-class"),
    _case(_enter(lambda: te.autocast(amax_reduction_group=3)), TypeError,
          "te.autocast: amax_reduction_group must be a torch.distributed.ProcessGroup or "
          "None, got int", "autocast-group-int"),
    _case(_enter(lambda: te.fp8_autocast(enabled=None)), TypeError,
          "te.fp8_autocast: enabled must be a bool, got None", "fp8-autocast-enabled-none"),
    _case(_enter(lambda: te.fp8_autocast(fp8_recipe=Format.HYBRID)), TypeError,
          "te.fp8_autocast: the recipe must be .*got Format", "fp8-autocast-recipe-format"),
    _case(_enter(lambda: te.fp8_autocast(fp8_group="world")), TypeError,
          "te.fp8_autocast: fp8_group must be .*got str", "fp8-autocast-group-str"),
]


@pytest.mark.parametrize("fn, exc, match", AUTOCAST_CASES)
def test_autocast_arguments(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


# ---- module constructors ---------------------------------------------------------------------

CONSTRUCTOR_CASES = [
    # te.Linear
    _case(lambda: te.Linear(0, 16), ValueError,
          "te.Linear: in_features must be a positive int, got 0", "linear-in-features-zero"),
    _case(lambda: te.Linear(16, -1), ValueError,
          "te.Linear: out_features must be a positive int, got -1", "linear-out-features-negative"),
    _case(lambda: te.Linear(16.0, 16), ValueError,
          "te.Linear: in_features must be a positive int, got 16.0", "linear-in-features-float"),
    _case(lambda: te.Linear(16, 16, params_dtype=torch.float64), TypeError,
          "te.Linear: params_dtype must be torch.float32, torch.bfloat16 or torch.float16, got "
          "torch.float64", "linear-params-dtype-fp64"),
    _case(lambda: te.Linear(16, 16, parallel_mode="diagonal"), ValueError,
          r"te.Linear: parallel_mode must be one of \(None, 'column', 'row'\), got 'diagonal'",
          "linear-parallel-mode"),
    _case(lambda: te.Linear(16, 16, tp_size=0), ValueError,
          "te.Linear: tp_size must be a positive int, got 0", "linear-tp-size-zero"),
    _case(lambda: te.Linear(16, 16, sequence_parallel="yes"), TypeError,
          "te.Linear: sequence_parallel must be a bool, got 'yes'", "linear-sequence-parallel"),
    _case(lambda: te.Linear(16, 16, tp_group=3), TypeError,
          "te.Linear: tp_group must be a torch.distributed.ProcessGroup or None, got int",
          "linear-tp-group-int"),
    _case(lambda: te.Linear(16, 15, parallel_mode="column", tp_size=2), ValueError,
          "te.Linear: out_features=15 must be divisible by tp_size=2 for parallel_mode='column'",
          "linear-column-indivisible"),
    # te.LayerNorm / te.RMSNorm
    _case(lambda: te.LayerNorm(0), ValueError,
          "te.LayerNorm: normalized_shape must be a positive int, got 0", "layernorm-hidden-zero"),
    _case(lambda: te.RMSNorm(16, eps=0), ValueError,
          "te.RMSNorm: eps must be a finite positive float, got 0", "rmsnorm-eps-zero"),
    _case(lambda: te.LayerNorm(16, eps=-1.0), ValueError,
          "te.LayerNorm: eps must be a finite positive float, got -1.0", "layernorm-eps-negative"),
    _case(lambda: te.LayerNorm(16, eps=float("inf")), ValueError,
          "te.LayerNorm: eps must be a finite positive float, got inf", "layernorm-eps-inf"),
    _case(lambda: te.RMSNorm(16, eps=float("nan")), ValueError,
          "te.RMSNorm: eps must be a finite positive float, got nan", "rmsnorm-eps-nan"),
    _case(lambda: te.LayerNorm(16, eps="1e-5"), ValueError,
          "te.LayerNorm: eps must be a finite positive float, got '1e-5'", "layernorm-eps-str"),
    _case(lambda: te.RMSNorm(16, params_dtype=torch.float64), TypeError,
          "te.RMSNorm: params_dtype must be torch.float32, torch.bfloat16 or torch.float16, got "
          "torch.float64",
          "rmsnorm-params-dtype"),
    # te.LayerNormLinear
    _case(lambda: te.LayerNormLinear(64, 32, normalization="BatchNorm"), ValueError,
          r"te.LayerNormLinear: normalization must be one of \('LayerNorm', 'RMSNorm'\), got "
          "'BatchNorm'", "lnlinear-normalization"),
    _case(lambda: te.LayerNormLinear(0, 32), ValueError,
          "te.LayerNormLinear: in_features must be a positive int, got 0", "lnlinear-in-zero"),
    _case(lambda: te.LayerNormLinear(64, 32, eps=float("inf")), ValueError,
          "te.LayerNormLinear: eps must be a finite positive float, got inf", "lnlinear-eps-inf"),
    _case(lambda: te.LayerNormLinear(64, 32, parallel_mode="row"), ValueError,
          "te.LayerNormLinear: parallel_mode='row' would split the input features",
          "lnlinear-row-parallel"),
    # te.LayerNormMLP
    _case(lambda: te.LayerNormMLP(64, 128, activation="tanh"), ValueError,
          "te.LayerNormMLP: activation must be one of .*got 'tanh'", "lnmlp-activation"),
    _case(lambda: te.LayerNormMLP(64, 128, checkpoint="yes"), TypeError,
          "te.LayerNormMLP: checkpoint must be a bool, got 'yes'", "lnmlp-checkpoint-str"),
    _case(lambda: te.LayerNormMLP(64, 128, set_parallel_mode=1), TypeError,
          "te.LayerNormMLP: set_parallel_mode must be a bool, got 1", "lnmlp-set-parallel-int"),
    _case(lambda: te.LayerNormMLP(64, 0), ValueError,
          "te.LayerNormMLP: ffn_hidden_size must be a positive int, got 0", "lnmlp-ffn-zero"),
    _case(lambda: te.LayerNormMLP(64, 128, eps=float("nan")), ValueError,
          "te.LayerNormMLP: eps must be a finite positive float, got nan", "lnmlp-eps-nan"),
    # te.DotProductAttention
    _case(lambda: te.DotProductAttention(4, 16, num_gqa_groups=3), ValueError,
          "te.DotProductAttention: num_gqa_groups=3 must divide num_attention_heads=4",
          "dpa-gqa-groups"),
    _case(lambda: te.DotProductAttention(4, 16, qkv_format="tbhd"), ValueError,
          r"te.DotProductAttention: qkv_format must be one of \('sbhd', 'bshd', 'thd'\), got "
          "'tbhd'", "dpa-qkv-format"),
    _case(lambda: te.DotProductAttention(4, 16, attn_mask_type="sliding"), ValueError,
          "te.DotProductAttention: attn_mask_type must be one of .*got 'sliding'",
          "dpa-mask-type"),
    _case(lambda: te.DotProductAttention(4, 16, attention_dropout=1.5), ValueError,
          r"te.DotProductAttention: attention_dropout must be a float in \[0, 1\), got 1.5",
          "dpa-dropout"),
    _case(lambda: te.DotProductAttention(4, 0), ValueError,
          "te.DotProductAttention: kv_channels must be a positive int, got 0", "dpa-kv-channels"),
    _case(lambda: te.DotProductAttention(4, 16, softmax_scale=float("nan")), ValueError,
          "te.DotProductAttention: softmax_scale must be None or a finite positive float, got nan",
          "dpa-softmax-scale-nan"),
    _case(lambda: te.DotProductAttention(4, 16, softmax_scale="0.25"), ValueError,
          "te.DotProductAttention: softmax_scale must be None or a finite positive float, "
          "got '0.25'", "dpa-softmax-scale-str"),
    _case(lambda: te.DotProductAttention(4, 16, get_rng_state_tracker=3), TypeError,
          "te.DotProductAttention: get_rng_state_tracker must be a callable", "dpa-rng-tracker"),
    # te.MultiheadAttention
    _case(lambda: te.MultiheadAttention(64, 4, return_layernorm_output=True), ValueError,
          "te.MultiheadAttention: return_layernorm_output=True needs input_layernorm=True",
          "mha-return-ln-output"),
    _case(lambda: te.MultiheadAttention(60, 8), ValueError,
          "te.MultiheadAttention: hidden_size=60 is not divisible by num_attention_heads=8",
          "mha-heads-indivisible"),
    _case(lambda: te.MultiheadAttention(64, 4, layernorm_epsilon=-1e-5), ValueError,
          "te.MultiheadAttention: layernorm_epsilon must be a finite positive float, got -1e-05",
          "mha-layernorm-epsilon"),
    _case(lambda: te.MultiheadAttention(64, 4, params_dtype=torch.float64), TypeError,
          "te.MultiheadAttention: params_dtype must be torch.float32, torch.bfloat16 or "
          "torch.float16", "mha-params-dtype"),
    # te.TransformerLayer
    _case(lambda: te.TransformerLayer(0, 128, 4), ValueError,
          "te.TransformerLayer: hidden_size must be a positive int, got 0", "layer-hidden-zero"),
    _case(lambda: te.TransformerLayer(64, 128, 4, hidden_dropout=1.0), ValueError,
          r"te.TransformerLayer: hidden_dropout must be a float in \[0, 1\), got 1.0",
          "layer-hidden-dropout"),
    _case(lambda: te.TransformerLayer(64, 128, 4, layernorm_epsilon=float("inf")), ValueError,
          "te.TransformerLayer: layernorm_epsilon must be a finite positive float, got inf",
          "layer-layernorm-epsilon"),
    _case(lambda: te.TransformerLayer(64, 128, 4, normalization="BatchNorm"), ValueError,
          "te.TransformerLayer: normalization must be one of", "layer-normalization"),
    _case(lambda: te.TransformerLayer(64, 128, 4, attn_input_format="tbhd"), ValueError,
          "te.TransformerLayer: attn_input_format must be one of", "layer-input-format"),
]


@pytest.mark.parametrize("fn, exc, match", CONSTRUCTOR_CASES)
def test_module_construction(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


@pytest.mark.parametrize("build, split_by", [
    pytest.param(lambda: te.Linear(16, 16, tp_size=2), "parallel_mode='column' or 'row'",
                 id="linear"),
    pytest.param(lambda: te.LayerNormLinear(16, 16, tp_size=2), "parallel_mode='column' or 'row'",
                 id="lnlinear"),
    pytest.param(lambda: te.LayerNormMLP(16, 32, tp_size=4), "set_parallel_mode=True",
                 id="lnmlp"),
])
def test_tp_size_without_parallel_mode_warns(build, split_by):
    """TE accepts ``tp_size`` on an unsplit layer (its attention passes it along), so
    scripts written for TE keep running: a warning, once per module, not an error."""
    with pytest.warns(UserWarning, match=rf"tp_size=\d has no effect without {split_by}: the "
                                         "layer is not split") as record:
        m = build()
    assert len(record) == 1
    assert m.weight.shape[0] == 16 if hasattr(m, "weight") else m.fc1_weight.shape[0] == 32


# ---- module calls ------------------------------------------------------------------------

def _call(build, *args, **kwargs):
    def run():
        module = build()
        module(*(a() if callable(a) else a for a in args), **kwargs)
    return run


def _lin(**kw):
    return lambda: te.Linear(16, 16, device=CPU, **kw)


def _f32(*shape):
    return lambda: torch.randn(*shape)


def _typed(dtype, *shape):
    return lambda: torch.ones(*shape, dtype=dtype)


MISMATCH = (r"outside te.autocast \(FP8\) and torch.autocast the input must have the "
            r"parameters' dtype torch.float32, got torch.bfloat16; cast the input")
CALL_CASES = [
    # te.Linear
    _case(_call(_lin(), [0.0] * 16), TypeError,
          "te.Linear: input must be a tensor, got list", "linear-input-list"),
    _case(_call(_lin(), lambda: torch.tensor(1.0)), ValueError,
          r"te.Linear: the input's last dimension must be in_features=16, got input of shape \(\)",
          "linear-input-0d"),
    _case(_call(_lin(), _f32(4, 8)), ValueError,
          r"te.Linear: the input's last dimension must be in_features=16, got input of shape "
          r"\(4, 8\)", "linear-input-last-dim"),
    _case(_call(_lin(), _typed(torch.int64, 4, 16)), TypeError,
          "te.Linear: input must be a floating-point tensor, got dtype torch.int64",
          "linear-input-int"),
    _case(_fp8(_call(_lin(), _typed(torch.bool, 16, 16))), TypeError,
          "te.Linear: input must be a floating-point tensor, got dtype torch.bool",
          "linear-input-bool-fp8"),
    _case(_call(_lin(), _typed(torch.bfloat16, 4, 16)), TypeError, "te.Linear: " + MISMATCH,
          "linear-input-bf16-fp32-module"),
    _case(_call(_lin(params_dtype=torch.bfloat16), _f32(4, 16)), TypeError,
          "te.Linear: outside .* the input must have the parameters' dtype torch.bfloat16, got "
          "torch.float32", "linear-input-fp32-bf16-module"),
    _case(_fp8(_call(_lin(), _typed(torch.float64, 16, 16))), TypeError,
          "te.Linear: FP8 GEMMs produce float32, bfloat16 or float16; got an input of dtype "
          "torch.float64", "linear-input-fp64-fp8"),
    _case(_fp8(_call(_lin(), _f32(12, 16))), ValueError,
          r"te.Linear: FP8 execution requires 2D input matrices with height divisible by 8 and "
          r"width divisible by 16; got the input of shape \(12, 16\)",
          "linear-fp8-rows-indivisible"),
    # te.LayerNorm / te.RMSNorm
    _case(_call(lambda: te.LayerNorm(16, device=CPU), _typed(torch.int64, 2, 16)), TypeError,
          "te.LayerNorm: input must be a floating-point tensor, got dtype torch.int64",
          "layernorm-input-int"),
    _case(_call(lambda: te.RMSNorm(16, device=CPU), _typed(torch.bool, 2, 16)), TypeError,
          "te.RMSNorm: input must be a floating-point tensor, got dtype torch.bool",
          "rmsnorm-input-bool"),
    _case(_call(lambda: te.RMSNorm(64, device=CPU), _f32(2, 32)), ValueError,
          r"te.RMSNorm: the input's last dimension must be hidden_size=64, got input of shape "
          r"\(2, 32\)", "rmsnorm-input-last-dim"),
    _case(_call(lambda: te.LayerNorm(16, device=CPU), lambda: torch.tensor(2.0)), ValueError,
          r"te.LayerNorm: the input's last dimension must be hidden_size=16, got input of shape "
          r"\(\)", "layernorm-input-0d"),
    _case(_call(lambda: te.LayerNorm(16, device=CPU), "x"), TypeError,
          "te.LayerNorm: input must be a tensor, got str", "layernorm-input-str"),
    # te.LayerNormLinear
    _case(_call(lambda: te.LayerNormLinear(16, 16, device=CPU), [0.0] * 16), TypeError,
          "te.LayerNormLinear: input must be a tensor, got list", "lnlinear-input-list"),
    _case(_call(lambda: te.LayerNormLinear(16, 16, device=CPU), _typed(torch.int32, 4, 16)),
          TypeError, "te.LayerNormLinear: input must be a floating-point tensor, got dtype "
          "torch.int32", "lnlinear-input-int"),
    _case(_call(lambda: te.LayerNormLinear(16, 16, device=CPU), _typed(torch.bfloat16, 4, 16)),
          TypeError, "te.LayerNormLinear: " + MISMATCH, "lnlinear-input-bf16-fp32-module"),
    # te.LayerNormMLP
    _case(_call(lambda: te.LayerNormMLP(16, 32, device=CPU), _typed(torch.int64, 4, 16)),
          TypeError, "te.LayerNormMLP: input must be a floating-point tensor, got dtype "
          "torch.int64", "lnmlp-input-int"),
    _case(_call(lambda: te.LayerNormMLP(16, 32, device=CPU), _typed(torch.bfloat16, 4, 16)),
          TypeError, "te.LayerNormMLP: " + MISMATCH, "lnmlp-input-bf16-fp32-module"),
    _case(_call(lambda: te.LayerNormMLP(16, 32, checkpoint=True, device=CPU),
                lambda: torch.ones(4, 16, dtype=torch.bfloat16, requires_grad=True)),
          TypeError, "te.LayerNormMLP: " + MISMATCH, "lnmlp-checkpointed-input-bf16"),
    _case(_fp8(_call(lambda: te.LayerNormMLP(64, 24, device=CPU), _f32(16, 64))), ValueError,
          r"te.LayerNormMLP: FP8 execution requires .*; got the FC2 input \(the activation "
          r"output\) of shape \(16, 24\), height 16 and width 24", "lnmlp-fp8-ffn-indivisible"),
    # te.DotProductAttention
    _case(_call(lambda: te.DotProductAttention(4, 16, attn_mask_type="padding"), _qkv, _qkv,
                _qkv), ValueError,
          "te.DotProductAttention: attn_mask_type='padding' needs an attention_mask",
          "dpa-padding-without-mask"),
    _case(_call(lambda: te.DotProductAttention(4, 16, attn_mask_type="padding"), _qkv, _qkv, _qkv,
                attention_mask=torch.zeros(2, 1, 1, 16, dtype=torch.long)), ValueError,
          r"padding mask for the queries must be a bool tensor of shape \[batch, 1, 1, seq\] = "
          r"\[2, 1, 1, 16\].*got torch.int64", "dpa-padding-mask-int"),
    _case(_call(lambda: te.DotProductAttention(4, 16), _qkv, lambda: _qkv(heads=2),
                lambda: _qkv(heads=2)), ValueError,
          r"key_layer must be \[seq, batch, heads, d\] \(sbhd\) with 4 heads of size d=16, got "
          r"shape \(16, 2, 2, 16\)", "dpa-key-heads"),
    _case(_call(lambda: te.DotProductAttention(4, 16), _qkv, lambda: _qkv(torch.bfloat16), _qkv),
          TypeError, "te.DotProductAttention: query_layer, key_layer and value_layer must be "
          "floating-point tensors of one dtype, got torch.float32, torch.bfloat16, torch.float32",
          "dpa-key-dtype"),
    _case(_call(lambda: te.DotProductAttention(4, 16), lambda: _qkv().long(),
                lambda: _qkv().long(), lambda: _qkv().long()), TypeError,
          "te.DotProductAttention: .* must be floating-point tensors of one dtype, got "
          "torch.int64", "dpa-qkv-int"),
    _case(_call(lambda: te.DotProductAttention(4, 16), [0.0], _qkv, _qkv), TypeError,
          "te.DotProductAttention: query_layer must be a tensor, got list", "dpa-query-list"),
    _case(_call(lambda: te.DotProductAttention(4, 16), _qkv, _qkv, _qkv, qkv_format="tbhd"),
          ValueError, "te.DotProductAttention: qkv_format must be one of", "dpa-call-format"),
    # te.MultiheadAttention
    _case(_call(lambda: te.MultiheadAttention(64, 4, device=CPU), _f32(32, 64)), ValueError,
          r"te.MultiheadAttention: hidden_states must be a 3-D tensor \(s, b, hidden\), got "
          r"\(32, 64\)", "mha-input-2d"),
    _case(_call(lambda: te.MultiheadAttention(64, 4, device=CPU), _typed(torch.int64, 8, 2, 64)),
          TypeError, "te.MultiheadAttention: hidden_states must be a floating-point tensor, got "
          "dtype torch.int64", "mha-input-int"),
    _case(_call(lambda: te.MultiheadAttention(64, 4, input_layernorm=True, device=CPU),
                _typed(torch.bfloat16, 8, 2, 64)), TypeError,
          "te.MultiheadAttention: " + MISMATCH, "mha-input-bf16-fp32-module"),
    # te.TransformerLayer
    _case(_call(lambda: te.TransformerLayer(64, 128, 4, device=CPU), _f32(32, 64)), ValueError,
          r"te.TransformerLayer: hidden_states must be \[seq, batch, hidden\] with hidden=64, "
          r"got \(32, 64\)", "layer-input-2d"),
    _case(_call(lambda: te.TransformerLayer(64, 128, 4, device=CPU),
                _typed(torch.int64, 8, 2, 64)), TypeError,
          "te.TransformerLayer: hidden_states must be a floating-point tensor, got dtype "
          "torch.int64", "layer-input-int"),
    _case(_call(lambda: te.TransformerLayer(64, 128, 4, device=CPU),
                _typed(torch.bfloat16, 8, 2, 64)), TypeError,
          "te.TransformerLayer: " + MISMATCH, "layer-input-bf16-fp32-module"),
]


@pytest.mark.parametrize("fn, exc, match", CALL_CASES)
def test_module_call(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_mismatched_dtype_is_fine_under_torch_autocast_and_fp8():
    """The dtype check refuses only what the GEMM cannot take: under torch.autocast and
    in FP8 a bfloat16 input to a float32 module runs, giving a bfloat16 output."""
    m = te.Linear(16, 16, device=CPU)
    x = torch.randn(16, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(x).dtype == torch.bfloat16
    with te.autocast(recipe=DelayedScaling()):
        assert m(x).dtype == torch.bfloat16


# ---- te.checkpoint arguments ------------------------------------------------------------------

def _ckpt(**kwargs):
    """A te.checkpoint call of a small te.Linear with ``kwargs``."""
    def run():
        layer = te.Linear(16, 16, device=CPU)
        te.checkpoint(layer, torch.randn(16, 16, requires_grad=True), **kwargs)
    return run


def _ckpt_of(function):
    return lambda: te.checkpoint(function, torch.randn(16, 16, requires_grad=True))


CHECKPOINT_CASES = [
    _case(_ckpt_of(3), TypeError, "te.checkpoint: function must be callable, got int",
          "checkpoint-function-int"),
    _case(_ckpt(use_reentrant="yes"), TypeError,
          "te.checkpoint: use_reentrant must be a bool, got 'yes'", "checkpoint-reentrant-str"),
    _case(_ckpt(distribute_saved_activations=1), TypeError,
          "te.checkpoint: distribute_saved_activations must be a bool, got 1",
          "checkpoint-distribute-int"),
    _case(_ckpt(get_rng_state_tracker="tracker"), TypeError,
          "te.checkpoint: get_rng_state_tracker must be a callable returning a "
          "CudaRNGStatesTracker, got str", "checkpoint-tracker-str"),
    _case(_ckpt(tp_group="tp"), TypeError,
          "te.checkpoint: tp_group must be a torch.distributed.ProcessGroup or None, got str",
          "checkpoint-tp-group-str"),
    _case(_ckpt(context_fn="contexts"), TypeError,
          "te.checkpoint: context_fn must be a callable returning two context managers, got str",
          "checkpoint-context-fn-str"),
    _case(_ckpt(context_fn=lambda: contextlib.nullcontext()), TypeError,
          "te.checkpoint: context_fn must return a pair of context managers",
          "checkpoint-context-fn-one"),
    _case(_ckpt(determinism_check="always"), ValueError,
          "te.checkpoint: determinism_check must be 'default' or 'none', got 'always'",
          "checkpoint-determinism-check"),
    _case(_ckpt(debug="yes"), TypeError, "te.checkpoint: debug must be a bool, got 'yes'",
          "checkpoint-debug-str"),
    _case(_ckpt(debug=True), NotImplementedError, "te.checkpoint: debug=True",
          "checkpoint-debug-true"),
    _case(_ckpt(use_reentrant=True, distribute_saved_activations=True), RuntimeError,
          "te.checkpoint: distribute_saved_activations=True needs an initialized "
          "torch.distributed process group", "checkpoint-distribute-no-group"),
]


@pytest.mark.parametrize("fn, exc, match", CHECKPOINT_CASES)
def test_checkpoint_arguments(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


# ---- set_extra_state payloads (NOTE [FP8 extra state payload]) ------------------------------

def _trained(module, steps=2):
    fp8_training_steps(module, DelayedScaling(amax_history_len=3), [1.0] * steps)
    return module


def _decode(payload: torch.Tensor) -> dict:
    """A payload in TE's layout (NOTE [FP8 extra state payload]); the test trusts it."""
    return pickle.loads(payload.numpy().tobytes())


def _encode(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _encode_archive(obj) -> torch.Tensor:
    """A payload of the earlier layout: a torch.save archive."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _edit(change):
    """A tamper that decodes the payload, lets ``change(data)`` edit it, encodes it."""
    def tamper(payload):
        data = _decode(payload)
        change(data)
        return _encode(data)
    return tamper


def _set(key, value):
    """An edit that sets ``data[key] = value(old)``."""
    def change(data):
        data[key] = value(data[key])
    return change


def _set_recipe(name, value):
    return lambda data: setattr(data["recipe"], name, value)


def _other_module_payload(_):
    return _trained(te.LayerNormMLP(16, 16, device=CPU)).get_extra_state()


def _pop(*keys):
    def change(data):
        for key in keys:
            data.pop(key)
    return change


def _scales(values):
    """Scales of the forward slots in use (input, weight; TE's output slot stays 1)."""
    return _set("scale_fwd", lambda s: torch.tensor(values + [1.0], dtype=torch.float32))


def _history_rows(rows):
    def change(data):
        for key in ("amax_history_fwd", "amax_history_bwd"):
            data[key] = torch.zeros(rows, data[key].shape[1])
    return change


def _archive(change):
    """A tamper that rewrites the payload in the earlier layout, edited by ``change``."""
    def tamper(payload):
        data = _decode(payload)
        fwd, bwd = data["scale_fwd"][:2], data["scale_bwd"][:1]
        legacy = {"recipe": {"type": "DelayedScaling", "margin": 0, "fp8_format": "HYBRID",
                             "amax_history_len": 3, "amax_compute_algo": "max",
                             "reduce_amax": True},
                  "scaling_fwd": {"scale": fwd, "scale_inv": 1 / fwd,
                                  "amax_history": data["amax_history_fwd"][:, :2]},
                  "scaling_bwd": {"scale": bwd, "scale_inv": 1 / bwd,
                                  "amax_history": data["amax_history_bwd"][:, :1]}}
        change(legacy)
        return _encode_archive(legacy)
    return tamper


INVALID = "Linear.set_extra_state: the FP8 extra state is not a valid payload written by " \
          "get_extra_state: "
SLOTS_FWD = (r"scale_fwd and amax_history_fwd: this module's 3 slots \(TE's layout\) need "
             r"tensors of shapes \(3,\) and \(amax_history_len, 3\), got ")
PAYLOAD_CASES = [
    _case(_edit(_set("scale_fwd", lambda s: s.to(torch.int64))), ValueError,
          INVALID + "scaling_fwd.scale: expected a float32 tensor, got torch.int64 tensor",
          "scale-int64"),
    _case(_edit(_set("amax_history_bwd", lambda h: h.double())), ValueError,
          "scaling_bwd.amax_history: expected a float32 tensor, got torch.float64",
          "history-fp64"),
    _case(_edit(_scales([float("nan"), 1.0])), ValueError,
          INVALID + r"scaling_fwd.scale: every scale must be finite and >= 1.17\d*e-38 \(the "
          r"smallest normal float32\), got \[nan, 1.0\]", "scale-nan"),
    _case(_edit(_scales([0.0, 1.0])), ValueError,
          r"scaling_fwd.scale: every scale must be finite .*got \[0.0, 1.0\]", "scale-zero"),
    _case(_edit(_scales([float("inf"), 1.0])), ValueError,
          r"scaling_fwd.scale: every scale must be finite .*got \[inf, 1.0\]", "scale-inf"),
    _case(_edit(_scales([-2.0, 1.0])), ValueError,
          r"scaling_fwd.scale: every scale must be finite .*got \[-2.0, 1.0\]", "scale-negative"),
    _case(_edit(_scales([1e-40, 1.0])), ValueError,
          r"scaling_fwd.scale: every scale must be finite .*got \[9.99\d*e-41, 1.0\]",
          "scale-subnormal"),
    _case(_edit(_set("amax_history_fwd", lambda h: h.index_fill(0, torch.tensor([1]),
                                                                float("nan")))),
          ValueError, INVALID + "scaling_fwd.amax_history: every amax must be finite and >= 0",
          "history-nan"),
    _case(_edit(_set("amax_history_bwd", lambda h: -h - 1)), ValueError,
          "scaling_bwd.amax_history: every amax must be finite and >= 0", "history-negative"),
    _case(_edit(_set("scale_fwd", lambda s: torch.cat([s, s]))), ValueError,
          INVALID + SLOTS_FWD + r"torch.float32 tensor of shape \(6,\)", "scale-extra-slots"),
    _case(_edit(_set("amax_history_fwd", lambda h: h[:, :1])), ValueError,
          SLOTS_FWD + r".* and torch.float32 tensor of shape \(3, 1\)", "history-missing-slot"),
    _case(_edit(_set("scale_fwd", lambda s: s.reshape(1, 3))), ValueError,
          SLOTS_FWD + r"torch.float32 tensor of shape \(1, 3\)", "scale-2d"),
    _case(_other_module_payload, ValueError,
          INVALID + r"extra_fp8_variables must be a dict whose num_gemms is this module's 1, "
          r"got \{'num_gemms': 2\}", "other-module-two-gemms"),
    _case(_edit(_pop("scale_bwd")), ValueError,
          INVALID + r"scale_bwd and amax_history_bwd: .* got None and ", "missing-scale-bwd"),
    _case(_edit(lambda d: d.update(version=2)), ValueError,
          r"expected a dict with keys 'recipe' and 'extra_fp8_variables' and optionally "
          r"\[.*\], got \[.*'version'\]", "extra-top-level-key"),
    _case(_edit(_pop("extra_fp8_variables")), ValueError,
          r"expected a dict with keys 'recipe' and 'extra_fp8_variables'", "no-extra-variables"),
    _case(_edit(_pop("scale_fwd", "amax_history_fwd")), ValueError,
          INVALID + "scaling_fwd and scaling_bwd must both be present or both None",
          "one-state-missing"),
    _case(_edit(_pop("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")),
          ValueError, "a DelayedScaling recipe comes with its scaling state",
          "delayed-recipe-no-state"),
    _case(_edit(_set("amax_history_bwd", lambda h: torch.cat([h, h]))), ValueError,
          "the forward and backward amax histories differ in length: 3 and 6",
          "history-lengths-differ"),
    _case(_edit(_history_rows(5)), ValueError,
          INVALID + "the amax histories have 5 rows but the saved recipe has amax_history_len=3",
          "history-length-not-recipes"),
    _case(_edit(_history_rows(65537)), ValueError,
          r"scaling_fwd.amax_history: the length must be in \[1, 65536\], got 65537",
          "history-too-long"),
    _case(_edit(_set_recipe("amax_compute_algo", collections.OrderedDict)),
          ValueError, INVALID + r"recipe: amax_compute_algo must be one of \('max', "
          r"'most_recent'\), got <global collections.OrderedDict>", "recipe-callable-amax-algo"),
    _case(_edit(_set_recipe("scaling_factor_compute_algo", collections.OrderedDict)),
          ValueError, INVALID + "recipe: scaling_factor_compute_algo must be None",
          "recipe-callable-scale-algo"),
    _case(_edit(_set_recipe("amax_compute_algo", "mean")), ValueError,
          r"recipe: amax_compute_algo must be one of .*got 'mean'", "recipe-amax-algo-unknown"),
    _case(_edit(_set_recipe("margin", 200)), ValueError,
          INVALID + "recipe: DelayedScaling: margin must be <= 6 for fp8_format=Format.HYBRID, "
          "got 200", "recipe-margin-underflows"),
    _case(_edit(_set_recipe("reduce_amax", "yes")), ValueError,
          "recipe: DelayedScaling: reduce_amax must be a bool, got 'yes'", "recipe-reduce-amax"),
    _case(_edit(_set_recipe("fp8_format", "E6M1")), ValueError,
          r"recipe: fp8_format must be one of \['E4M3', 'E5M2', 'E2M1', 'HYBRID'\], got 'E6M1'",
          "recipe-format-unknown"),
    _case(_edit(_set_recipe("fp8_format", Format.E5M2)), ValueError,
          "recipe: DelayedScaling: fp8_format=Format.E5M2 is not supported", "recipe-format-e5m2"),
    _case(_edit(_set("recipe", lambda r: Recipe())), ValueError,
          INVALID + "it refers to transformer_engine.common.recipe.Recipe, which an "
          "FP8 extra state never holds", "recipe-unknown-type"),
    _case(_edit(_set("recipe", lambda r: [r])), ValueError,
          "recipe: expected None or a DelayedScaling, Float8CurrentScaling or "
          r"Float8BlockScaling, got \[<DelayedScaling object>\]", "recipe-list"),
    _case(_edit(_set("recipe", lambda r: print)), ValueError,
          INVALID + "it refers to builtins.print, which an FP8 extra state never holds",
          "unsafe-pickle"),
    _case(lambda p: _encode([1, 2, 3]), ValueError,
          INVALID + r"expected a dict with keys 'recipe' and 'extra_fp8_variables' .*got \[1, 2, 3\]",
          "payload-list"),
    _case(lambda p: p[: p.numel() // 2].clone(), ValueError,
          INVALID + r"its bytes are not a complete pickle \(truncated or corrupted",
          "bytes-truncated"),
    _case(lambda p: torch.frombuffer(bytearray(b"not a checkpoint at all"), dtype=torch.uint8),
          ValueError, INVALID + "its bytes are not a complete pickle", "bytes-garbage"),
    _case(lambda p: p.to(torch.float32), ValueError,
          INVALID + r"expected a 1-D uint8 tensor, got torch.float32 of shape", "payload-float"),
    _case(lambda p: p.reshape(1, -1), ValueError,
          INVALID + r"expected a 1-D uint8 tensor, got torch.uint8 of shape \(1, ", "payload-2d"),
    _case(lambda p: p.numpy().tobytes(), TypeError,
          "Linear.set_extra_state: expected the uint8 tensor written by get_extra_state, got "
          "bytes", "payload-bytes"),
    # the earlier layout, a torch.save archive, is still read (and checked) as before
    _case(_archive(lambda d: d["scaling_fwd"].update(scale_inv=d["scaling_fwd"]["scale_inv"] * 2)),
          ValueError, INVALID + "scaling_fwd.scale_inv: must be 1 / scale",
          "archive-scale-inv-not-reciprocal"),
    _case(_archive(lambda d: d.update(version=2)), ValueError,
          r"expected a dict with keys \['recipe', 'scaling_bwd', 'scaling_fwd'\], got "
          r"\['recipe', 'scaling_bwd', 'scaling_fwd', 'version'\]", "archive-extra-key"),
    _case(_archive(lambda d: d.update(recipe=print)), ValueError,
          INVALID + r"it refers to __builtin__.print, which an FP8 extra state never holds",
          "archive-unsafe"),
    _case(lambda p: _archive(lambda d: None)(p)[:200].clone(), ValueError,
          INVALID + r"its bytes are not a complete torch.save archive \(truncated or corrupted",
          "archive-truncated"),
]


def test_earlier_archive_layout_still_loads():
    """A payload this package wrote before it took TE's layout (a torch.save archive)
    loads: the same scales and histories."""
    m = _trained(te.Linear(16, 16, device=CPU))
    archive = _archive(lambda d: None)(m.get_extra_state())
    target = te.Linear(16, 16, device=CPU)
    target.set_extra_state(archive)
    assert_states_equal(fp8_state_snapshot([target]), fp8_state_snapshot([m]), "archive load")


def _fp8_meta_view(module):
    meta = module.fp8_meta
    return meta["recipe"], meta["scaling_fwd"], meta["scaling_bwd"]


@pytest.mark.parametrize("tamper, exc, match", PAYLOAD_CASES)
def test_set_extra_state_refuses_payload(tamper, exc, match):
    """``load_state_dict`` with one tampered payload: refused with a message that names
    the module class, and the module's FP8 state is left exactly as it was."""
    m = _trained(te.Linear(16, 16, device=CPU))
    state_dict = m.state_dict()
    state_dict["_extra_state"] = tamper(state_dict["_extra_state"])
    target = _trained(te.Linear(16, 16, device=CPU), steps=3)
    before_objects = _fp8_meta_view(target)
    before = fp8_state_snapshot([target])
    with pytest.raises(exc, match=match) as info:
        target.load_state_dict(state_dict)
    message = str(info.value)
    assert "weights_only=False" not in message and "weights_only` set to `False" not in message
    assert info.value.__cause__ is None             # no torch advice chained below ours
    assert all(a is b for a, b in zip(_fp8_meta_view(target), before_objects))
    assert_states_equal(fp8_state_snapshot([target]), before, "after a refused load")
    # and the refused module still trains
    _trained(target, steps=1)


def test_set_extra_state_error_names_the_module_name():
    m = _trained(te.Linear(16, 16, device=CPU))
    m.name = "decoder.0.fc1"
    with pytest.raises(ValueError, match=r"Linear\(name='decoder.0.fc1'\).set_extra_state: the "
                                         "FP8 extra state is not a valid payload"):
        m.set_extra_state(torch.zeros(8, dtype=torch.uint8))
