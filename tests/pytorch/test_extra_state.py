"""FP8 state in ``state_dict()`` (NOTE [FP8 extra state payload]): round trips restore
it bit for bit, empty payloads change nothing, and a history saved with another length
than the recipe in force is adapted (most recent amaxes and the scales kept), never
dropped. Refused payloads: test_bad_input.py."""

import copy
import io
import pickle
import sys

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                              Float8CurrentScaling, Format)
from transformer_engine.pytorch import delayed_scaling
from helpers import assert_states_equal, cuda_fp8, fp8_state_snapshot, fp8_training_steps

CPU = "cpu"
MODULES = [
    pytest.param(lambda: te.Linear(16, 16, device=CPU), id="linear"),
    pytest.param(lambda: te.LayerNormLinear(16, 16, device=CPU), id="layernorm-linear"),
    pytest.param(lambda: te.LayerNormMLP(16, 32, device=CPU), id="layernorm-mlp"),
]


@pytest.mark.parametrize("build", MODULES)
def test_state_dict_round_trip_is_bit_identical(build):
    recipe = DelayedScaling(amax_history_len=3)
    a = build()
    fp8_training_steps(a, recipe, [1.0, 4.0])
    b = build()
    b.load_state_dict(a.state_dict())
    assert_states_equal(fp8_state_snapshot([b]), fp8_state_snapshot([a]), "after the load")
    assert b.fp8_meta["recipe"] == recipe
    # both continue identically (same parameters, same scales and histories)
    torch.manual_seed(7)
    fp8_training_steps(a, recipe, [2.0])
    torch.manual_seed(7)
    fp8_training_steps(b, recipe, [2.0])
    assert_states_equal(fp8_state_snapshot([b]), fp8_state_snapshot([a]), "one step later")


def _grouped_step(m, recipe):
    x = torch.randn(32, 16, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = m(x, [16, 16])
    y.float().pow(2).mean().backward()


@pytest.mark.parametrize("kind", ["layernorm-mlp", "grouped"])
def test_payload_is_tes_layout(kind):
    """The payload unpickles to TE's dict: recipe, extra_fp8_variables, and scales and
    histories in TE's slots (3 forward, 2 backward per GEMM; GEMM by GEMM, or role by
    role for GroupedLinear, as Megatron-LM's grouped-expert checkpointing splits them),
    the slots this package does not use at scale 1 and zero history."""
    import pickle
    recipe = DelayedScaling(amax_history_len=3)
    if kind == "grouped":
        m = te.GroupedLinear(2, 16, 16, device=CPU)
        for _ in range(2):
            _grouped_step(m, recipe)
    else:
        m = te.LayerNormMLP(16, 32, device=CPU)
        fp8_training_steps(m, recipe, [1.0, 4.0])
    data = pickle.loads(m.get_extra_state().numpy().tobytes())
    assert set(data) == {"recipe", "extra_fp8_variables", "scale_fwd", "amax_history_fwd",
                         "scale_bwd", "amax_history_bwd"}
    assert data["recipe"] == recipe and data["extra_fp8_variables"] == {"num_gemms": 2}
    fwd, bwd = m.fp8_meta["scaling_fwd"], m.fp8_meta["scaling_bwd"]
    # this package's slots: forward [input, weight] per GEMM, backward [grad_output]
    if kind == "grouped":                      # role by role: input0 input1 weight0 weight1 ...
        fwd_slots, bwd_slots = [0, 2, 1, 3], [0, 1]
    else:                                      # GEMM by GEMM: in1 w1 out1 in2 w2 out2
        fwd_slots, bwd_slots = [0, 1, 3, 4], [0, 2]
    assert data["scale_fwd"].shape == (6,) and data["amax_history_fwd"].shape == (3, 6)
    assert data["scale_bwd"].shape == (4,) and data["amax_history_bwd"].shape == (3, 4)
    assert torch.equal(data["scale_fwd"][fwd_slots], fwd.scale)
    assert torch.equal(data["amax_history_fwd"][:, fwd_slots], fwd.amax_history)
    assert torch.equal(data["scale_bwd"][bwd_slots], bwd.scale)
    assert torch.equal(data["amax_history_bwd"][:, bwd_slots], bwd.amax_history)
    unused_fwd = [i for i in range(6) if i not in fwd_slots]
    unused_bwd = [i for i in range(4) if i not in bwd_slots]
    assert torch.equal(data["scale_fwd"][unused_fwd], torch.ones(2))
    assert torch.equal(data["scale_bwd"][unused_bwd], torch.ones(2))
    assert data["amax_history_fwd"][:, unused_fwd].count_nonzero() == 0
    assert data["amax_history_bwd"][:, unused_bwd].count_nonzero() == 0
    assert fwd.amax_history.count_nonzero() > 0 and not torch.equal(fwd.scale, torch.ones(4))


@cuda_fp8
def test_cuda_module_round_trips_through_a_checkpoint_file():
    """A CUDA module's state saved with torch.save and loaded into a fresh CUDA module:
    bit for bit, the loaded tensors on the module's device."""
    import io
    recipe = DelayedScaling(amax_history_len=3)
    a = te.Linear(16, 16, device="cuda")
    for magnitude in (1.0, 4.0):
        with te.autocast(recipe=recipe):
            y = a(torch.randn(16, 16, device="cuda") * magnitude)
        y.float().pow(2).mean().backward()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = te.Linear(16, 16, device="cuda")
    b.load_state_dict(torch.load(buf, weights_only=False))
    assert b.fp8_meta["scaling_fwd"].scale.is_cuda
    assert_states_equal(fp8_state_snapshot([b]), fp8_state_snapshot([a]), "after the load")


def test_current_scaling_and_callable_recipes_round_trip():
    """A recipe that is not saved as data (a callable algorithm) travels as None with
    its state; current scaling travels as itself."""
    a = te.Linear(16, 16, device=CPU)
    fp8_training_steps(a, DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: h.amax(0)), [1.0])
    b = te.Linear(16, 16, device=CPU)
    b.load_state_dict(a.state_dict())
    assert b.fp8_meta["recipe"] is None
    assert_states_equal(fp8_state_snapshot([b]), fp8_state_snapshot([a]))
    fp8_training_steps(a, Float8CurrentScaling(), [1.0])
    b.load_state_dict(a.state_dict())
    assert b.fp8_meta["recipe"] == Float8CurrentScaling()
    assert_states_equal(fp8_state_snapshot([b]), fp8_state_snapshot([a]))


@pytest.mark.parametrize("payload", [None, torch.zeros(0, dtype=torch.uint8)],
                         ids=["none", "empty"])
def test_empty_payload_changes_nothing(payload):
    m = te.Linear(16, 16, device=CPU)
    fp8_training_steps(m, DelayedScaling(amax_history_len=2), [1.0])
    before = fp8_state_snapshot([m])
    m.set_extra_state(payload)
    assert_states_equal(fp8_state_snapshot([m]), before)


# ---- history length: adapted to the recipe in force -----------------------------------------

def _rolled(amaxes, length):
    """The history of one tensor after one update per amax, by the update's own roll."""
    h = torch.zeros(length, 1)
    for a in amaxes:
        h[0, 0] = a
        h = delayed_scaling.roll_amax_history(h)
    return h


@pytest.mark.parametrize("old, new, steps", [(4, 2, 5), (4, 1, 3), (2, 6, 1), (4, 7, 3), (3, 3, 2)],
                         ids=["shrink", "shrink-to-1", "grow", "grow-full", "same"])
def test_resize_matches_a_history_kept_at_the_new_length(old, new, steps):
    """Resizing a history equals having kept the new length all along, whenever the
    new length holds what it would have held (a shorter one drops the oldest)."""
    amaxes = [float(i + 1) for i in range(steps)]
    got = delayed_scaling.resize_amax_history(_rolled(amaxes, old), new)
    assert torch.equal(got, _rolled(amaxes, new))


@pytest.mark.parametrize("new_len", [2, 6], ids=["shorter", "longer"])
def test_loaded_history_is_adapted_to_the_recipe_in_force(new_len):
    """Saved with amax_history_len=4 after three steps, resumed under another length:
    the loaded scales are used at the next forward (not reset to 1) and the next update
    takes the max over the amaxes the new length keeps: the last ``new_len - 1`` saved
    steps and the new one."""
    saved = te.Linear(16, 16, device=CPU)
    amaxes = fp8_training_steps(saved, DelayedScaling(amax_history_len=4), [1.0, 8.0, 2.0])
    loaded = te.Linear(16, 16, device=CPU)
    loaded.load_state_dict(saved.state_dict())
    recipe = DelayedScaling(amax_history_len=new_len)
    with torch.no_grad(), te.autocast(recipe=recipe):      # adopts the recipe, no update
        loaded(torch.randn(16, 16))
    state = loaded.fp8_meta["scaling_fwd"]
    assert state.amax_history.shape == (new_len, 2)
    assert torch.equal(state.scale, saved.fp8_meta["scaling_fwd"].scale)
    assert torch.equal(state.scale_inv, saved.fp8_meta["scaling_fwd"].scale_inv)
    assert loaded.fp8_meta["scaling_bwd"].amax_history.shape == (new_len, 1)
    amaxes += fp8_training_steps(loaded, recipe, [0.5])
    expect = 448.0 / max(amaxes[-new_len:])
    scale = loaded.fp8_meta["scaling_fwd"].scale
    torch.testing.assert_close(scale[0].double(), torch.tensor(expect, dtype=torch.float64),
                               rtol=2 ** -23, atol=0)


# ---- payloads written by NVIDIA's TE ---------------------------------------------------------

# A stand-in for NVIDIA's transformer_engine.common.recipe, as far as its pickles show it:
# the classes' module and names, their fields (TE 2.x documentation) and TE's Format
# values, (max_fwd, max_bwd) pairs. It runs in a separate process, so that these classes,
# not this package's, are the ones pickled.
_TE_RECIPE_MODULE = '''
import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float

class Format(enum.Enum):
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=E4M3.max_fwd, max_bwd=E5M2.max_bwd)

@dataclass(frozen=True)
class MMParams:
    use_split_accumulator: bool = True

@dataclass(frozen=True)
class QParams:
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

class Recipe:
    """TE's recipe base class."""

@dataclass()
class DelayedScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: Optional[object] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

@dataclass()
class Float8CurrentScaling(Recipe):
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams = QParams()
    fp8_quant_fwd_weight: QParams = QParams()
    fp8_quant_bwd_grad: QParams = QParams()
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
'''

_TE_WRITER = '''
import pickle, sys, torch
from transformer_engine.common import recipe as r
kind = sys.argv[2]
if kind == "delayed":
    rec = r.DelayedScaling(margin=1, fp8_format=r.Format.E4M3, amax_history_len=4,
                           amax_compute_algo="most_recent")
elif kind == "current":
    rec = r.Float8CurrentScaling(fp8_quant_fwd_inp=r.QParams(power_2_scale=True,
                                                             amax_epsilon=1e-3))
else:
    rec = r.Float8CurrentScaling(fp8_quant_bwd_grad=r.QParams(stochastic_rounding=True))
state = {"recipe": rec, "extra_fp8_variables": {"num_gemms": 1, "fp8_checkpoint": True},
         "scale_fwd": torch.tensor([2.0, 4.0, 1.0]),
         "amax_history_fwd": torch.arange(12, dtype=torch.float32).reshape(4, 3) / 8,
         "scale_bwd": torch.tensor([0.5, 1.0]),
         "amax_history_bwd": torch.arange(8, dtype=torch.float32).reshape(4, 2) / 4}
if kind != "delayed":
    state = {k: state[k] for k in ("recipe", "extra_fp8_variables")}
with open(sys.argv[1], "wb") as f:
    f.write(pickle.dumps(state))
'''


def _te_written_payload(tmp_path, kind):
    import subprocess
    import sys
    package = tmp_path / "te" / "transformer_engine"
    (package / "common").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "common" / "__init__.py").write_text("")
    (package / "common" / "recipe.py").write_text(_TE_RECIPE_MODULE)
    out = tmp_path / "payload.bin"
    env = {"PYTHONPATH": str(tmp_path / "te"), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", _TE_WRITER, str(out), kind], check=True, env=env,
                   cwd=tmp_path)
    return torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.uint8)


def test_delayed_scaling_state_written_by_nvidias_te_loads(tmp_path):
    payload = _te_written_payload(tmp_path, "delayed")
    lin = te.Linear(16, 16, device="cpu")
    lin.set_extra_state(payload)
    recipe = lin.fp8_meta["recipe"]
    assert type(recipe) is DelayedScaling
    assert (recipe.margin, recipe.fp8_format, recipe.amax_history_len,
            recipe.amax_compute_algo) == (1, Format.E4M3, 4, "most_recent")
    fwd, bwd = lin.fp8_meta["scaling_fwd"], lin.fp8_meta["scaling_bwd"]
    # TE's slots: input, weight (output dropped); grad output (grad input dropped)
    assert torch.equal(fwd.scale, torch.tensor([2.0, 4.0]))
    assert torch.equal(fwd.scale_inv, torch.tensor([0.5, 0.25]))
    assert torch.equal(fwd.amax_history, torch.arange(12.0).reshape(4, 3)[:, :2] / 8)
    assert torch.equal(bwd.scale, torch.tensor([0.5]))
    assert torch.equal(bwd.amax_history, torch.arange(8.0).reshape(4, 2)[:, :1] / 4)
    # and it trains on from there
    fp8_training_steps(lin, recipe)


def test_current_scaling_recipe_written_by_nvidias_te_loads(tmp_path):
    lin = te.Linear(16, 16, device="cpu")
    lin.set_extra_state(_te_written_payload(tmp_path, "current"))
    recipe = lin.fp8_meta["recipe"]
    assert type(recipe) is Float8CurrentScaling
    assert recipe.fp8_quant_fwd_inp.power_2_scale is True
    assert recipe.fp8_quant_fwd_inp.amax_epsilon == 1e-3
    assert recipe.fp8_gemm_fprop.use_split_accumulator is False
    assert recipe.fp8_format == Format.HYBRID


def test_nvidias_te_options_not_implemented_here_are_refused(tmp_path):
    lin = te.Linear(16, 16, device="cpu")
    before = dict(lin.fp8_meta)
    with pytest.raises(ValueError, match=r"fp8_quant_bwd_grad: QParams\.stochastic_rounding=True "
                                         r"is not implemented"):
        lin.set_extra_state(_te_written_payload(tmp_path, "stochastic"))
    assert lin.fp8_meta == before


# ---- what a payload names: TE's globals only, Megatron's storage loader accepted -------------

_RECIPE = "transformer_engine.common.recipe"
# The globals NVIDIA's TE's payload names (its recipe classes are dataclasses of
# transformer_engine.common.recipe, a Format is pickled by its _FormatHelper value, a
# tensor by torch's rebuild functions).
TE_PAYLOAD_GLOBALS = {(_RECIPE, n) for n in ("DelayedScaling", "Float8CurrentScaling",
                                             "Float8BlockScaling", "Format", "_FormatHelper",
                                             "QParams", "MMParams")} | {
    ("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes"),
    ("collections", "OrderedDict")}
# Megatron Core 0.19.2's SafeUnpickler allow-list for grouped FP8 extra state
# (megatron/core/safe_globals.py), the globals among it.
MEGATRON_0_19_ALLOW_LIST = {(_RECIPE, n) for n in (
    "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling",
    "NVFP4BlockScaling", "Format", "_FormatHelper", "MMParams", "QParams")} | {
    ("collections", "OrderedDict"), ("torch", "Size"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch.storage", "UntypedStorage"),
    ("torch.storage", "_load_from_bytes"), ("megatron.core.safe_globals", "safe_load_from_bytes"),
    ("megatron.core.extensions.transformer_engine", "TEDelayedScaling")}


class _RecordingUnpickler(pickle.Unpickler):
    """Unpickles a payload this test trusts, recording the globals it names, refusing
    any outside ``allowed`` (as Megatron's SafeUnpickler does)."""

    def __init__(self, data, allowed):
        super().__init__(io.BytesIO(data))
        self.allowed, self.named = allowed, set()

    def find_class(self, module, name):
        self.named.add((module, name))
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed")
        return super().find_class(module, name)


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=2), Float8CurrentScaling(),
                                    Float8BlockScaling()], ids=["delayed", "current", "block"])
def test_payload_names_only_what_tes_payload_names(recipe):
    """Megatron unpickles grouped extra state with its own allow-list: the payload
    names only TE's globals (no torch dtype, no _FormatSpec, no recipe_fields), and
    unpickles under Megatron's list to the recipe and the tensors."""
    features = 128 if isinstance(recipe, Float8BlockScaling) else 16
    lin = te.Linear(features, features, device=CPU)
    fp8_training_steps(lin, recipe, [1.0], features=features)
    raw = lin.get_extra_state().numpy().tobytes()
    reader = _RecordingUnpickler(raw, MEGATRON_0_19_ALLOW_LIST)
    data = reader.load()
    # where megatron.core was imported first, torch's storage loader is Megatron's, and
    # TE's own payload names it as well
    storage_loader = torch.storage._load_from_bytes
    expected = TE_PAYLOAD_GLOBALS | {(storage_loader.__module__, storage_loader.__name__)}
    assert reader.named <= expected, reader.named - expected
    assert (_RECIPE, type(recipe).__name__) in reader.named
    assert data["recipe"] == recipe and data["recipe"].fp8_format is recipe.fp8_format


def test_payload_naming_megatrons_storage_loader_loads(tmp_path):
    """After ``import megatron.core`` torch's storage loader is Megatron's
    ``safe_load_from_bytes``, so tensors pickled then name it: such a payload loads,
    bit for bit, read as torch's storage format (nothing imported or called)."""
    from pickle_ops import assemble, ops
    saved = te.Linear(16, 16, device=CPU)
    fp8_training_steps(saved, DelayedScaling(amax_history_len=3), [1.0, 4.0])
    renamed = {"torch.storage": "megatron.core.safe_globals",
               "_load_from_bytes": "safe_load_from_bytes"}
    op_list = [(name, renamed.get(arg, arg) if isinstance(arg, str) else arg)
               for name, arg in ops(saved.get_extra_state().numpy().tobytes())]
    payload = assemble(op_list)
    assert b"megatron.core.safe_globals" in payload and b"torch.storage" not in payload
    modules = set(sys.modules)
    loaded = te.Linear(16, 16, device=CPU)
    loaded.set_extra_state(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    assert set(sys.modules) == modules
    assert_states_equal(fp8_state_snapshot([loaded]), fp8_state_snapshot([saved]))


def test_payload_pickles_as_a_plain_uint8_tensor():
    """``torch.save`` of a state dict, ``torch.load(weights_only=True)``, deepcopy: the
    payload is a plain uint8 tensor to them, and loads."""
    a = te.LayerNormMLP(16, 32, device=CPU)
    fp8_training_steps(a, DelayedScaling(amax_history_len=2), [1.0])
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert type(state["_extra_state"]) is torch.Tensor
    original = a.state_dict()
    copied = copy.deepcopy(original)
    assert type(copied["_extra_state"]) is type(original["_extra_state"])
    assert torch.equal(copied["_extra_state"].plain(), original["_extra_state"].plain())
    for source in (state, copied):
        b = te.LayerNormMLP(16, 32, device=CPU)
        b.load_state_dict(source)
        assert_states_equal(fp8_state_snapshot([b]), fp8_state_snapshot([a]))


def test_pickled_none_loads_as_nothing_and_an_empty_state_is_refused():
    """TE 1 pickled None for a module without FP8 state: it changes nothing. A dict
    with neither a recipe nor scales (never written) is refused."""
    m = te.Linear(16, 16, device=CPU)
    fp8_training_steps(m, DelayedScaling(amax_history_len=2), [1.0])
    before = fp8_state_snapshot([m])
    m.set_extra_state(torch.frombuffer(bytearray(pickle.dumps(None)), dtype=torch.uint8))
    assert_states_equal(fp8_state_snapshot([m]), before)
    empty = {"recipe": None, "extra_fp8_variables": {"num_gemms": 1}}
    with pytest.raises(ValueError, match="it holds neither a recipe nor a scaling state"):
        m.set_extra_state(torch.frombuffer(bytearray(pickle.dumps(empty)), dtype=torch.uint8))
    assert_states_equal(fp8_state_snapshot([m]), before)
    # and a module that never ran FP8 writes the empty tensor, which loads as nothing
    fresh = te.Linear(16, 16, device=CPU).get_extra_state()
    assert fresh.numel() == 0
    m.set_extra_state(fresh)
    assert_states_equal(fp8_state_snapshot([m]), before)


# ---- torch.distributed.checkpoint in one process ------------------------------------------

def _model():
    torch.manual_seed(11)
    return torch.nn.Sequential(te.LayerNormMLP(16, 32, device=CPU), te.Linear(16, 16, device=CPU))


def _train(model, recipe, steps, seed):
    """``steps`` SGD steps; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        x = torch.randn(16, 16, generator=g) * (1.0 + step)
        with te.autocast(recipe=recipe):
            loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("target", ["fresh", "warmed-other-history", "warmed-current-scaling"])
def test_dcp_restores_fp8_state_into_any_model(tmp_path, target):
    """dcp.save from a trained model, dcp.load into a fresh one or one warmed with
    another recipe: every module's FP8 state back bit for bit, and the next step
    bit-identical to the uninterrupted run's."""
    import warnings
    import torch.distributed.checkpoint as dcp
    recipe = DelayedScaling(amax_history_len=3)
    saved = _model()
    _train(saved, recipe, 2, seed=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(saved.state_dict(), checkpoint_id=tmp_path)
    at_save = fp8_state_snapshot(list(saved))
    loaded = _model()
    if target != "fresh":
        other = DelayedScaling(amax_history_len=7) if target == "warmed-other-history" \
            else Float8CurrentScaling()
        _train(loaded, other, 1, seed=2)
    state = loaded.state_dict()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=tmp_path)
    loaded.load_state_dict(state)
    assert_states_equal(fp8_state_snapshot(list(loaded)), at_save, "after dcp.load")
    assert all(m.fp8_meta["recipe"] == recipe for m in loaded)
    expect, got = _train(saved, recipe, 1, seed=3), _train(loaded, recipe, 1, seed=3)
    assert torch.equal(expect[0], got[0])
    for p, q in zip(saved.parameters(), loaded.parameters()):
        assert torch.equal(p, q)
    assert_states_equal(fp8_state_snapshot(list(loaded)), fp8_state_snapshot(list(saved)),
                        "one step later")
