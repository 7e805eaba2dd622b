"""Dropout inside te.make_graphed_callables (NOTE [Graph-safe RNG] in graph_rng.py):
a graphed te.TransformerLayer with hidden and attention dropout, with and without
te.checkpoint inside the graphed callable, with the masks drawn from torch's default
generator or a CudaRNGStatesTracker, trains bit for bit as the eager layer does from
the same generator states (losses, input and parameter gradients, every scale,
scale_inv and amax history, over several steps); replays draw fresh masks; the warm-up
leaves the RNG states as it found them; what cannot be replayed fails at capture time.
All cases need a CUDA GPU with FP8."""

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from helpers import RECIPE, assert_runs_equal, cuda_fp8, cuda_inputs, train_steps

pytestmark = cuda_fp8

STEPS = 5
SHAPE = (16, 2, 64)            # [seq, batch, hidden]: one attention block, small and exact
NAME = "model-parallel-rng"


def _tracker():
    tracker = te.CudaRNGStatesTracker(device="cuda")
    tracker.add(NAME, 4321)
    return tracker


def _layer(tracker, hidden_dropout=0.1, attention_dropout=0.1):
    torch.manual_seed(11)
    return te.TransformerLayer(64, 128, 4, hidden_dropout=hidden_dropout,
                               attention_dropout=attention_dropout,
                               self_attn_mask_type="causal", params_dtype=torch.bfloat16,
                               device="cuda",
                               get_rng_state_tracker=(lambda: tracker) if tracker else None)


class Checkpointed(torch.nn.Module):
    """The layer under te.checkpoint, with the FP8 autocast inside the checkpointed
    function and the tracker handed to the checkpoint (its states are replayed)."""

    def __init__(self, layer, tracker):
        super().__init__()
        self.layer = layer
        # a function, which deepcopy keeps: the copy draws from the same tracker
        self.get_tracker = (lambda: tracker) if tracker is not None else None

    def _run(self, h):
        with te.autocast(recipe=RECIPE):
            return self.layer(h)

    def forward(self, x):
        return te.checkpoint(self._run, x, use_reentrant=False,
                             get_rng_state_tracker=self.get_tracker)


def _seed(tracker, tracker_states):
    """The same generator states at the start of each run."""
    torch.cuda.manual_seed(2024)
    if tracker is not None:
        tracker.set_states(tracker_states)


def _eager(checkpointed):
    if checkpointed:
        return lambda m, x: m(x)

    def run(m, x):
        with te.autocast(recipe=RECIPE):
            return m(x)
    return run


def _graph(model, checkpointed):
    sample = (cuda_inputs(SHAPE, 0).requires_grad_(),)
    if checkpointed:                # the autocast is opened inside the callable
        return te.make_graphed_callables(model, sample)
    return te.make_graphed_callables(model, sample, enabled=True, recipe=RECIPE)


@pytest.mark.parametrize("source", ["default-generator", "tracker"])
@pytest.mark.parametrize("checkpointed", [pytest.param(False, id="no-checkpoint"),
                                          pytest.param(True, id="te-checkpoint")])
def test_graphed_dropout_equals_eager(checkpointed, source):
    tracker = _tracker() if source == "tracker" else None
    tracker_states = tracker.get_states() if tracker is not None else None
    layer = _layer(tracker)
    model = Checkpointed(layer, tracker) if checkpointed else layer
    eager_model = copy.deepcopy(model)

    _seed(tracker, tracker_states)
    ref = train_steps(eager_model, SHAPE, _eager(checkpointed), STEPS)
    _seed(tracker, tracker_states)
    _graph(model, checkpointed)
    got = train_steps(model, SHAPE, lambda m, x: m(x), STEPS)
    assert_runs_equal(ref, got)

    # the masks mattered: the same run without dropout differs from the first step on
    no_dropout = _layer(tracker, 0.0, 0.0)
    if checkpointed:
        no_dropout = Checkpointed(no_dropout, tracker)
    _seed(tracker, tracker_states)
    plain = train_steps(no_dropout, SHAPE, _eager(checkpointed), 1)
    assert not torch.equal(plain[0].loss, ref[0].loss), "dropout had no effect"


@pytest.mark.parametrize("checkpointed", [pytest.param(False, id="no-checkpoint"),
                                          pytest.param(True, id="te-checkpoint")])
def test_replays_draw_fresh_masks(checkpointed):
    tracker = _tracker()
    layer = _layer(tracker)
    model = Checkpointed(layer, tracker) if checkpointed else layer
    _graph(model, checkpointed)
    x = cuda_inputs(SHAPE, 1).requires_grad_()
    first = model(x).detach().clone()      # the output is the graph's static buffer
    second = model(x).detach().clone()
    assert not torch.equal(first, second)


def test_warm_up_leaves_the_rng_states_as_it_found_them():
    tracker = _tracker()
    model = _layer(tracker)
    before = (torch.cuda.get_rng_state(), torch.get_rng_state(), tracker.get_states()[NAME])
    _graph(model, checkpointed=False)
    after = (torch.cuda.get_rng_state(), torch.get_rng_state(), tracker.get_states()[NAME])
    for a, b in zip(before, after):
        assert torch.equal(a, b)


class Nested(torch.nn.Module):
    """A checkpoint inside a checkpoint: the inner call is made again inside the outer
    recompute, in the backward capture, where its states cannot be replayed."""

    def __init__(self):
        super().__init__()
        self.layer = _layer(None, hidden_dropout=0.1, attention_dropout=0.0)

    def _outer(self, h):
        return te.checkpoint(self.layer, h, use_reentrant=False)

    def forward(self, x):
        return te.checkpoint(self._outer, x, use_reentrant=False)


def test_dropout_in_a_checkpoint_nested_in_a_recompute_is_refused():
    model = Nested()
    with pytest.raises(RuntimeError, match=r"capturing the backward of callable 0 failed: "
                                           r"te.TransformerLayer: dropout \(p=0.1\) inside a "
                                           "te.checkpoint region whose recompute cannot replay"):
        te.make_graphed_callables(model, (cuda_inputs(SHAPE, 0).requires_grad_(),))
