"""te.ops: Sequential of operations against te.Linear / te.LayerNormMLP bit for bit,
the basic operations against float64 references, the TE operation contract
(op_forward / op_backward, fusion registries), Quantize, FP8 state in state_dict and
FP8 primary weights."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling)
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.ops.fuser import OperationFuser

from helpers import DEVICES

RECIPES = [pytest.param(DelayedScaling(amax_history_len=4), id="delayed"),
           pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(Float8BlockScaling(), id="block")]
HIDDEN, FFN, ROWS = 32, 64, 16


def _mlp_pair(device, activation, normalization, gated):
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(HIDDEN, FFN, device=device, activation=activation,
                          normalization=normalization)
    norm_cls = ops.LayerNorm if normalization == "LayerNorm" else ops.RMSNorm
    act = {"gelu": ops.GELU, "swiglu": ops.SwiGLU, "relu": ops.ReLU, "srelu": ops.SReLU,
           "geglu": ops.GEGLU}[activation]()
    seq = ops.Sequential(norm_cls(HIDDEN, device=device),
                         ops.Linear(HIDDEN, FFN * (2 if gated else 1), device=device), act,
                         ops.Linear(FFN, HIDDEN, device=device))
    with torch.no_grad():
        mlp.fc1_bias.uniform_(-0.5, 0.5)
        mlp.fc2_bias.uniform_(-0.5, 0.5)
        mlp.layer_norm_weight.uniform_(0.5, 1.5)
        seq[0].weight.copy_(mlp.layer_norm_weight)
        if normalization == "LayerNorm":
            seq[0].bias.copy_(mlp.layer_norm_bias)
        for i, name in ((1, "fc1"), (3, "fc2")):
            seq[i].weight.copy_(getattr(mlp, name + "_weight"))
            seq[i].bias.copy_(getattr(mlp, name + "_bias"))
    return mlp, seq


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation,normalization", [("gelu", "LayerNorm"),
                                                      ("swiglu", "RMSNorm"),
                                                      ("srelu", "LayerNorm")])
def test_norm_linear_act_linear_equals_layernorm_mlp(device, recipe, activation, normalization):
    """Same weights, three FP8 training steps: outputs, every gradient and every FP8
    scale and amax history equal te.LayerNormMLP's bit for bit."""
    gated = activation in ("swiglu", "geglu")
    mlp, seq = _mlp_pair(device, activation, normalization, gated)
    fc1, fc2 = seq[1].basic_ops[0], seq[3].basic_ops[0]
    for step in range(3):
        x = (torch.randn(ROWS, HIDDEN, device=device) * (step + 1)).requires_grad_()
        with te.autocast(recipe=recipe):       # one session each: each backward
            a = mlp(x)                          # updates its own session's modules
        with te.autocast(recipe=recipe):
            b = seq(x)
        assert torch.equal(a, b), step
        wanted = [x, mlp.layer_norm_weight, mlp.fc1_weight, mlp.fc1_bias, mlp.fc2_weight,
                  mlp.fc2_bias]
        got = [x, seq[0].weight, seq[1].weight, seq[1].bias, seq[3].weight, seq[3].bias]
        grad_out = torch.randn_like(a)
        for g, h in zip(torch.autograd.grad(a, wanted, grad_out),
                        torch.autograd.grad(b, got, grad_out)):
            assert torch.equal(g, h), step
        if recipe.delayed():
            for key in ("scaling_fwd", "scaling_bwd"):
                ref = mlp.fp8_meta[key]
                for field in ("scale", "amax_history"):
                    joined = torch.cat([getattr(fc1.fp8_meta[key], field),
                                        getattr(fc2.fp8_meta[key], field)], dim=-1)
                    assert torch.equal(getattr(ref, field), joined), (step, key, field)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_equals_te_linear(device, recipe, bias):
    """te.ops.Linear (and BasicLinear without bias) is te.Linear bit for bit."""
    torch.manual_seed(1)
    ref = te.Linear(HIDDEN, FFN, bias=bias, device=device)
    op = ops.Linear(HIDDEN, FFN, bias=bias, device=device) if bias else \
        ops.BasicLinear(HIDDEN, FFN, device=device)
    with torch.no_grad():
        op.weight.copy_(ref.weight)
        if bias:
            ref.bias.uniform_(-1, 1)
            op.bias.copy_(ref.bias)
    for _ in range(2):
        x = torch.randn(2, 8, HIDDEN, device=device, requires_grad=True)
        with te.autocast(recipe=recipe):
            y_ref = ref(x)
        with te.autocast(recipe=recipe):
            y = op(x)
        assert torch.equal(y_ref, y)
        params_ref = [x] + [p for p in (ref.weight, ref.bias) if p is not None]
        params = [x] + [p for p in (op.weight, getattr(op, "bias", None)) if p is not None]
        dy = torch.randn_like(y)
        for g, h in zip(torch.autograd.grad(y_ref, params_ref, dy),
                        torch.autograd.grad(y, params, dy)):
            assert torch.equal(g, h)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_is_close_to_float64(device, recipe):
    """An FP8 operation linear stays within FP8 rounding of the float64 product."""
    torch.manual_seed(2)
    op = ops.Linear(HIDDEN, FFN, device=device)
    x = torch.randn(ROWS, HIDDEN, device=device)
    with te.autocast(recipe=recipe):
        y = op(x)
    ref = x.double() @ op.weight.double().T + op.bias.double()
    rel = (y.double() - ref).norm() / ref.norm()
    assert 1e-4 < rel < 0.1     # FP8 rounding happened, and stayed small


def _ref_activation(name, x):
    a, b = x.chunk(2, -1) if name.endswith("glu") else (x, None)
    gelu = torch.nn.functional.gelu
    f = {"gelu": lambda t: gelu(t, approximate="tanh"),
         "relu": torch.relu, "srelu": lambda t: torch.relu(t) ** 2,
         "silu": torch.nn.functional.silu, "qgelu": lambda t: t * torch.sigmoid(1.702 * t),
         "geglu": lambda t: gelu(t, approximate="tanh"), "reglu": torch.relu,
         "swiglu": torch.nn.functional.silu, "sreglu": lambda t: torch.relu(t) ** 2,
         "glu": torch.sigmoid}[name]
    return f(a) if b is None else f(a) * b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,cls", [("gelu", ops.GELU), ("relu", ops.ReLU),
                                      ("srelu", ops.SReLU), ("silu", ops.SiLU),
                                      ("qgelu", ops.QGELU), ("geglu", ops.GEGLU),
                                      ("reglu", ops.ReGLU), ("swiglu", ops.SwiGLU),
                                      ("sreglu", ops.SReGLU), ("glu", ops.GLU)])
def test_activations_against_float64(device, name, cls):
    torch.manual_seed(3)
    x = torch.randn(8, 16, device=device, requires_grad=True)
    y = cls()(x)
    x64 = x.detach().double().requires_grad_()
    ref = _ref_activation(name, x64)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    dy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, dy)
    (gref,) = torch.autograd.grad(ref, x64, dy.double())
    torch.testing.assert_close(gx.double(), gref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_plumbing_operations_against_float64(device):
    """MakeExtraOutput -> RMSNorm -> ConstantScale -> Reshape -> Identity -> Reshape ->
    Bias -> AddExtraInput: outputs and gradients against the same math in float64."""
    torch.manual_seed(4)
    seq = ops.Sequential(ops.MakeExtraOutput(), ops.RMSNorm(HIDDEN, device=device),
                         ops.ConstantScale(0.5), ops.Reshape((-1, 4, HIDDEN // 4)),
                         ops.Identity(), ops.Reshape((-1, HIDDEN)),
                         ops.Bias(HIDDEN, device=device), ops.AddExtraInput())
    with torch.no_grad():
        seq[1].weight.uniform_(0.5, 1.5)
        seq[6].bias.uniform_(-1, 1)
    x = torch.randn(ROWS, HIDDEN, device=device, requires_grad=True)
    r = torch.randn(ROWS, HIDDEN, device=device, requires_grad=True)
    y, fork = seq(x, r)
    assert fork is x
    x64, r64 = (t.detach().double().requires_grad_() for t in (x, r))
    w64, b64 = (p.detach().double().requires_grad_() for p in (seq[1].weight, seq[6].bias))
    ref = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-5) * w64 * 0.5 + b64 + r64
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    dy, dfork = torch.randn_like(y), torch.randn_like(x)
    got = torch.autograd.grad((y, fork), (x, r, seq[1].weight, seq[6].bias), (dy, dfork))
    want = torch.autograd.grad((ref, x64), (x64, r64, w64, b64), (dy.double(), dfork.double()))
    for g, h in zip(got, want):
        torch.testing.assert_close(g.double(), h, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="extra inputs"):
        seq(x)


class _Square(ops.BasicOperation):
    """A user operation written TE's way."""

    def op_forward(self, ctx, input_, *, prev_op_grad_output_quantizer=None,
                   next_op_input_quantizer=None):
        ctx.save_for_backward(input_)
        return input_ * input_

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        return 2 * x * grad_output, ()


class _FusedSquareScale(ops.FusedOperation):
    calls = 0

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs,
                      prev_op_grad_output_quantizer, next_op_input_quantizer, basic_op_kwargs):
        type(self).calls += 1
        basic_op_ctxs[0].save_for_backward(input_)
        return input_ * input_ * self.basic_ops[1].scale, [(), ()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        (x,) = basic_op_ctxs[0].saved_tensors
        return 2 * x * self.basic_ops[1].scale * grad_output, [(), ()], [(), ()]


def _fuse_square_scale(ops_list, *, recipe):
    out, i = [], 0
    while i < len(ops_list):
        if (isinstance(ops_list[i], _Square) and i + 1 < len(ops_list)
                and isinstance(ops_list[i + 1], ops.ConstantScale)):
            out.append(_FusedSquareScale(ops_list[i:i + 2]))
            i += 2
        else:
            out.append(ops_list[i])
            i += 1
    return out


@pytest.mark.parametrize("register", ["none", "forward_backward"])
def test_user_operations_and_fusion_registry(monkeypatch, register):
    """A BasicOperation with op_forward/op_backward runs in a Sequential, between
    native operations; a registered fusion replaces it and its neighbour."""
    monkeypatch.setattr(OperationFuser, "forward_backward_fusion_functions", [])
    if register != "none":
        ops.register_forward_backward_fusion(_fuse_square_scale)
    _FusedSquareScale.calls = 0
    seq = ops.Sequential(ops.Identity(), _Square(), ops.ConstantScale(3.0),
                         ops.Bias(4, device="cpu"))
    x = torch.randn(5, 4, requires_grad=True)
    y = seq(x)
    assert torch.equal(y, x * x * 3.0 + seq[3].bias)
    (gx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx, 6 * x)
    assert _FusedSquareScale.calls == (1 if register != "none" else 0)
    with pytest.raises(TypeError, match="callable"):
        ops.register_forward_fusion(42)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_quantize_rounds_to_fp8_values(device, recipe):
    """Quantize's output is the FP8 cast of its input (values representable after
    scaling); outside an autocast it is the identity."""
    torch.manual_seed(5)
    op = ops.Quantize(forward=True, backward=True)
    x = torch.randn(ROWS, HIDDEN, device=device, requires_grad=True)
    assert torch.equal(op(x), x)
    with te.autocast(recipe=recipe):
        y = op(x)
    assert not torch.equal(y, x)
    torch.testing.assert_close(y, x, rtol=0.13, atol=1e-2)
    if not recipe.float8_block_scaling():
        # one scale for the whole tensor: 1 for a fresh delayed state, else fp8_max / amax
        scale = torch.tensor(1.0, device=device)
        if not recipe.delayed():
            scale = 448.0 / x.detach().abs().max()
            if recipe.fp8_quant_fwd_inp.power_2_scale:
                scale = torch.exp2(torch.floor(torch.log2(scale)))
        ref = (x.detach() * scale).to(torch.float8_e4m3fn).float() * (1.0 / scale)
        torch.testing.assert_close(y.detach(), ref, rtol=1e-6, atol=0)
    (g,) = torch.autograd.grad(y, x, torch.randn_like(y))
    assert g.shape == x.shape and torch.isfinite(g).all()


@pytest.mark.parametrize("device", DEVICES)
def test_extra_state_round_trip(device):
    """A BasicLinear's delayed-scaling state travels in state_dict's _extra_state."""
    torch.manual_seed(6)
    src = ops.Sequential(ops.Linear(HIDDEN, HIDDEN, device=device))
    recipe = DelayedScaling(amax_history_len=4)
    for _ in range(2):
        with te.autocast(recipe=recipe):
            src(torch.randn(ROWS, HIDDEN, device=device, requires_grad=True)).sum().backward()
    state = src.state_dict()
    assert "0.basic_ops.0._extra_state" in state and "0.weight" in state
    dst = ops.Sequential(ops.Linear(HIDDEN, HIDDEN, device=device))
    dst.load_state_dict(state)
    a, b = src[0].basic_ops[0].fp8_meta, dst[0].basic_ops[0].fp8_meta
    for key in ("scaling_fwd", "scaling_bwd"):
        assert torch.equal(a[key].scale, b[key].scale)
        assert torch.equal(a[key].amax_history, b[key].amax_history)
    x = torch.randn(ROWS, HIDDEN, device=device)
    with te.autocast(recipe=recipe):
        assert torch.equal(src(x), dst(x))


@pytest.mark.parametrize("device", DEVICES)
def test_quantized_model_init_weights(device):
    """Under te.quantized_model_init a BasicLinear's weight is an FP8 primary weight,
    and its FP8 forward equals te.Linear's built the same way."""
    recipe = Float8CurrentScaling()
    torch.manual_seed(7)
    with te.quantized_model_init(enabled=True, recipe=recipe):
        op = ops.BasicLinear(HIDDEN, FFN, device=device)
        ref = te.Linear(HIDDEN, FFN, bias=False, device=device)
    assert isinstance(op.weight, te.QuantizedTensor)
    with torch.no_grad():
        ref.weight.copy_(op.weight.dequantize())
    x = torch.randn(ROWS, HIDDEN, device=device)
    with te.autocast(recipe=recipe):
        assert torch.equal(op(x), ref(x))


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(NotImplementedError, match="tensor_parallel_mode"):
        ops.BasicLinear(4, 4, tensor_parallel_mode="column", device="cpu")
    with pytest.raises(ValueError, match="normalized_shape"):
        ops.LayerNorm(4, device="cpu")(torch.randn(2, 5))
    with pytest.raises(ValueError, match="even"):
        ops.SwiGLU()(torch.randn(2, 5))
    with pytest.raises(NotImplementedError, match="collectives"):
        ops.AllReduce(None)
    with pytest.raises(ValueError, match="basic_ops"):
        ops.FusedOperation([])
    op = ops.GroupedLinear(2, 16, 16, device="cpu")
    x = torch.randn(8, 16)
    with pytest.raises(ValueError, match="split_sizes must add up to the input's rows"):
        op(x, torch.tensor([4, 5]))
    with pytest.raises(ValueError, match="num_groups=2 integer counts"):
        op(x, torch.tensor([8.0, 0.0]))
    with pytest.raises(ValueError, match="extra inputs"):
        op(x)
    with pytest.raises(ValueError, match="one scale per row"):
        ops.GroupedLinear(2, 16, 16, scale_bias=True, device="cpu")(x, torch.tensor([4, 4]),
                                                                    torch.ones(3))
    with pytest.raises(ValueError, match="num_groups"):
        ops.GroupedLinear(0, 16, 16, device="cpu")
    with pytest.raises(ValueError, match="one value per row"):
        ops.ScaledSwiGLU()(torch.randn(4, 8), torch.ones(3))
    with pytest.raises(ValueError, match="divisible by 2 \\* glu_interleave_size = 16"):
        ops.SwiGLU(glu_interleave_size=8)(torch.randn(4, 24))
    with pytest.raises(ValueError, match="does not support activation recomputation"):
        ops.ScaledSwiGLU(activation_recompute_in_mlp=True)
    with pytest.raises(ValueError, match="beta1"):
        ops.SiTUGLU(beta1=0.0)


# ---- GroupedLinear and the scaled activations ----------------------------------------

GROUPS, SPLITS = 3, [16, 0, 32]


def _grouped_pair(device, bias):
    """A te.GroupedLinear and an ops.GroupedLinear with the same weights and biases."""
    torch.manual_seed(8)
    ref = te.GroupedLinear(GROUPS, HIDDEN, FFN, bias=bias, device=device)
    op = ops.GroupedLinear(GROUPS, HIDDEN, FFN, bias=bias, device=device)
    with torch.no_grad():
        for i in range(GROUPS):
            getattr(op, f"weight{i}").copy_(getattr(ref, f"weight{i}"))
            if bias:
                getattr(ref, f"bias{i}").uniform_(-1, 1)
                getattr(op, f"bias{i}").copy_(getattr(ref, f"bias{i}"))
    return ref, op


def _group_params(module, bias):
    names = [f"weight{i}" for i in range(GROUPS)] + ([f"bias{i}" for i in range(GROUPS)]
                                                      if bias else [])
    return [getattr(module, n) for n in names]


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_linear_equals_te_grouped_linear(device):
    """ops.GroupedLinear, split sizes as an extra tensor input (an empty group among
    them), is te.GroupedLinear bit for bit over two training steps, in high precision
    and in FP8 for each recipe, with or without bias: outputs, input and parameter
    gradients, and the delayed-scaling state."""
    delayed, current, block = (p.values[0] for p in RECIPES)
    for recipe, bias in ((None, True), (None, False), (delayed, True), (delayed, False),
                         (current, True), (block, False)):
        ref, op = _grouped_pair(device, bias)
        _train_grouped_pair(ref, op, recipe, bias, device)


def _train_grouped_pair(ref, op, recipe, bias, device):
    splits = torch.tensor(SPLITS, device=device)
    what = (type(recipe).__name__, bias)
    for step in range(2):
        x = torch.randn(2, sum(SPLITS) // 2, HIDDEN, device=device, requires_grad=True)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y_ref = ref(x, SPLITS)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = op(x, splits)
        assert torch.equal(y_ref, y), (what, step)
        dy = torch.randn_like(y)
        for g, h in zip(torch.autograd.grad(y_ref, [x] + _group_params(ref, bias), dy),
                        torch.autograd.grad(y, [x] + _group_params(op, bias), dy)):
            assert torch.equal(g, h), (what, step)
        if recipe is not None and recipe.delayed():
            for key in ("scaling_fwd", "scaling_bwd"):
                assert torch.equal(ref.fp8_meta[key].scale, op.fp8_meta[key].scale), what
                assert torch.equal(ref.fp8_meta[key].amax_history,
                                   op.fp8_meta[key].amax_history), what
    if recipe is not None and recipe.delayed():     # the groups ran FP8 and updated
        assert not torch.equal(op.fp8_meta["scaling_fwd"].scale,
                               torch.ones(2 * GROUPS, device=device))


def test_grouped_linear_state_dict_and_shared_weights():
    """TE's state_dict keys and order; a trained te.GroupedLinear's state_dict (FP8
    extra state included) loads into the operation, which then computes what the
    module computes; an operation built on ``meta`` runs on weights attached after
    construction (as Megatron-LM's fused expert MLP shares its module's weights), their
    gradients landing on the attached tensors."""
    ref, _ = _grouped_pair("cpu", True)
    recipe = DelayedScaling(amax_history_len=4)
    with te.autocast(recipe=recipe):
        ref(torch.randn(sum(SPLITS), HIDDEN), SPLITS).sum().backward()
    op = ops.GroupedLinear(GROUPS, HIDDEN, FFN, device="cpu")
    assert list(op.state_dict()) == ([f"weight{i}" for i in range(GROUPS)]
                                     + [f"bias{i}" for i in range(GROUPS)] + ["_extra_state"])
    result = op.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    for key in ("scaling_fwd", "scaling_bwd"):
        assert torch.equal(op.fp8_meta[key].amax_history, ref.fp8_meta[key].amax_history)
    x = torch.randn(sum(SPLITS), HIDDEN)
    with te.autocast(recipe=recipe):
        assert torch.equal(op(x, torch.tensor(SPLITS)), ref(x, SPLITS))
    shell = ops.GroupedLinear(GROUPS, HIDDEN, FFN, bias=False, device="meta")
    for i in range(GROUPS):
        setattr(shell, f"weight{i}", getattr(ref, f"weight{i}"))
        getattr(ref, f"weight{i}").grad = None
    shell(x, torch.tensor(SPLITS)).sum().backward()
    x64 = x.double()
    rows = torch.split(x64, SPLITS)
    want = torch.cat([r @ getattr(ref, f"weight{i}").double().T for i, r in enumerate(rows)])
    torch.testing.assert_close(shell(x, torch.tensor(SPLITS)).double(), want)
    assert ref.weight2.grad is not None and torch.equal(ref.weight1.grad, torch.zeros_like(ref.weight1))
    torch.testing.assert_close(ref.weight2.grad.double(), rows[2].sum(0).expand(FFN, -1),
                               rtol=1e-5, atol=1e-5)


def _deinterleave64(x, size):
    if size is None:
        return x
    n = x.shape[-1]
    return x.reshape(-1, n // (2 * size), 2, size).transpose(1, 2).reshape(x.shape)


def _glu64(kind, x):
    a, b = x.chunk(2, dim=-1)
    if kind == "swiglu":
        return torch.nn.functional.silu(a) * b
    if kind == "situglu":
        return 2.0 * torch.tanh(a / 2.0) * torch.sigmoid(a) * 10.0 * torch.tanh(b / 10.0)
    a, b = a.clamp(max=0.75), b.clamp(-0.75, 0.75)      # clamped, offset 0
    return a * torch.sigmoid(1.702 * a) * b


GLU_CASES = [("swiglu", None, True), ("swiglu", 8, True), ("situglu", 8, True),
             ("clamped", 8, True), ("srelu", None, True), ("swiglu", 8, False),
             ("situglu", 8, False), ("clamped", 8, False)]


def _glu_op(kind, interleave, scaled):
    kwargs = {"situglu": dict(beta1=2.0, beta2=10.0),
              "clamped": dict(limit=0.75, glu_linear_offset=0.0)}.get(kind, {})
    if not scaled:
        cls = {"swiglu": ops.SwiGLU, "situglu": ops.SiTUGLU, "clamped": ops.ClampedSwiGLU}[kind]
        return cls(glu_interleave_size=interleave, **kwargs)
    if kind == "srelu":
        return ops.ScaledSReLU()
    cls = {"swiglu": ops.ScaledSwiGLU, "situglu": ops.ScaledSiTUGLU,
           "clamped": ops.ScaledClampedQGeGLU}[kind]
    return cls(interleave, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_glu_variants_against_float64(device):
    """SwiGLU / SiTUGLU / ClampedSwiGLU (TE's block-interleaved layout, a linear offset
    of 0) and their Scaled forms (and ScaledSReLU), whose per-row scales are an extra
    input: outputs and the gradients of input and scales against float64."""
    torch.manual_seed(9)
    for kind, interleave, scaled in GLU_CASES:
        op = _glu_op(kind, interleave, scaled)
        x = torch.randn(3, 5, 32, device=device, requires_grad=True)
        s = torch.rand(3, 5, device=device, requires_grad=True)
        y = op(x, s) if scaled else op(x)
        x64, s64 = (t.detach().double().requires_grad_() for t in (x, s))
        act = torch.relu(x64) ** 2 if kind == "srelu" else \
            _glu64(kind, _deinterleave64(x64, interleave))
        ref = act * s64.unsqueeze(-1) if scaled else act
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
        dy = torch.randn_like(y)
        got = torch.autograd.grad(y, [x, s] if scaled else [x], dy)
        want = torch.autograd.grad(ref, [x64, s64] if scaled else [x64], dy.double())
        for g, h in zip(got, want):
            torch.testing.assert_close(g.double(), h, rtol=1e-5, atol=1e-6)


def test_scaled_swiglu_is_swiglu_times_scales():
    """ScaledSwiGLU computes Megatron-LM's unfused expert activation, ``SwiGLU(x) *
    probs[:, None]`` cast back to x's dtype, bit for bit (gradients too); one scale for
    every row (Megatron's shared expert) is SwiGLU itself."""
    torch.manual_seed(10)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(24, 64, dtype=dtype, requires_grad=True)
        probs = torch.rand(24, requires_grad=True)
        y = ops.ScaledSwiGLU()(x, probs)
        ref = (ops.SwiGLU()(x) * probs.unsqueeze(-1)).to(dtype)
        assert torch.equal(y, ref), dtype
        dy = torch.randn_like(y)
        for g, h in zip(torch.autograd.grad(y, (x, probs), dy),
                        torch.autograd.grad(ref, (x, probs), dy)):
            assert torch.equal(g, h), dtype
        assert torch.equal(ops.ScaledSwiGLU()(x, torch.ones(1)), ops.SwiGLU()(x)), dtype


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_mlp_against_float64(device):
    """GroupedLinear -> ScaledSwiGLU -> GroupedLinear(scale_bias=True) in one
    Sequential, fed split sizes and router probabilities as extra inputs (TE's grouped
    expert MLP): outputs and the gradients of input, probabilities and every parameter
    against float64."""
    torch.manual_seed(11)
    fc1 = ops.GroupedLinear(GROUPS, HIDDEN, 2 * FFN, device=device)
    fc2 = ops.GroupedLinear(GROUPS, FFN, HIDDEN, device=device, scale_bias=True)
    with torch.no_grad():
        for p in list(fc1.parameters()) + list(fc2.parameters()):
            p.uniform_(-0.5, 0.5)
    mlp = ops.Sequential(fc1, ops.ScaledSwiGLU(), fc2)
    splits = torch.tensor(SPLITS, device=device)
    x = torch.randn(sum(SPLITS), HIDDEN, device=device, requires_grad=True)
    probs = torch.rand(sum(SPLITS), device=device, requires_grad=True)
    y = mlp(x, splits, probs, splits, probs)
    params = [x, probs] + list(fc1.parameters()) + list(fc2.parameters())
    p64 = [t.detach().double().requires_grad_() for t in params]
    x64, probs64, w1, b1, w2, b2 = p64[0], p64[1], p64[2:5], p64[5:8], p64[8:11], p64[11:14]
    outs = []
    for i, (rows, pr) in enumerate(zip(torch.split(x64, SPLITS), torch.split(probs64, SPLITS))):
        h = _glu64("swiglu", rows @ w1[i].T + b1[i]) * pr.unsqueeze(-1)
        outs.append(h @ w2[i].T + b2[i] * pr.unsqueeze(-1))
    ref = torch.cat(outs)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    for g, h in zip(torch.autograd.grad(y, params, dy), torch.autograd.grad(ref, p64, dy.double())):
        torch.testing.assert_close(g.double(), h, rtol=1e-4, atol=1e-4)

