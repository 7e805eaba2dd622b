"""Block-scaled FP8 primary weights (``te.quantized_model_init(recipe=
Float8BlockScaling())``): Float8BlockwiseQTensor parameters quantized block by block
as the float64 reference quantizes them, read as they are by the FP8 GEMMs, written
by optimizers and ``load_state_dict`` by quantizing, recomputed with bit for bit, and
run only under a Float8BlockScaling autocast."""

import copy
import io

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling)
from transformer_engine.pytorch import block_scaling
from transformer_engine.pytorch.tensor import (Float8BlockQuantizer, Float8BlockwiseQTensor,
                                               QuantizedTensor)
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (
    rebuild_float8_blockwise_tensor)
import helpers
from block_references import quantize_ref
from helpers import DEVICES, REENTRANT, assert_runs_equal, capture, te_modules

E4M3 = torch.float8_e4m3fn
BLOCK_2D = Float8BlockScaling()
BLOCK_1D = Float8BlockScaling(w_block_scaling_dim=1)
RECIPES = [pytest.param(BLOCK_2D, id="w-128x128"), pytest.param(BLOCK_1D, id="w-1x128")]

_MODULES = {
    "Linear": (lambda d: te.Linear(160, 48, device=d), ["weight"]),
    "LayerNormMLP": (lambda d: te.LayerNormMLP(64, 144, device=d), ["fc1_weight", "fc2_weight"]),
    "GroupedLinear": (lambda d: te.GroupedLinear(2, 64, 48, device=d), ["weight0", "weight1"]),
}


def _bits(t):
    return t.view(torch.uint8)


def _block_rows(recipe):
    return 128 if recipe.w_block_scaling_dim == 2 else 1


@pytest.mark.parametrize("kind", list(_MODULES))
@pytest.mark.parametrize("recipe", RECIPES)
def test_weights_are_block_quantized_from_their_initial_value(kind, recipe):
    """Drawn as the high-precision weight is, then quantized in the recipe's weight
    blocks (rowwise); the columnwise copy is the transpose (128x128) or the value
    quantized anew along the other dimension (1x128); the initial value is kept."""
    build, fp8_names = _MODULES[kind]
    torch.manual_seed(3)
    plain = build("cpu")
    torch.manual_seed(3)
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        model = build("cpu")
    reference = dict(plain.named_parameters())
    assert list(dict(model.named_parameters())) == list(reference)
    rows = _block_rows(recipe)
    for name, p in model.named_parameters():
        ref = reference[name].detach()
        if name not in fp8_names:
            assert not isinstance(p, QuantizedTensor) and torch.equal(p, ref)
            continue
        assert isinstance(p, Float8BlockwiseQTensor) and p.requires_grad and p.shape == ref.shape
        assert p._fp8_dtype == E4M3 and p._is_2D_scaled == (rows == 128)
        values, _ = quantize_ref(ref, E4M3, rows)
        assert torch.equal(p.plain().double(), values), name
        col_values, _ = quantize_ref(ref.t(), E4M3, rows)
        col = p.block_operands(True)[1]
        assert torch.equal(col.dequantize(torch.float64), col_values), name
        assert torch.equal(p.get_high_precision_init_val(), ref)


@pytest.mark.parametrize("device", DEVICES)
def test_training_equals_high_precision_weights_holding_the_same_values(device):
    """With 128x128 weights, an FP8 weight and a high-precision weight holding its
    dequantized value give the same forward and gradients bit for bit (casting the
    dequantized value again gives back the same blocks); the FP8 one is read, not
    cast."""
    recipe = BLOCK_2D
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=recipe):
        fp8 = te.LayerNormMLP(128, 256, device=device)
    plain = te.LayerNormMLP(128, 256, device=device)
    with torch.no_grad():
        for p, q in zip(fp8.parameters(), plain.parameters()):
            q.copy_(p.plain() if isinstance(p, QuantizedTensor) else p)
    x = torch.randn(24, 128, device=device)
    outs = []
    for module in (fp8, plain):
        xi = x.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            y = module(xi)
        y.backward(torch.ones_like(y))
        outs.append([y, xi.grad] + [p.grad for p in module.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_gemms_read_the_weights_own_blocks():
    """A 1x128 weight's forward reads its rowwise copy and its dgrad the columnwise
    copy (quantized from the original value, not from the rowwise one)."""
    recipe = BLOCK_1D
    with te.quantized_model_init(recipe=recipe):
        lin = te.Linear(256, 64, bias=False, device="cpu")
    x = torch.randn(16, 256, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = lin(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    row, col = lin.weight.block_operands(True)
    xq, _ = block_scaling.cast_for_role(recipe, "fwd_inp", x.detach(), E4M3, True, False)
    dyq, _ = block_scaling.cast_for_role(recipe, "bwd_grad", dy, E4M3, True, False)
    assert torch.equal(y, block_scaling.emulated_block_gemm(xq, row, torch.float32))
    assert torch.equal(x.grad, block_scaling.emulated_block_gemm(dyq, col, torch.float32))


@pytest.mark.parametrize("recipe", RECIPES)
def test_optimizer_step_quantizes_into_the_same_weight(recipe):
    with te.quantized_model_init(recipe=recipe):
        lin = te.Linear(160, 48, device="cpu")
    w = lin.weight
    storage = {k: v for k, v in w._storage().items()}
    with te.autocast(recipe=recipe):
        lin(torch.randn(16, 160)).pow(2).mean().backward()
    expected = w.plain() - 0.5 * w.grad
    torch.optim.SGD(lin.parameters(), lr=0.5).step()
    assert lin.weight is w and all(w._storage()[k] is v for k, v in storage.items())
    rows = _block_rows(recipe)
    assert torch.equal(w.plain().double(), quantize_ref(expected, E4M3, rows)[0])
    assert torch.equal(w.block_operands(True)[1].dequantize(torch.float64),
                       quantize_ref(expected.t(), E4M3, rows)[0])


def _model(recipe, seed, device="cpu"):
    torch.manual_seed(seed)
    with te.quantized_model_init(recipe=recipe):
        return torch.nn.ModuleList([te.LayerNormMLP(64, 128, device=device),
                                    te.Linear(64, 64, device=device)])


def _run(model, recipe, checkpointed, use_reentrant, steps=2, device="cpu"):
    calls = []

    def forward(x):
        calls.append(1)
        with te.autocast(recipe=recipe):
            return model[1](model[0](x))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record = []
    for step in range(steps):
        g = torch.Generator(device=device).manual_seed(step)
        x = torch.randn(16, 64, generator=g, device=device).requires_grad_()
        y = helpers.maybe_checkpoint(checkpointed, use_reentrant, forward, x)
        loss = y.float().pow(2).mean()
        loss.backward()
        record.append(capture(loss, [x], model.parameters(), te_modules(model)))
        opt.step()
        opt.zero_grad()
    weights = [p.plain() for p in model.parameters() if isinstance(p, QuantizedTensor)]
    return record, weights, len(calls)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_checkpointed_training_equals_training_without_it(device, use_reentrant):
    model = _model(BLOCK_2D, 0, device)
    twin = copy.deepcopy(model)
    ref, ref_w, ref_calls = _run(model, BLOCK_2D, False, use_reentrant, device=device)
    got, got_w, got_calls = _run(twin, BLOCK_2D, True, use_reentrant, device=device)
    assert (ref_calls, got_calls) == (2, 4)          # each checkpointed step recomputed
    assert_runs_equal(ref, got)
    assert len(ref_w) == 3 and all(torch.equal(a, b) for a, b in zip(ref_w, got_w))


def test_state_dict_round_trips_bit_for_bit():
    model = _model(BLOCK_1D, 0)
    _run(model, BLOCK_1D, False, False)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals([rebuild_float8_blockwise_tensor,
                                           Float8BlockQuantizer]):
        saved = torch.load(buffer, weights_only=True)
    assert isinstance(saved["1.weight"], Float8BlockwiseQTensor)
    fresh = _model(BLOCK_1D, 99)
    fresh.load_state_dict(saved)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert type(p) is type(q), name
        if isinstance(p, QuantizedTensor):
            for k, v in p._storage().items():
                assert torch.equal(v.view(torch.uint8) if v.dtype == E4M3 else v,
                                   q._storage()[k].view(torch.uint8) if v.dtype == E4M3
                                   else q._storage()[k]), (name, k)
        else:
            assert torch.equal(p, q), name


def test_state_dicts_move_between_fp8_and_high_precision_modules():
    with te.quantized_model_init(recipe=BLOCK_2D):
        fp8_lin = te.Linear(160, 48, device="cpu")
    plain = te.Linear(160, 48, device="cpu")
    plain.load_state_dict(fp8_lin.state_dict())
    assert not isinstance(plain.weight, QuantizedTensor)
    assert torch.equal(plain.weight, fp8_lin.weight.plain())
    source = te.Linear(160, 48, device="cpu")
    fp8_lin.load_state_dict(source.state_dict())
    assert isinstance(fp8_lin.weight, Float8BlockwiseQTensor)
    assert torch.equal(fp8_lin.weight.plain().double(),
                       quantize_ref(source.weight.detach(), E4M3, 128)[0])


def test_micro_batches_read_the_fp8_weight():
    with te.quantized_model_init(recipe=BLOCK_2D):
        lin = te.Linear(64, 64, device="cpu")
    x = torch.randn(16, 64)
    with te.autocast(recipe=BLOCK_2D):
        outs = [lin(x, is_first_microbatch=first) for first in (None, True, False)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert "fp8_weight_cache" not in lin.fp8_meta


@pytest.mark.parametrize("tokens", [0, 1, 24])
@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
def test_zero_and_few_tokens(kind, tokens):
    """TE's zero-token case (and one token): outputs of the right shape, gradients of
    the right shape (zero weight gradients for no tokens)."""
    with te.quantized_model_init(recipe=BLOCK_2D):
        module = (te.Linear(64, 256, device="cpu") if kind == "Linear"
                  else te.GroupedLinear(3, 64, 256, device="cpu"))
    x = torch.randn(tokens, 64, requires_grad=True)
    kwargs = {} if kind == "Linear" else {"m_splits": [tokens, 0, 0]}
    with te.autocast(recipe=BLOCK_2D):
        y = module(x, **kwargs)
    y.sum().backward()
    assert y.shape == (tokens, 256) and x.grad.shape == x.shape
    weight = module.weight if kind == "Linear" else module.weight0
    assert weight.grad.shape == weight.shape
    if tokens == 0:
        assert torch.count_nonzero(weight.grad) == 0


@pytest.mark.parametrize("autocast_recipe, weight_recipe", [
    (DelayedScaling(), BLOCK_2D), (Float8CurrentScaling(), BLOCK_1D),
    (BLOCK_2D, Float8CurrentScaling()), (BLOCK_2D, DelayedScaling())])
def test_a_weight_runs_only_under_its_recipe_class(autocast_recipe, weight_recipe):
    """TE's weight/recipe correspondence check, its message."""
    with te.quantized_model_init(enabled=True, recipe=weight_recipe):
        lin = te.Linear(32, 32, device="cpu")
    expected = type(weight_recipe).__name__
    with pytest.raises(RuntimeError, match=f"Recipe mismatch for 'weight': tensor supports "
                                           f"recipe {expected}, but got "
                                           f"{type(autocast_recipe).__name__}"):
        with te.autocast(enabled=True, recipe=autocast_recipe):
            lin(torch.randn(32, 32))
    with te.autocast(enabled=True, recipe=weight_recipe):        # its own class runs
        assert lin(torch.randn(32, 32)).shape == (32, 32)


def test_views_and_copies():
    with te.quantized_model_init(recipe=BLOCK_2D):
        lin = te.Linear(160, 48, device="cpu")
    w = lin.weight
    value = w.plain()
    assert torch.equal(w.t() + 0, value.t()) and torch.equal(w[3] * 1, value[3])
    alias, clone = w.detach(), w.clone()
    assert alias._rowwise_data is w._rowwise_data
    assert clone._rowwise_data is not w._rowwise_data and torch.equal(clone.plain(), value)
    with torch.no_grad():
        w[:, :8] = 0.5                             # through a view: the whole re-quantized
    expected = value.clone()
    expected[:, :8] = 0.5
    assert torch.equal(w.plain().double(), quantize_ref(expected, E4M3, 128)[0])
    twin = copy.deepcopy(lin)
    assert isinstance(twin.weight, Float8BlockwiseQTensor)
    assert torch.equal(twin.weight.plain(), w.plain())
    assert twin.weight._rowwise_data is not w._rowwise_data
    assert "Float8BlockwiseQTensor(fp8_dtype=torch.float8_e4m3fn, blocks=128x128" in repr(w)


def test_quantizer_and_tensor_check_their_arguments():
    with pytest.raises(ValueError, match="block_scaling_dim must be 1 .* or 2 .* got 3"):
        Float8BlockQuantizer(E4M3, block_scaling_dim=3)
    with pytest.raises(TypeError, match="fp8_dtype must be one of"):
        Float8BlockQuantizer(torch.float16)
    q = Float8BlockQuantizer(E4M3)
    with pytest.raises(ValueError, match=r"block-scaled tensors are 2-D \[rows, cols\], got "
                                         r"shape \(4, 4, 4\)"):
        q.quantize(torch.zeros(4, 4, 4))
    row, col = q.quantize(torch.randn(8, 16))
    with pytest.raises(TypeError, match=r"columnwise must be None or a BlockScaledData of "
                                        r"shape \(16, 8\)"):
        Float8BlockwiseQTensor(row, row, torch.float32, q)
    with pytest.raises(TypeError, match="nominal dtype"):
        Float8BlockwiseQTensor(row, col, torch.int32, q)


@helpers.cuda_fp8
def test_graphed_steps_read_the_updated_fp8_weights():
    """The optimizer writes the block weights in place between replays; a graphed step
    equals the eager step bit for bit."""
    recipe = BLOCK_2D
    torch.manual_seed(11)
    with te.quantized_model_init(recipe=recipe):
        model = te.LayerNormMLP(128, 256, params_dtype=torch.bfloat16, device="cuda")
    eager_model = copy.deepcopy(model)

    def eager(m, x):
        with te.autocast(recipe=recipe):
            return m(x)

    ref = helpers.train_steps(eager_model, (32, 128), eager, 3)
    te.make_graphed_callables(model, (helpers.cuda_inputs((32, 128), 0).requires_grad_(),),
                              enabled=True, recipe=recipe)
    got = helpers.train_steps(model, (32, 128), lambda m, x: m(x), 3)
    assert_runs_equal(ref, got)
    for a, b in zip(eager_model.parameters(), model.parameters()):
        assert torch.equal(a.plain() if isinstance(a, QuantizedTensor) else a,
                           b.plain() if isinstance(b, QuantizedTensor) else b)
