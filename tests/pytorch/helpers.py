"""What the tests share: device parametrization, the FP8 state of modules and its bitwise
comparison, one record per training step and one run-equality assertion, the
thread's FP8 autocast / recompute state, and small te.Linear stacks.

A "run" is a list of `Step` records, one per training step, made by `capture` right
after the step's backward; `assert_runs_equal` compares two runs bit for bit (the
checkpointed run against the same run without checkpointing, a graphed run against an
eager one, ...).
"""

import contextlib
import copy
import gc
from typing import NamedTuple, Optional

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch import distributed
from transformer_engine.pytorch import global_state as te_global_state
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager, _AutocastState, graph_warm_up
from transformer_engine.pytorch.scaling import ScalingState
from transformer_engine.pytorch.utils import flatten_nested

# ---- parametrization ------------------------------------------------------------------------

HAS_CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
cuda_fp8 = pytest.mark.skipif(not HAS_CUDA_FP8,
                              reason="needs a CUDA GPU with FP8 (compute capability 8.9+)")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_fp8)]
REENTRANT = [pytest.param(True, id="reentrant"), pytest.param(False, id="non-reentrant")]

RECIPE = DelayedScaling(amax_history_len=4)
"""The small delayed-scaling recipe most tests train with."""

STASH_KEY = "global_fp8_buffer_pos_fwd_recompute"
"""The fp8_meta key a module gets once a recompute stash was taken of it."""


# ---- FP8 state of modules ---------------------------------------------------------------------

class FP8State(NamedTuple):
    """Copies of one module's forward and backward scaling state (None: not made yet)."""

    fwd: Optional[ScalingState]
    bwd: Optional[ScalingState]


def fp8_state_snapshot(modules) -> list:
    """One `FP8State` per module, copied (later updates do not reach it)."""
    return [FP8State(fwd=copy.deepcopy(m.fp8_meta["scaling_fwd"]),
                     bwd=copy.deepcopy(m.fp8_meta["scaling_bwd"])) for m in modules]


def te_modules(model) -> list:
    """The TE modules (those with FP8 state) in ``model``'s tree, in tree order."""
    return [m for m in model.modules() if isinstance(m, te.TransformerEngineBaseModule)]


def assert_states_equal(a, b, what=""):
    """Two lists of `FP8State` are equal bit for bit: scale, scale_inv, amax history."""
    assert len(a) == len(b), f"{what}: {len(a)} modules vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        for direction in ("fwd", "bwd"):
            u, v = getattr(x, direction), getattr(y, direction)
            where = f"{what}: module {i} {direction}"
            if u is None or v is None:
                assert u is None and v is None, f"{where}: one state is None"
                continue
            for field in ("scale", "scale_inv", "amax_history"):
                s, t = getattr(u, field), getattr(v, field)
                assert torch.equal(s, t), f"{where} {field} differs:\n{s}\nvs\n{t}"


def assert_tensors_equal(a, b, what=""):
    """Two lists of tensors (or None) are equal bit for bit, None where the other is."""
    assert len(a) == len(b), f"{what}: {len(a)} tensors vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, f"{what}[{i}]: one is None"
            continue
        assert torch.equal(x, y), f"{what}[{i}] differs: {describe_difference(x, y)}"


def describe_difference(x: torch.Tensor, y: torch.Tensor) -> str:
    """How two tensors of one shape differ: how many elements, the NaNs in each, the
    first differing element (index and both values) and the largest finite |x - y|."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return f"{tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
    a, b = x.detach().float(), y.detach().float()
    differ = ~((a == b) | (a.isnan() & b.isnan()))
    if not bool(differ.any()):
        return "equal values, different bits (signed zeros or NaN payloads)"
    index = tuple(int(i) for i in differ.nonzero()[0])
    gap = (a - b).abs()
    gap = gap[gap.isfinite()]
    largest = f"{float(gap.max()):.6g}" if gap.numel() else "none finite"
    return (f"{int(differ.sum())} of {x.numel()} elements (NaNs: {int(a.isnan().sum())} vs "
            f"{int(b.isnan().sum())}); first at {index}: {float(a[index]):.9g} vs "
            f"{float(b[index]):.9g}; largest finite |diff| {largest}")


# ---- training runs ----------------------------------------------------------------------------

class Step(NamedTuple):
    """What one training step produced."""

    loss: Optional[torch.Tensor]
    input_grads: list       # None where no backward has reached that input yet
    param_grads: list
    states: list            # one FP8State per module


def capture(loss, inputs, parameters, modules) -> Step:
    """Record a step after its backward: the loss (or None), the gradients of ``inputs``
    and of ``parameters`` (every parameter must have one), every module's FP8 state."""
    param_grads = []
    for i, p in enumerate(parameters):
        assert p.grad is not None, f"parameter {i} ({tuple(p.shape)}) got no gradient"
        param_grads.append(p.grad.clone())
    return Step(loss=None if loss is None else loss.detach().clone(),
                input_grads=[None if t.grad is None else t.grad.clone() for t in inputs],
                param_grads=param_grads, states=fp8_state_snapshot(modules))


def assert_runs_equal(ref, got, what=""):
    """Two runs (lists of `Step`) are equal bit for bit, step by step."""
    prefix = f"{what} " if what else ""
    assert len(ref) == len(got), f"{prefix}runs of {len(ref)} and {len(got)} steps"
    for i, (a, b) in enumerate(zip(ref, got)):
        where = f"{prefix}step {i}"
        if a.loss is None or b.loss is None:
            assert a.loss is None and b.loss is None, f"{where}: one loss is None"
        else:
            assert torch.equal(a.loss, b.loss), f"{where}: loss {a.loss} vs {b.loss}"
        assert_tensors_equal(a.input_grads, b.input_grads, f"{where}: input grads")
        assert_tensors_equal(a.param_grads, b.param_grads, f"{where}: parameter grads")
        assert_states_equal(a.states, b.states, f"{where}: FP8 state")


def cuda_inputs(shape, step):
    """The input of one step of a CUDA training run (its own generator: the default
    generator's draws stay those of the model)."""
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * (1 + step)


def train_steps(model, shape, run, steps, accumulate=False):
    """``run(model, x)`` for each step on `cuda_inputs`, loss backward, SGD step; one
    `Step` record per step (loss, input and parameter gradients, FP8 state).
    ``accumulate``: a second micro-batch into the same ``.grad`` before the record."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    record = []
    for step in range(steps):
        x = cuda_inputs(shape, step).requires_grad_()
        y = run(model, x)
        loss = y.float().pow(2).mean()
        loss.backward()
        if accumulate:
            y2 = run(model, cuda_inputs(shape, step + 50).requires_grad_())
            y2.float().pow(2).mean().backward()
        record.append(capture(loss, [x], model.parameters(), te_modules(model)))
        opt.step()
        opt.zero_grad()
    return record


def linears(n, features=32, seed=0, device="cpu"):
    """``n`` te.Linear layers with their delayed-scaling state already made (scale 1,
    empty history: what their first FP8 forward would make), so scales can be read
    before the first forward."""
    torch.manual_seed(seed)
    layers = [te.Linear(features, features, device=device) for _ in range(n)]
    for layer in layers:
        layer.fp8_meta["recipe"] = RECIPE
        layer.init_fp8_meta_tensors(RECIPE)
    return layers


def params(modules) -> list:
    return [p for m in modules for p in m.parameters()]


def fp8_training_steps(module, recipe, magnitudes=(1.0,), features=16):
    """One FP8 training step of ``module`` per magnitude, on ``randn(16, features)``
    (on the module's device) scaled by it; returns each step's input amax."""
    device = next(module.parameters()).device
    amaxes = []
    for magnitude in magnitudes:
        x = torch.randn(16, features, device=device) * magnitude
        amaxes.append(x.abs().max().item())
        with te.autocast(recipe=recipe):
            y = module(x.requires_grad_())
        y.pow(2).mean().backward()
    return amaxes


# ---- the thread's FP8 autocast and recompute state ----------------------------------------------

class StateRecord(NamedTuple):
    """This thread's FP8 autocast / recompute state, frames named by id (so that a
    record keeps no frame alive). Compare with ==; compare ``autocast`` by identity
    too where it matters."""

    region: bool
    phase: bool
    frames: tuple
    training_under_no_grad: bool
    autocast: _AutocastState
    mode_hook_users: int


def global_state() -> StateRecord:
    s = te_global_state.snapshot()
    return StateRecord(region=s.recompute.region, phase=s.recompute.phase,
                       frames=tuple((id(f), r) for f, r in s.recompute.frames),
                       training_under_no_grad=s.recompute.training_under_no_grad,
                       autocast=s.autocast, mode_hook_users=s.mode_hook_users)


CLEAN = StateRecord(region=False, phase=False, frames=(), training_under_no_grad=False,
                    autocast=_AutocastState(), mode_hook_users=0)


def global_state_is_clean(frames_allowed: int = 0) -> bool:
    """Every piece of global FP8 and recompute state is as outside any autocast and
    checkpoint call, with at most ``frames_allowed`` checkpoint frames alive (what
    conftest's autouse fixture checks around each test)."""
    def clean() -> bool:
        found = te_global_state.snapshot()
        return (found._replace(live_frames=0) == te_global_state.clean()
                and found.live_frames <= frames_allowed)
    if clean():
        return True
    gc.collect()           # a dropped graph in a reference cycle still holds its frame
    return clean()


def live_frame_count() -> int:
    gc.collect()
    return te_global_state.snapshot().live_frames


def stash_count() -> int:
    gc.collect()
    return distributed.recompute_stash_count()


def queries():
    """(FP8 recompute enabled, in the recompute phase), as the public queries say."""
    return (distributed.is_fp8_activation_recompute_enabled(),
            distributed.in_fp8_activation_recompute_phase())


def fwd_scale(module):
    state = module.fp8_meta["scaling_fwd"]
    return None if state is None else state.scale.clone()


def maybe_checkpoint(checkpointed, use_reentrant, fn, *args, **kwargs):
    if checkpointed:
        return te.checkpoint(fn, *args, use_reentrant=use_reentrant, **kwargs)
    return fn(*args, **kwargs)


def record_recompute_scales(monkeypatch) -> list:
    """Wrap the hook that swaps a stash in (with TE's signature: one argument, nothing
    returned); returns the list it fills with ``(id of the module's fp8_meta, the
    forward scale swapped in)``, one per recompute."""
    used = []
    real = FP8GlobalStateManager.get_old_fp8_meta_tensors_for_recompute

    def recording(fp8_meta):
        real(fp8_meta)
        used.append((id(fp8_meta), tuple(fp8_meta["scaling_fwd"].scale.tolist())))

    monkeypatch.setattr(FP8GlobalStateManager, "get_old_fp8_meta_tensors_for_recompute",
                        staticmethod(recording))
    return used


# ---- CUDA graphs stood in for on the CPU ------------------------------------------------------

class RerunGraphs:
    """One graphed callable's CUDA graphs (`graph_capture.CudaGraphs`' interface), stood in
    for on the CPU: a replay reruns the captured work, reading the static inputs and
    writing the static outputs and gradients in place, as a graph replay does with the
    memory it captured. The forward is captured and replayed as under a capture (modules
    read the skip-update flag), the backward replays on the last forward replay's
    outputs. Every replay is logged in ``log`` as ``(kind, graphs)``."""

    def __init__(self, log: list):
        self.log, self.forward, self.backward = log, None, None
        self.outputs, self.grads, self.live = (), (), None

    def capture_forward(self, run):
        with graph_warm_up():
            out = run()
        self.forward, self.outputs = run, tuple(flatten_nested(out)[0])
        return out

    def capture_backward(self, run, outputs):
        self.backward, self.grads = run, run(outputs)
        return self.grads

    def replay_forward(self):
        self.log.append(("forward", self))
        with torch.enable_grad(), graph_warm_up():
            self.live = flatten_nested(self.forward())[0]
        with torch.no_grad():
            for static, fresh in zip(self.outputs, self.live):
                static.copy_(fresh)

    def replay_backward(self, replayed):
        self.log.append(("backward", self))
        grads, self.live = self.backward(self.live), None
        with torch.no_grad():
            for static, fresh in zip(self.grads, grads):
                if static is not None:
                    static.copy_(fresh)

    def reset(self):
        self.forward = self.backward = None


class RerunCapture:
    """`graph_capture.CudaCapture`'s interface with `RerunGraphs`: what
    ``te.make_graphed_callables`` captures with when a test puts it in place of
    ``graph._capture_backend`` (the schedule, warm-up, FP8 handling and returned
    callables are the package's own). Released buffers keep their memory."""

    def __init__(self):
        self.log, self.made = [], []

    def graphs(self) -> RerunGraphs:
        self.made.append(RerunGraphs(self.log))
        return self.made[-1]

    def check(self, callables, args, kwargs):
        """Nothing to check: the stand-in takes CPU tensors."""

    def warm_up_scope(self):
        return contextlib.nullcontext()

    def synchronize(self):
        """Nothing runs asynchronously."""

    def end_failed_capture(self):
        """Nothing to end."""

    @staticmethod
    def release(t):
        return t
