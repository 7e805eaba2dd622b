"""Megatron Core imports te.optimizers (FusedAdam, FusedSGD, multi_tensor_applier and
the multi-tensor operations) without its fallback warnings, builds its Adam from
FusedAdam, and clips gradients on the CPU with multi_tensor_l2norm and
multi_tensor_scale_tensor."""

import subprocess
import sys

import torch

from megatron_helpers import megatron_on_cpu, needs_megatron  # noqa: F401
from transformer_engine.pytorch import optimizers as te_opt

pytestmark = needs_megatron

_IMPORT = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import megatron.core.optimizer as mopt
    from megatron.core.optimizer import clip_grads, optimizer
import transformer_engine.pytorch.optimizers as te_opt
print("WARN", [str(w.message) for w in caught if "Falling back" in str(w.message)
               or "local implementations" in str(w.message)])
print("ADAM", mopt.Adam is te_opt.FusedAdam, mopt.SGD is te_opt.FusedSGD,
      mopt.USING_PYTORCH_OPTIMIZER)
print("CLIP", clip_grads.l2_norm_impl is te_opt.multi_tensor_l2norm,
      clip_grads.multi_tensor_scale_tensor_impl is te_opt.multi_tensor_scale_tensor,
      clip_grads.multi_tensor_applier is te_opt.multi_tensor_applier,
      optimizer.multi_tensor_scale_impl is te_opt.multi_tensor_scale)
"""


def test_megatron_imports_te_optimizers_without_fallback_warnings():
    done = subprocess.run([sys.executable, "-c", _IMPORT], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines()
                 if line.split(" ", 1)[0] in ("WARN", "ADAM", "CLIP"))
    assert lines["WARN"] == "[]", done.stdout + done.stderr[-2000:]
    assert lines["ADAM"] == "True True False"
    assert lines["CLIP"] == "True True True True"


class _CudaStringsOnCpu:
    """``torch`` as clip_grads.py sees it in this test: its tensors asked for on "cuda"
    are made on the CPU (Megatron allocates its norm and overflow buffers there)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _cpu(kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return kwargs

    def zeros(self, *args, **kwargs):
        return torch.zeros(*args, **self._cpu(kwargs))

    def tensor(self, *args, **kwargs):
        return torch.tensor(*args, **self._cpu(kwargs))


def test_megatron_clips_gradients_with_te_multi_tensor_ops(megatron_on_cpu, monkeypatch):  # noqa: F811
    from megatron.core import parallel_state
    from megatron.core.optimizer import clip_grads

    calls = []

    def counted(op):
        def run(*args):
            calls.append(op.__name__)
            return op(*args)
        return run

    monkeypatch.setattr(clip_grads, "torch", _CudaStringsOnCpu())
    monkeypatch.setattr(clip_grads, "l2_norm_impl", counted(te_opt.multi_tensor_l2norm))
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_tensor_impl",
                        counted(te_opt.multi_tensor_scale_tensor))
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(8, 4), (5,), (3, 3)]]
    for p in params:
        p.decoupled_grad = torch.randn(p.shape, generator=gen) * 3
    grads = [p.decoupled_grad.clone() for p in params]
    group = parallel_state.get_model_parallel_group()
    norm = clip_grads.get_grad_norm_fp32([p.decoupled_grad for p in params],
                                         grad_stats_parallel_group=group)
    want = torch.stack([g.double().norm() for g in grads]).norm()
    torch.testing.assert_close(torch.as_tensor(norm).double().reshape(()), want, rtol=1e-6,
                               atol=0)
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm,
                                            use_decoupled_grad=True)
    coeff = min(1.0, 1.0 / (float(norm) + 1e-6))
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.decoupled_grad, g * coeff, rtol=1e-6, atol=0)
    assert calls == ["multi_tensor_l2norm", "multi_tensor_scale_tensor"]
    clipped = torch.stack([p.decoupled_grad.double().norm() for p in params]).norm()
    assert abs(clipped.item() - 1.0) < 1e-5


def test_fused_adam_takes_megatrons_precision_aware_arguments():
    """The keyword arguments Megatron's get_megatron_optimizer passes its Adam with
    use_precision_aware_optimizer (bfloat16 moments, float32 master weights managed by
    the optimizer, decoupled grads, remainders), and its init_state_fn's one-argument
    ``initialize_state(p)``; the step then updates the bfloat16 params from the masters.
    (Megatron's optimizer wrappers allocate on CUDA, so the factory itself needs a GPU.)"""
    import megatron.core.optimizer as mopt
    params = [torch.nn.Parameter(torch.randn(6, 4).bfloat16()) for _ in range(2)]
    opt = mopt.Adam(params=[{"params": params}], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95),
                    eps=1e-8, capturable=False, adam_w_mode=True, exp_avg_dtype=torch.bfloat16,
                    exp_avg_sq_dtype=torch.bfloat16, master_weights=True,
                    use_decoupled_grad=True, master_weight_dtype=torch.float32,
                    store_param_remainders=True)
    assert isinstance(opt, te_opt.FusedAdam)
    for p in params:
        opt.initialize_state(p)
        p.decoupled_grad = torch.randn(p.shape)
    before = [p.detach().clone() for p in params]
    opt.step()
    for p, b in zip(params, before):
        assert opt.state[p]["master_param"].dtype == torch.int16
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
        assert not torch.equal(p.detach(), b)
