"""te.optimizers.FusedAdam and FusedSGD against torch.optim in float64, and FusedAdam's
master weights, narrow and FP8 states (within their stated bounds), bfloat16 remainders
(exact float32 masters), state_dict round-trips, capturable mode and FP8 parameters."""

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch.optimizers import FusedAdam, FusedSGD

F64 = torch.float64


def make_params(dtype, n=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(6, 5), (7,), (1,)][:n]
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def clone_params(params, dtype=None):
    return [p.detach().clone().to(dtype or p.dtype).requires_grad_() for p in params]


def set_grads(step, *param_lists):
    gen = torch.Generator().manual_seed(100 + step)
    for group in zip(*param_lists):
        g = torch.randn(group[0].shape, generator=gen, dtype=F64)
        for p in group:
            p.grad = g.to(p.dtype)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam-l2"])
def test_fused_adam_matches_torch_in_float64(adam_w_mode, weight_decay):
    ours = make_params(F64)
    theirs = clone_params(ours)
    opt = FusedAdam(ours, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay,
                    adam_w_mode=adam_w_mode)
    ref_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = ref_cls(theirs, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay)
    for step in range(6):
        set_grads(step, ours, theirs)
        opt.step()
        ref.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)
            assert opt.state[a]["exp_avg"].dtype == F64
    torch.testing.assert_close(opt.state[ours[0]]["exp_avg_sq"],
                               ref.state[theirs[0]]["exp_avg_sq"], rtol=1e-13, atol=0)


def test_fused_adam_without_bias_correction_in_float64():
    ours = make_params(F64)
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.05, bias_correction=False)
    p = [t.detach().clone() for t in ours]
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    for step in range(4):
        set_grads(step, ours)
        opt.step()
        for i, t in enumerate(ours):
            g = t.grad
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.999 * v[i] + 0.001 * g * g
            p[i] = p[i] - 1e-2 * (m[i] / (v[i].sqrt() + 1e-8) + 0.05 * p[i])
            torch.testing.assert_close(t.detach(), p[i], rtol=1e-13, atol=1e-14)


def test_master_weights_follow_the_float32_run_exactly():
    """bfloat16 params with float32 masters: the masters are bit for bit the params of
    the same run in float32, and each param is its master rounded."""
    low = make_params(torch.bfloat16)
    high = clone_params(low, torch.float32)
    opt = FusedAdam(low, lr=1e-2, weight_decay=0.1, master_weights=True)
    ref = FusedAdam(high, lr=1e-2, weight_decay=0.1)
    for step in range(4):
        set_grads(step, low)
        for a, b in zip(low, high):
            b.grad = a.grad.float()
        opt.step()
        ref.step()
        for a, b in zip(low, high):
            master = opt.state[a]["master_param"]
            assert master.dtype == torch.float32 and torch.equal(master, b.detach())
            assert torch.equal(a.detach(), master.to(torch.bfloat16))


def join(param, remainder):
    hi = param.detach().view(torch.int16).to(torch.int32)
    lo = remainder.to(torch.int32)
    hi = torch.where(lo < 0, hi - 1, hi)
    return ((hi << 16) | (lo & 0xFFFF)).view(torch.float32)


def test_param_remainders_rebuild_the_float32_master_exactly():
    full = make_params(torch.bfloat16)
    packed = clone_params(full)
    opt = FusedAdam(full, lr=1e-2, master_weights=True)
    opt_r = FusedAdam(packed, lr=1e-2, master_weights=True, store_param_remainders=True)
    for step in range(5):
        set_grads(step, full, packed)
        opt.step()
        opt_r.step()
        for a, b in zip(full, packed):
            rem = opt_r.state[b]["master_param"]
            assert rem.dtype == torch.int16
            assert torch.equal(join(b, rem), opt.state[a]["master_param"])
            assert torch.equal(opt_r.get_unscaled_state(b, "master_param"), rem)


@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, 2 ** -8), (torch.float16, 2 ** -11),
                                          (torch.uint8, 2 ** -4)], ids=["bf16", "fp16", "fp8"])
def test_narrow_states_stay_within_their_bound(dtype, bound):
    """Each stored moment is within ``bound`` (relative, plus FP8's subnormal spacing) of
    the value it stores, and training stays near the float32-state run."""
    ref_params = make_params(torch.float32)
    params = clone_params(ref_params)
    ref = FusedAdam(ref_params, lr=1e-2)
    opt = FusedAdam(params, lr=1e-2, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    for step in range(5):
        set_grads(step, ref_params, params)
        ref.step()
        opt.step()
    for p in params:
        for name in ("exp_avg", "exp_avg_sq"):
            value = opt.get_unscaled_state(p, name)
            assert value.dtype == torch.float32
            opt.set_scaled_state(p, name, value.clone())
            again = opt.get_unscaled_state(p, name)
            slack = value.abs().max() * 2 ** -10 / 448 if dtype == torch.uint8 else 0.0
            assert ((again - value).abs() <= bound * value.abs() + slack + 1e-30).all()
    if dtype == torch.uint8:
        assert isinstance(opt.state[params[0]]["exp_avg"], te.Float8Tensor)
    for a, b in zip(ref_params, params):
        assert (a - b).abs().max() <= 0.3 * 1e-2 * 5


@pytest.mark.parametrize("config", [
    {}, {"master_weights": True, "store_param_remainders": True},
    {"exp_avg_dtype": torch.uint8, "exp_avg_sq_dtype": torch.float16, "master_weights": True,
     "master_weight_dtype": torch.float16}], ids=["plain", "remainders", "scaled"])
def test_state_dict_round_trip_continues_bit_identically(config):
    dtype = torch.bfloat16 if config else torch.float32
    params = make_params(dtype)
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.1, **config)
    for step in range(3):
        set_grads(step, params)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert saved["param_groups"][0]["step"] == 3
    fresh_params = clone_params(params)
    fresh = FusedAdam(fresh_params, lr=1e-2, weight_decay=0.1, **config)
    fresh.load_state_dict(saved)
    for step in range(3, 6):
        set_grads(step, params, fresh_params)
        opt.step()
        fresh.step()
        for a, b in zip(params, fresh_params):
            assert torch.equal(a, b)
            for name in opt.state[a]:
                assert torch.equal(opt.get_unscaled_state(a, name),
                                   fresh.get_unscaled_state(b, name))


def test_capturable_matches_eager_and_keeps_device_scalars():
    params = make_params(torch.float32)
    cap_params = clone_params(params)
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.1)
    cap = FusedAdam(cap_params, lr=1e-2, weight_decay=0.1, capturable=True)
    for step in range(4):
        set_grads(step, params, cap_params)
        opt.step()
        cap.step()
        for a, b in zip(params, cap_params):
            # the bias corrections come from a float32 pow on the device (capturable)
            # instead of the host's float64 one: a few float32 ulps apart
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    group = cap.param_groups[0]
    assert isinstance(group["lr"], torch.Tensor) and isinstance(group["step"], torch.Tensor)
    assert group["step"].item() == 4


def test_capturable_skips_the_step_on_overflow():
    params = make_params(torch.float32)
    opt = FusedAdam(params, lr=1e-2, capturable=True)

    class Scaler:       # what FusedAdam reads of a torch.amp.GradScaler
        def __init__(self, found):
            self.found = found

        def _check_inf_per_device(self, optimizer):
            return {torch.device("cpu"): torch.tensor([self.found])}

        def _get_scale_async(self):
            return torch.tensor([4.0])

    set_grads(0, params)
    before = [p.detach().clone() for p in params]
    opt.step(grad_scaler=Scaler(1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert opt.param_groups[0]["step"].item() == 0
    grads = [p.grad.clone() for p in params]
    opt.step(grad_scaler=Scaler(0.0))
    assert opt.param_groups[0]["step"].item() == 1
    assert all(torch.equal(p.grad, g / 4) for p, g in zip(params, grads))
    assert not all(torch.equal(a, b) for a, b in zip(before, params))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_params_are_updated_in_place_from_their_masters(recipe):
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
    rec = DelayedScaling() if recipe == "delayed" else Float8CurrentScaling()
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=rec):
        layer = te.Linear(32, 32, device="cpu")
    weight = layer.weight
    assert isinstance(weight, te.Float8Tensor)
    opt = FusedAdam(layer.parameters(), lr=1e-2, master_weights=True)
    data = weight._data
    for _ in range(2):
        with te.autocast(enabled=True, recipe=rec):
            layer(torch.randn(16, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
    master = opt.state[weight]["master_param"]
    assert layer.weight is weight and weight._data is data
    # the FP8 weight is its master re-quantized (to within E4M3's rounding)
    err = (weight.dequantize() - master).abs()
    assert (err <= 2 ** -4 * master.abs() + master.abs().max() * 2 ** -9 / 448 + 1e-7).all()
    with pytest.raises(ValueError, match="quantized parameters .* need master_weights=True"):
        bad = FusedAdam([weight], lr=1e-2)
        weight.grad = torch.ones(weight.shape)
        bad.step()


def test_fused_adam_refuses_bad_arguments():
    params = make_params(torch.float32)
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdam(params, amsgrad=True)
    with pytest.raises(TypeError, match="exp_avg_dtype must be one of"):
        FusedAdam(params, exp_avg_dtype=torch.int8)
    with pytest.raises(ValueError, match="capturable=True needs exp_avg_dtype"):
        FusedAdam(params, capturable=True, exp_avg_dtype=torch.uint8)
    opt = FusedAdam(params, master_weights=True)
    with pytest.raises(TypeError, match="master_param must be a tensor of"):
        opt.set_scaled_state(params[0], "master_param", torch.zeros(6, 5, dtype=torch.int16))


@pytest.mark.parametrize("momentum, dampening, nesterov, weight_decay", [
    (0.0, 0.0, False, 0.0), (0.9, 0.0, False, 0.01), (0.9, 0.3, False, 0.0),
    (0.9, 0.0, True, 0.05)])
def test_fused_sgd_matches_torch_in_float64(momentum, dampening, nesterov, weight_decay):
    ours = make_params(F64)
    theirs = clone_params(ours)
    kw = dict(lr=0.1, momentum=momentum, dampening=dampening, nesterov=nesterov,
              weight_decay=weight_decay)
    opt, ref = FusedSGD(ours, **kw), torch.optim.SGD(theirs, **kw)
    for step in range(5):
        set_grads(step, ours, theirs)
        opt.step()
        ref.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-15)


def test_fused_sgd_weight_decay_after_momentum():
    ours = make_params(F64, n=1)
    opt = FusedSGD(ours, lr=0.1, momentum=0.9, weight_decay=0.1, wd_after_momentum=True)
    p, buf = ours[0].detach().clone(), None
    for step in range(3):
        set_grads(step, ours)
        g = ours[0].grad
        buf = g.clone() if buf is None else 0.9 * buf + g
        p = p - 0.1 * (buf + 0.1 * p)
        opt.step()
        torch.testing.assert_close(ours[0].detach(), p, rtol=1e-14, atol=1e-15)
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        FusedSGD(ours, lr=0.1, nesterov=True)
