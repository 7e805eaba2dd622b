"""The host cost of the eager FP8 path, pinned by its machine-independent proxy: the
aten ops that te.Linear's forward + backward dispatches under ``te.autocast`` (on the
CPU, with the default kernel configuration), counted below autograd with a
``TorchDispatchMode``. A change that adds ops to every FP8 linear, or to the work
each autocast does on exit, fails here; one that removes some should lower the
ceilings. ``benchmarks/bench_host.py`` times the same steps.
"""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.kernel_config import KernelConfig, kernel_config

# (ops per te.Linear forward + backward, ops per step outside the modules: the autocast's
# forward and backward updates), measured, plus a margin of 2.
# Per-step counts depend on how the torch release decomposes the update's ops: torch
# 2.13 (CI) dispatches 83 / 6, torch 2.11 (the GPU machine) 91 / 10. (Each delayed
# update leaves a column with no recorded amax alone, as TE's update kernel does:
# 10 ops a step more than before that rule.)
_PER_STEP = {"2.11": (91, 10)}.get(".".join(torch.__version__.split(".")[:2]), (83, 6))
CEILINGS = {
    "delayed": (DelayedScaling, 49 + 2, _PER_STEP[0] + 2),
    "current": (Float8CurrentScaling, 79 + 2, _PER_STEP[1] + 2),
}


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _ops_per_step(n_modules: int, recipe=None, nn_linear: bool = False) -> list:
    """The ops of one training step (after two warm-up steps) of ``n_modules`` 64x64
    linears on 16 tokens: forward, ``sum().backward()``, inside ``te.autocast(recipe)``
    unless ``recipe`` is None. Gradients are None at the start of every step."""
    torch.manual_seed(0)
    make = torch.nn.Linear if nn_linear else te.Linear
    model = torch.nn.Sequential(*[make(64, 64, device="cpu") for _ in range(n_modules)])
    x = torch.randn(16, 64, requires_grad=True)
    leaves = [x] + list(model.parameters())

    def step():
        for t in leaves:
            t.grad = None
        if recipe is None:
            model(x).sum().backward()
        else:
            with te.autocast(recipe=recipe):
                model(x).sum().backward()

    with kernel_config(**dataclasses.asdict(KernelConfig())):
        step()
        step()
        with _OpCounter() as counter:
            step()
    return counter.ops


@pytest.mark.parametrize("recipe", list(CEILINGS))
def test_fp8_linear_op_count_stays_under_its_ceiling(recipe):
    """Per module from the difference of a 3-module and a 1-module model; the rest of
    the 1-module step is the per-step work."""
    recipe_cls, per_module_ceiling, per_step_ceiling = CEILINGS[recipe]
    one = len(_ops_per_step(1, recipe_cls()))
    three = len(_ops_per_step(3, recipe_cls()))
    per_module = (three - one) / 2
    per_step = one - per_module
    assert per_module <= per_module_ceiling, (
        f"{recipe}: a te.Linear forward + backward in FP8 dispatches {per_module} aten ops, "
        f"more than the ceiling {per_module_ceiling}")
    assert per_step <= per_step_ceiling, (
        f"{recipe}: the per-step FP8 work (autocast updates) dispatches {per_step} aten ops, "
        f"more than the ceiling {per_step_ceiling}")
    # the count is real: an FP8 linear casts and multiplies
    assert per_module > 20


def test_te_linear_outside_autocast_dispatches_what_nn_linear_does():
    """Outside FP8, te.Linear is torch's linear: the same ops, none added."""
    assert _ops_per_step(2) == _ops_per_step(2, nn_linear=True)


def test_threads_that_ran_fp8_add_no_work_to_later_steps():
    """Each thread that ran an FP8 autocast keeps a non-finite-amax counter; the check
    after an update reads only the updating thread's, so finished threads cost later
    steps nothing."""
    import threading

    before = _ops_per_step(1, DelayedScaling())

    def run():
        with te.autocast(recipe=Float8CurrentScaling()):
            te.Linear(16, 16, device="cpu")(torch.randn(16, 16))

    for _ in range(6):
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    assert _ops_per_step(1, DelayedScaling()) == before
