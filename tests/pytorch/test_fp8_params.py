"""FP8 primary weights (``te.quantized_model_init`` / ``te.fp8_model_init``): modules
built under it hold their GEMM weights as Float8Tensor parameters, which the FP8
GEMMs read as they are, optimizers and ``load_state_dict`` write by quantizing, and
``te.checkpoint`` recomputes with bit for bit."""

import copy
import io
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling)
from transformer_engine.pytorch.module.params import materialize_device
from transformer_engine.pytorch.tensor import Float8Tensor, QuantizedTensor
from transformer_engine.pytorch.tensor.float8_tensor import rebuild_float8_tensor
import helpers
from helpers import DEVICES, REENTRANT, assert_runs_equal, capture, te_modules
from references import cast_scale, deq

RECIPES = [pytest.param(DelayedScaling(amax_history_len=4), id="delayed"),
           pytest.param(Float8CurrentScaling(), id="current")]
E4M3_MAX = 448.0


def _reference_cast(value, scale):
    """``value`` cast to E4M3 with ``scale``, in plain torch ops (saturating)."""
    return torch.clamp(value.float() * scale, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _init_scale(recipe, value):
    """The scale an FP8 primary weight is first quantized with: the fresh delayed scale
    (1.0), or the value's own current scale."""
    if recipe.delayed():
        return torch.ones((), dtype=torch.float32, device=value.device)
    return torch.tensor(E4M3_MAX, device=value.device) / value.abs().max().float()


def _bits(t):
    return t.view(torch.uint8)


# name -> (constructor, the FP8 weights' names)
_MODULES = {
    "Linear": (lambda d: te.Linear(32, 48, device=d), ["weight"]),
    "LayerNormLinear": (lambda d: te.LayerNormLinear(32, 48, device=d), ["weight"]),
    "LayerNormMLP": (lambda d: te.LayerNormMLP(32, 64, device=d), ["fc1_weight", "fc2_weight"]),
    "GroupedLinear": (lambda d: te.GroupedLinear(2, 32, 48, device=d), ["weight0", "weight1"]),
    "TransformerLayer": (lambda d: te.TransformerLayer(32, 64, 2, hidden_dropout=0.0,
                                                       attention_dropout=0.0, device=d),
                         ["self_attention.layernorm_qkv.query_weight",
                          "self_attention.layernorm_qkv.key_weight",
                          "self_attention.layernorm_qkv.value_weight",
                          "self_attention.proj.weight", "layernorm_mlp.fc1_weight",
                          "layernorm_mlp.fc2_weight"]),
}


@pytest.mark.parametrize("kind", list(_MODULES))
@pytest.mark.parametrize("recipe", RECIPES)
def test_gemm_weights_are_fp8_parameters_of_their_initial_value(kind, recipe):
    build, fp8_names = _MODULES[kind]
    torch.manual_seed(3)
    plain = build("cpu")
    torch.manual_seed(3)
    with te.quantized_model_init(enabled=True, recipe=recipe,
                                 preserve_high_precision_init_val=True):
        model = build("cpu")
    named = dict(model.named_parameters())
    reference = dict(plain.named_parameters())
    assert list(named) == list(reference), "parameter names and order change"
    for name, p in named.items():
        ref = reference[name]
        assert isinstance(p, torch.nn.Parameter) and p.shape == ref.shape
        if name not in fp8_names:
            assert not isinstance(p, QuantizedTensor) and torch.equal(p, ref), name
            continue
        assert isinstance(p, Float8Tensor) and p.dtype == torch.float32 and p.requires_grad
        assert p.fp8_dtype == torch.float8_e4m3fn
        # drawn as the high-precision weight is, then quantized once
        scale = _init_scale(recipe, ref.detach())
        assert torch.equal(_bits(p._data), _bits(_reference_cast(ref.detach(), scale))), name
        assert torch.equal(p._scale_inv, (1 / scale).reshape(1))
        init = p.get_high_precision_init_val()
        assert init.device.type == "cpu" and torch.equal(init, ref.detach())
        p.clear_high_precision_init_val()       # TE's: the value goes, the accessors stay
        assert p.get_high_precision_init_val() is None
    if recipe.delayed():
        # the initial value records no amax (a client may write the weights later)
        for module in te_modules(model):
            assert module.fp8_meta["scaling_fwd"].amax_history.count_nonzero() == 0


def test_a_weight_written_after_construction_sets_the_first_scale():
    """Megatron's CPU initialization builds the modules with an init function that
    leaves the weight uninitialized and writes it afterwards through ``.data.copy_``:
    only the written value's amax reaches the history, and the first update scales
    the weight by it."""
    with te.quantized_model_init(recipe=DelayedScaling(amax_history_len=4)):
        lin = te.Linear(32, 32, init_method=lambda w: w.fill_(1e30), device="cpu")
    value = torch.randn(32, 32) * 0.02
    lin.weight.data.copy_(value)
    state = lin.fp8_meta["scaling_fwd"]
    assert torch.equal(state.amax_history[0, 1], value.abs().max())
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        lin(torch.randn(16, 32)).sum().backward()
    assert torch.equal(state.scale[1], E4M3_MAX / value.abs().max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_gemms_read_the_weights_own_bits(device, recipe):
    with te.quantized_model_init(recipe=recipe):
        lin = te.Linear(64, 32, device=device)
    w = lin.weight
    x = torch.randn(16, 64, device=device, requires_grad=True)
    x_scale = cast_scale(lin, recipe, True, 0, x)       # (the autocast's exit updates it)
    with te.autocast(recipe=recipe):
        y = lin(x)
    dy = torch.randn_like(y)
    dy_scale = cast_scale(lin, recipe, False, 0, dy)
    y.backward(dy)
    w64 = w._data.double() * w._scale_inv.double()
    x64, dy64 = deq(x, x_scale, torch.float8_e4m3fn), deq(dy, dy_scale, torch.float8_e5m2)
    # products of FP8 values are exact; only the sums round: in float32 on the CPU, in
    # Hopper's FP8 accumulation (about 2^-13 relative, measured up to 1.0e-4) on CUDA
    bound = 1e-5 if device == "cpu" else 2.0 ** -11
    for got, ref in ((y, x64 @ w64.t() + lin.bias.double()), (x.grad, dy64 @ w64),
                     (w.grad, dy64.t() @ x64)):
        err = (got.double() - ref).abs().max() / ref.abs().max()
        assert err < bound, err
    assert type(w.grad) is torch.Tensor and w.grad.dtype == torch.float32


@pytest.mark.parametrize("recipe", RECIPES)
def test_outside_fp8_the_dequantized_weight_is_used(recipe):
    with te.quantized_model_init(recipe=recipe):
        lin = te.Linear(32, 16, device="cpu")
    x = torch.randn(8, 32, requires_grad=True)
    y = lin(x)
    w = lin.weight.plain()
    assert torch.equal(y, F.linear(x, w, lin.bias))
    y.sum().backward()
    assert torch.equal(lin.weight.grad, torch.ones(8, 16).t() @ x.detach())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_optimizer_step_quantizes_into_the_same_weight(device, recipe):
    with te.quantized_model_init(recipe=recipe):
        lin = te.Linear(32, 32, device=device)
    w = lin.weight
    data, scale_inv = w._data, w._scale_inv
    x = torch.randn(16, 32, device=device)
    with te.autocast(recipe=recipe):
        y = lin(x)
    y.pow(2).mean().backward()          # the autocast's exit updated the delayed scales
    before = w.plain()
    expected = before - 0.5 * w.grad
    scale = (lin.fp8_meta["scaling_fwd"].scale[1] if recipe.delayed()
             else torch.tensor(E4M3_MAX, device=device) / expected.abs().max())
    live_before = lin.fp8_meta["scaling_fwd"].amax_history[0, 1].clone() \
        if recipe.delayed() else None
    torch.optim.SGD(lin.parameters(), lr=0.5).step()
    assert lin.weight is w and w._data is data and w._scale_inv is scale_inv
    assert torch.equal(_bits(w._data), _bits(_reference_cast(expected, scale)))
    assert torch.equal(w._scale_inv, (1 / scale).reshape(1))
    if recipe.delayed():
        live = lin.fp8_meta["scaling_fwd"].amax_history[0, 1]
        assert torch.equal(live, torch.maximum(live_before, expected.abs().max()))


def test_adam_keeps_fp8_weights_and_high_precision_state():
    with te.quantized_model_init():
        mlp = te.LayerNormMLP(32, 64, device="cpu")
    opt = torch.optim.AdamW(mlp.parameters(), lr=1e-2)
    losses = []
    x = torch.randn(16, 32)
    for _ in range(5):
        with te.autocast(recipe=DelayedScaling()):
            loss = mlp(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert isinstance(mlp.fc1_weight, Float8Tensor) and isinstance(mlp.fc2_weight, Float8Tensor)
    state = opt.state[mlp.fc1_weight]
    assert type(state["exp_avg"]) is torch.Tensor and state["exp_avg"].dtype == torch.float32
    assert losses[-1] < losses[0]


def _model(recipe, seed, device="cpu"):
    torch.manual_seed(seed)
    with te.quantized_model_init(recipe=recipe):
        return torch.nn.ModuleList([te.LayerNormMLP(32, 64, device=device),
                                    te.Linear(32, 32, device=device)])


def _run(model, recipe, checkpointed, use_reentrant, steps=3, device="cpu"):
    """SGD steps with the FP8 autocast opened inside the (maybe checkpointed) forward."""
    def forward(x):
        with te.autocast(recipe=recipe):
            return model[1](model[0](x))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record = []
    for step in range(steps):
        g = torch.Generator(device=device).manual_seed(step)
        x = torch.randn(16, 32, generator=g, device=device).requires_grad_()
        y = helpers.maybe_checkpoint(checkpointed, use_reentrant, forward, x)
        loss = y.float().pow(2).mean()
        loss.backward()
        record.append(capture(loss, [x], model.parameters(), te_modules(model)))
        record.append([(p._data.clone(), p._scale_inv.clone())
                       for p in model.parameters() if isinstance(p, Float8Tensor)])
        opt.step()
        opt.zero_grad()
    return record


def _assert_records_equal(a, b):
    assert_runs_equal(a[0::2], b[0::2])
    for weights_a, weights_b in zip(a[1::2], b[1::2]):
        for (d1, s1), (d2, s2) in zip(weights_a, weights_b):
            assert torch.equal(_bits(d1), _bits(d2)) and torch.equal(s1, s2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpointed_training_equals_training_without_it(device, use_reentrant, recipe):
    model = _model(recipe, 0, device)
    twin = copy.deepcopy(model)
    ref = _run(model, recipe, False, use_reentrant, device=device)
    got = _run(twin, recipe, True, use_reentrant, device=device)
    _assert_records_equal(ref, got)


def test_a_deep_copy_quantizes_with_its_own_state():
    model = _model(DelayedScaling(), 0)
    twin = copy.deepcopy(model)
    w = twin[1].weight
    assert w._quantizer._module() is twin[1]
    before = model[1].fp8_meta["scaling_fwd"].amax_history.clone()
    live = twin[1].fp8_meta["scaling_fwd"].amax_history[0, 1].clone()
    written = w.plain() * 3.0
    with torch.no_grad():
        w.mul_(3.0)
    assert torch.equal(model[1].fp8_meta["scaling_fwd"].amax_history, before)
    # the amax of the value written (before its rounding to FP8)
    assert torch.equal(twin[1].fp8_meta["scaling_fwd"].amax_history[0, 1],
                       torch.maximum(live, written.abs().max()))


@pytest.mark.parametrize("recipe", RECIPES)
def test_state_dict_round_trips_bit_for_bit(recipe):
    model = _model(recipe, 0)
    _run(model, recipe, False, False, steps=2)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals([rebuild_float8_tensor]):
        saved = torch.load(buffer, weights_only=True)
    assert isinstance(saved["1.weight"], Float8Tensor)
    fresh = _model(recipe, 99)
    fresh.load_state_dict(saved)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert type(p) is type(q), name
        if isinstance(p, Float8Tensor):
            assert torch.equal(_bits(p._data), _bits(q._data)) and torch.equal(
                p._scale_inv, q._scale_inv), name
        else:
            assert torch.equal(p, q), name
    _assert_records_equal(_run(model, recipe, False, False, steps=2),
                          _run(fresh, recipe, False, False, steps=2))


def test_state_dicts_move_between_fp8_and_high_precision_modules():
    recipe = DelayedScaling()
    with te.quantized_model_init(recipe=recipe):
        fp8_lin = te.Linear(32, 32, device="cpu")
    plain = te.Linear(32, 32, device="cpu")
    plain.load_state_dict(fp8_lin.state_dict())
    assert not isinstance(plain.weight, QuantizedTensor)
    assert torch.equal(plain.weight, fp8_lin.weight.plain())
    # the other way: the value quantized with the module's scale for the weight
    source = te.Linear(32, 32, device="cpu")
    fp8_lin.load_state_dict(source.state_dict())
    assert isinstance(fp8_lin.weight, Float8Tensor)
    scale = fp8_lin.fp8_meta["scaling_fwd"].scale[1]
    assert torch.equal(_bits(fp8_lin.weight._data),
                       _bits(_reference_cast(source.weight.detach(), scale)))


@pytest.mark.parametrize("recipe", RECIPES)
def test_micro_batches_read_the_fp8_weight(recipe):
    with te.quantized_model_init(recipe=recipe):
        lin = te.Linear(32, 32, device="cpu")
    x = torch.randn(16, 32)
    with te.autocast(recipe=recipe):        # one autocast: the same scales throughout
        outs = [lin(x, is_first_microbatch=first) for first in (None, True, False)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert "fp8_weight_cache" not in lin.fp8_meta


def test_deferred_initialization_makes_fp8_weights():
    device = materialize_device()           # where reset_parameters() materializes
    torch.manual_seed(5)
    with te.quantized_model_init():
        eager = te.Linear(32, 48, device=device)
    with te.quantized_model_init():
        deferred = te.Linear(32, 48, device="meta")
    assert not isinstance(deferred.weight, QuantizedTensor) and deferred.weight.is_meta
    torch.manual_seed(5)
    deferred.reset_parameters()
    assert isinstance(deferred.weight, Float8Tensor)
    assert deferred.weight.device.type == device.type
    assert torch.equal(_bits(deferred.weight._data), _bits(eager.weight._data))
    # a second reset draws a new value into the same parameter
    w = deferred.weight
    deferred.reset_parameters()
    assert deferred.weight is w
    assert not torch.equal(_bits(w._data), _bits(eager.weight._data))


def test_bfloat16_params_give_bfloat16_gradients():
    with te.quantized_model_init():
        lin = te.Linear(32, 32, params_dtype=torch.bfloat16, device="cpu")
    assert isinstance(lin.weight, Float8Tensor) and lin.weight.dtype == torch.bfloat16
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    with te.autocast():
        lin(x).float().sum().backward()
    assert lin.weight.grad.dtype == torch.bfloat16


def test_a_weight_runs_only_under_its_recipe_class():
    """TE's check: a per-tensor FP8 weight in a block-scaling autocast (or a delayed
    one under current scaling) raises TE's "Recipe mismatch" error naming the weight."""
    with te.quantized_model_init():
        lin = te.Linear(128, 128, device="cpu")
    for recipe in (Float8BlockScaling(), Float8CurrentScaling()):
        with pytest.raises(RuntimeError, match=r"Recipe mismatch for 'weight': tensor supports "
                           r"recipe DelayedScaling, but got " + type(recipe).__name__):
            with te.autocast(recipe=recipe):
                lin(torch.randn(16, 128))


def test_the_context_is_per_thread_and_restored_on_error():
    with pytest.raises(RuntimeError, match="inside"):
        with te.quantized_model_init():
            assert te.FP8GlobalStateManager.with_fp8_parameters()
            seen = []
            thread = threading.Thread(
                target=lambda: seen.append(te.FP8GlobalStateManager.with_fp8_parameters()))
            thread.start()
            thread.join()
            assert seen == [False]
            raise RuntimeError("inside")
    assert not te.FP8GlobalStateManager.with_fp8_parameters()
    assert not isinstance(te.Linear(16, 16, device="cpu").weight, QuantizedTensor)


# ---- Float8Tensor as a torch tensor ---------------------------------------------------------

def _tensor():
    with te.quantized_model_init(recipe=Float8CurrentScaling()):
        return te.Linear(16, 8, device="cpu").weight


def test_reads_see_the_dequantized_value():
    w = _tensor()
    value = w.plain()
    assert type(w + 1) is torch.Tensor and torch.equal(w + 1, value + 1)
    assert type(torch.zeros_like(w)) is torch.Tensor
    assert torch.equal(torch.cat([w, w]), torch.cat([value, value]))
    assert type(w.dequantize()) is torch.Tensor and torch.equal(w.dequantize(), value)
    assert "Float8Tensor(fp8_dtype=torch.float8_e4m3fn" in repr(w)


def test_conversions_keep_the_fp8_data():
    with te.quantized_model_init():
        lin = te.Linear(16, 8, device="cpu")
    w = lin.weight
    converted = w.to(torch.bfloat16)
    assert type(converted) is Float8Tensor and converted.dtype == torch.bfloat16
    assert converted._data is not w._data and torch.equal(_bits(converted._data), _bits(w._data))
    assert torch.equal(converted.plain(), w.plain().bfloat16())
    lin.to(torch.bfloat16)          # a module conversion keeps FP8 weights (and no other copy)
    assert type(lin.weight) is Float8Tensor and lin.weight.dtype == torch.bfloat16
    assert lin.weight._quantizer._module() is lin and lin.bias.dtype == torch.bfloat16
    with pytest.raises(RuntimeError):
        lin.weight.untyped_storage().data_ptr()     # the wrapper allocates no storage
    assert type(w.to(torch.int32)) is torch.Tensor
    assert "Float8Tensor(fp8_dtype=torch.float8_e4m3fn" in repr(w)


def test_aliases_share_and_copies_copy_the_fp8_bits():
    w = _tensor()
    alias, clone = w.detach(), w.clone()
    assert alias._data is w._data and type(w.data) is Float8Tensor
    assert clone._data is not w._data and torch.equal(_bits(clone._data), _bits(w._data))
    with torch.no_grad():
        w.data.mul_(2.0)                     # through .data: the parameter changes
    assert torch.equal(w.plain(), alias.plain()) and not torch.equal(w.plain(), clone.plain())
    other = Float8Tensor(torch.zeros(8, 16, dtype=torch.float8_e4m3fn),
                         torch.tensor([0.5]), torch.float32)
    other.copy_(w)
    assert torch.equal(_bits(other._data), _bits(w._data)) and torch.equal(
        other._scale_inv, w._scale_inv)


def test_bare_quantized_tensor_and_float8_tensor_checks_its_parts():
    """TE's ``QuantizedTensor(shape, dtype)``: metadata only, no views, no value."""
    with pytest.raises(TypeError, match=r"QuantizedTensor\(shape, dtype\): shape must be"):
        QuantizedTensor(torch.zeros(2))
    qt = QuantizedTensor((128, 64), torch.bfloat16, device="cpu")
    assert (qt.shape, qt.dtype, qt.device, qt.stride()) == ((128, 64), torch.bfloat16,
                                                              torch.device("cpu"), (64, 1))
    for view in (lambda: qt.view(-1), lambda: qt[0], lambda: qt.t()):
        with pytest.raises(NotImplementedError,
                           match="QuantizedTensor class does not support tensor views"):
            view()
    with pytest.raises(NotImplementedError, match="QuantizedTensor holds no data"):
        qt + 1
    with pytest.raises(TypeError, match="data must be a tensor of an FP8 dtype"):
        Float8Tensor(torch.zeros(2), torch.ones(1), torch.float32)
    with pytest.raises(TypeError, match="scale_inv must be a one-element float32 tensor"):
        Float8Tensor(torch.zeros(2, dtype=torch.float8_e4m3fn), torch.ones(2), torch.float32)
    with pytest.raises(TypeError, match="nominal dtype"):
        Float8Tensor(torch.zeros(2, dtype=torch.float8_e4m3fn), torch.ones(1), torch.int32)


@helpers.cuda_fp8
@pytest.mark.parametrize("recipe", RECIPES)
def test_graphed_steps_read_the_updated_fp8_weights(recipe):
    """The optimizer writes the FP8 weights in place between replays; a graphed step
    equals the eager step bit for bit, the weights too."""
    torch.manual_seed(11)
    with te.quantized_model_init(recipe=recipe):
        model = te.LayerNormMLP(64, 128, params_dtype=torch.bfloat16, device="cuda")
    eager_model = copy.deepcopy(model)

    def eager(m, x):
        with te.autocast(recipe=recipe):
            return m(x)

    ref = helpers.train_steps(eager_model, (32, 64), eager, 4)
    te.make_graphed_callables(model, (helpers.cuda_inputs((32, 64), 0).requires_grad_(),),
                              enabled=True, recipe=recipe)
    got = helpers.train_steps(model, (32, 64), lambda m, x: m(x), 4)
    assert_runs_equal(ref, got)
    for a, b in zip(eager_model.parameters(), model.parameters()):
        if isinstance(a, Float8Tensor):
            assert torch.equal(_bits(a._data), _bits(b._data))
            assert torch.equal(a._scale_inv, b._scale_inv)


def test_views_read_and_write_through_to_the_fp8_data():
    """A view (t(), a row, a slice, split) reads as that view of the value; a write
    into it changes that part, and the whole weight is quantized again with the
    module's scale for it (the rest re-encoded, as after any write)."""
    recipe = DelayedScaling()
    with te.quantized_model_init(recipe=recipe):
        lin = te.Linear(32, 16, device="cpu")
    w = lin.weight
    value = w.plain()
    assert torch.equal(w.t() + 0, value.t()) and torch.equal(w[3] * 1, value[3])
    top, bottom = torch.split(w, 8)
    assert torch.equal(bottom + 0, value[8:])
    scale = lin.fp8_meta["scaling_fwd"].scale[1]
    with torch.no_grad():
        w[:, :8] *= 0                         # through a slice
        bottom.fill_(0.125)                   # through one output of split
    expected = value.clone()
    expected[:, :8] *= 0                     # (-0 for the negative entries)
    expected[8:] = 0.125
    assert torch.equal(_bits(w._data), _bits(_reference_cast(expected, scale)))
    with torch.no_grad():                               # views keep reading the weight
        assert torch.equal(bottom + 0, w.plain()[8:])
    # a view dequantizes and quantizes as the tensor does
    assert torch.equal(w[2].dequantize(), w.plain()[2])
    w[2].quantize_(torch.full((32,), 0.25))
    assert torch.equal(w.plain()[2], torch.full((32,), 0.25))
    # and gradients flow through a view, as through any op
    x = torch.randn(4, 32)
    F.linear(x, w).sum().backward()
    assert torch.equal(w.grad, torch.ones(4, 16).t() @ x)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
def test_new_history_length_warns_that_the_weight_quantizer_changes(kind):
    """A module with FP8 primary weights run under a delayed-scaling recipe with another
    history length than its model-init recipe quantizes its weights with the resized
    state from then on: TE's "Quantizer is being updated" UserWarning; the same length
    (other settings) and a module without FP8 weights stay silent."""
    make, _ = _MODULES[kind]
    with te.quantized_model_init(recipe=DelayedScaling(amax_history_len=16)):
        module = make("cpu")
    plain = make("cpu")
    x = torch.randn(32, 32)

    def run(m, recipe):
        with te.autocast(recipe=recipe):
            return m(x, [32, 0]) if kind == "GroupedLinear" else m(x)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(module, DelayedScaling(amax_history_len=16, margin=1))
        run(plain, DelayedScaling(amax_history_len=16))
        run(plain, DelayedScaling(amax_history_len=1))
    with pytest.warns(UserWarning, match="Quantizer is being updated, this may affect model "
                                         "behavior"):
        run(module, DelayedScaling(amax_history_len=1))
    assert module.fp8_meta["scaling_fwd"].amax_history.shape[0] == 1


# ---- sharded master weights (tensor.utils: Megatron's --fp8-param-gather) ------------------
# Across real ranks, through Megatron's distributed optimizer: test_megatron_optimizers.py.

def _trained_bf16_linear(recipe):
    """A te.Linear with a bfloat16 FP8 weight after one training step's forward and
    backward (delayed scales set from the first amaxes; the transpose cached)."""
    torch.manual_seed(7)
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        lin = te.Linear(32, 48, params_dtype=torch.bfloat16, device="cpu")
    with te.autocast(recipe=recipe):
        x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
        lin(x).float().pow(2).mean().backward()
    assert lin.weight._transpose is not None
    return lin


@pytest.mark.parametrize("recipe", RECIPES)
def test_master_shards_quantize_as_a_whole_write(recipe):
    """A float32 master weight written through the sharded path (the weight's bits moved
    into a uint8 buffer, the master quantized in two shards for delayed scaling, one
    for current scaling, the transpose made after the "all-gather") gives the bits,
    ``scale_inv`` and FP8 state of writing the master, rounded to bfloat16, into the
    weight at once, and the plain cast of that value; both modules then train alike."""
    from transformer_engine.pytorch.tensor import utils as tu

    ref, lin = _trained_bf16_linear(recipe), _trained_bf16_linear(recipe)
    w = lin.weight
    master = w.get_high_precision_init_val().float() + 0.01 * torch.randn(48, 32)
    buffer = torch.zeros(8 + w.numel(), dtype=torch.uint8)
    tu.replace_raw_data(w, buffer[8:].view(w.shape))
    with torch.no_grad():
        ref.weight.copy_(master.bfloat16())
    flat = master.reshape(-1)
    cut = 700 if recipe.delayed() else 0
    shards = [(flat[:cut], 0), (flat[cut:], cut)] if cut else [(flat, 0)]
    for shard, start in shards:
        tu.cast_master_weights_to_fp8([w], [shard], [start], None,
                                      manual_post_all_gather_processing=True)
    assert w._transpose_invalid and w.get_high_precision_init_val() is None
    tu.post_all_gather_processing([w])
    assert not w._transpose_invalid
    assert torch.equal(_bits(w._transpose), _bits(w._data).t())
    scale = (lin.fp8_meta["scaling_fwd"].scale[1] if recipe.delayed()
             else torch.tensor(E4M3_MAX) / master.bfloat16().abs().max().float())
    assert torch.equal(_bits(w._data), _bits(_reference_cast(master.bfloat16(), scale)))
    assert torch.equal(buffer[8:], _bits(w._data).reshape(-1))
    assert torch.equal(_bits(w._data), _bits(ref.weight._data))
    assert torch.equal(w._scale_inv, ref.weight._scale_inv)
    helpers.assert_states_equal(helpers.fp8_state_snapshot([ref]),
                                helpers.fp8_state_snapshot([lin]))
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    outs = []
    for m in (ref, lin):
        xi = x.detach().clone().requires_grad_()
        with te.autocast(recipe=recipe):
            y = m(xi)
        y.float().pow(2).mean().backward()
        outs.append((y, xi.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_raw_data_moves_into_the_buffer_and_stays_there():
    """``replace_raw_data``: the weight's value is kept, its bits live in the buffer from
    then on (a write into the buffer is a write into the weight, and its cached transpose
    goes stale), and wrong buffers or weight kinds are refused."""
    from transformer_engine.pytorch.tensor import utils as tu

    lin = _trained_bf16_linear(DelayedScaling(amax_history_len=4))
    w = lin.weight
    value, transpose = w.plain(), w._transpose
    buffer = torch.zeros(w.numel(), dtype=torch.uint8)
    tu.replace_raw_data(w, buffer.view(w.shape))
    assert w._data.data_ptr() == buffer.data_ptr() and torch.equal(w.plain(), value)
    assert w._transpose is transpose and not w._transpose_invalid
    buffer[:32] = 0x38                      # E4M3 1.0: row 0 of the weight
    assert torch.equal(w.plain()[0], torch.full((32,), float(w._scale_inv), dtype=w.dtype))
    assert w._transpose_invalid
    with pytest.raises(ValueError, match="data types of raw data don't match"):
        tu.replace_raw_data(w, torch.zeros(w.numel(), dtype=torch.float32))
    with pytest.raises(ValueError, match=f"contiguous tensor of {w.numel()} elements"):
        tu.replace_raw_data(w, torch.zeros(w.numel() - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"end_offset \(1537\) exceeds model_weight numel"):
        tu.quantize_master_weights([w], [torch.zeros(2)], [1535], None)
    with pytest.raises(NotImplementedError, match="fsdp_shard_model_weights"):
        tu.quantize_master_weights([w], [torch.zeros(2)], [0], None, [torch.zeros(2)])
    with te.quantized_model_init(recipe=Float8BlockScaling()):
        block = te.Linear(128, 128, device="cpu").weight
    for call in (lambda: tu.replace_raw_data(block, torch.zeros(block.numel(), dtype=torch.uint8)),
                 lambda: tu.quantize_master_weights([block], [None], [None], None),
                 lambda: tu.post_all_gather_processing(block)):
        with pytest.raises(NotImplementedError,
                           match=r"Float8BlockwiseQTensor weights are not supported.*"
                                 r"--fp8-param-gather.*per-tensor"):
            call()
    with pytest.raises(TypeError, match="tensor must be a Float8Tensor"):
        tu.replace_raw_data(torch.zeros(4), torch.zeros(4, dtype=torch.uint8))
