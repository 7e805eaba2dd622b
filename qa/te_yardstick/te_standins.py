"""pytest plugin: run NVIDIA's TE ``tests/pytorch`` files against this package.

Loaded with ``-p te_standins`` (this folder on ``PYTHONPATH``). It does three things:

1. Stand-ins for NVIDIA-native names. TE's test files import, at module level, names
   that exist only in NVIDIA's build (the ``transformer_engine_torch`` extension, the
   ``cpp_extensions`` kernels, the MXFP8 / NVFP4 / Float8 quantizer classes, attention
   backend internals). `install_standins` puts importable stand-ins in their place, so
   that the files collect; a stand-in raises ``NotImplementedError`` naming itself as
   soon as it is called or instantiated, and ``isinstance(x, stand_in)`` is False.
   A few extension functions TE re-exports under its own public path
   (``tex.multi_tensor_scale is te.optimizers.multi_tensor_scale``) give the package's
   function of that path (`STANDIN_ALIASES`).
   The names this package has are never replaced (`STANDIN_ATTRS` adds only missing
   attributes, and the check at install time refuses to shadow a real one).
2. The selection (selection.py): test functions that use a stand-in, or that need
   what this package does not claim, are deselected, each with its reason; and
   ``--yardstick-chunk=k/n`` keeps every n-th selected test (the k-th of each n) so
   that one file can run as several processes.
3. A per-test record, written as the tests run (a "start" line before each test and a
   "finish" line with its outcome after it), to ``--yardstick-log``: the runner reads
   it even when the process was killed or crashed. ``--yardstick-test-timeout`` ends
   the process (faulthandler, with the stacks) when one test runs longer; the runner
   then records that test as crashed and restarts the chunk with
   ``--yardstick-resume``, which skips every test the log has started.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import types

import pytest

# ---- stand-ins --------------------------------------------------------------------------------

# Modules this package does not have: every attribute of one (and every submodule) is a
# stand-in, except the values given in STANDIN_VALUES.
STANDIN_MODULES = {
    "transformer_engine_torch": "NVIDIA's C++ extension (tex)",
    "transformer_engine.pytorch.cpp_extensions": "NVIDIA's GEMM/cast kernels (cpp_extensions)",
    "transformer_engine.pytorch.constants": "TE's tex-dtype constants",
    "transformer_engine.pytorch._extra_state": "TE's extra-state pickle policy (TE >= 2.14)",
    "transformer_engine.pytorch.quantized_tensor": "TE's quantized-tensor internals (TE >= 2.10)",
    "transformer_engine.pytorch.tensor.grouped_tensor": "TE's grouped tensor",
    "transformer_engine.pytorch.attention.dot_product_attention.utils":
        "TE's attention-backend selection (FlashAttention / cuDNN)",
    "transformer_engine.pytorch.attention.dot_product_attention.backends":
        "TE's attention backends",
    "transformer_engine.pytorch.attention.inference": "TE's KV-cache inference",
    "transformer_engine.pytorch.custom_recipes": "TE's custom-recipe reference quantizers",
    "transformer_engine.pytorch.dynamo": "TE's torch.compile tensor specs",
    "transformer_engine.pytorch.jit": "TE's TorchScript/nvFuser fused elementwise functions",
}



def _window_for_mask(attn_mask_type, window_size=None):
    """What TE's test ``ModelConfig`` needs of TE's ``check_set_window_size`` (run at
    import time): the window a mask type implies when none is given, (-1, 0) for the
    causal types and (-1, -1) for the others; a given window as it is."""
    if window_size is not None:
        return tuple(window_size)
    return (-1, 0) if "causal" in attn_mask_type else (-1, -1)


# Values a stand-in module must hold (module, name) -> value: TE's own constants, and
# the one internal helper TE's test utilities call at import time.
STANDIN_VALUES = {
    ("transformer_engine.pytorch._extra_state", "UNSAFE_PICKLE_EXTRA_STATE_ENV"):
        "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE",
    ("transformer_engine.pytorch.attention.dot_product_attention.utils",
     "check_set_window_size"): _window_for_mask,
}

# TE's optimizers module re-exports these functions of its extension
# (``te.optimizers.multi_tensor_scale is tex.multi_tensor_scale``), and TE's
# test_multi_tensor.py passes the ``tex`` ones to ``MultiTensorApply``: the extension's
# name gives the package's own function, as it gives TE's (also for
# multi_tensor_compute_scale_and_scale_inv, which TE has in its extension only). The
# extension's other multi-tensor kernels stay stand-ins.
STANDIN_ALIASES = {
    ("transformer_engine_torch", name): ("transformer_engine.pytorch.optimizers", name)
    for name in ("multi_tensor_scale", "multi_tensor_scale_tensor", "multi_tensor_l2norm",
                 "multi_tensor_unscale_l2norm", "multi_tensor_adam",
                 "multi_tensor_adam_param_remainder", "multi_tensor_adam_fp8",
                 "multi_tensor_adam_capturable", "multi_tensor_adam_capturable_master",
                 "multi_tensor_sgd", "multi_tensor_compute_scale_and_scale_inv")
}

# Names missing from modules this package has (NVIDIA-native or internal).
STANDIN_ATTRS = {
    "transformer_engine.pytorch": [
        "Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8BlockQuantizer",
        "MXFP8Quantizer", "NVFP4Quantizer", "Quantizer", "MXFP8Tensor", "NVFP4Tensor",
        "Float8BlockwiseQTensor", "MXFP8TensorStorage", "Float8TensorStorage", "DType",
        "InferenceParams", "get_cpu_offload_context", "get_cudnn_version", "onnx_export",
        "parallel_cross_entropy", "initialize_ub", "destroy_ub", "QuantizerRole",
    ],
    "transformer_engine.pytorch.utils": ["gpu_autocast_ctx"],
    "transformer_engine.pytorch.ops.fused": [
        "BackwardActivationBias", "BackwardAddRMSNorm", "BackwardLinearAdd",
        "BackwardLinearScale", "ForwardLinearBiasActivation", "ForwardLinearBiasAdd",
        "ForwardLinearScaleAdd", "UserbuffersForwardLinear",
    ],
    "transformer_engine.pytorch.ops": ["Dropout"],
    "transformer_engine.pytorch.tensor": [
        "Float8Quantizer", "Float8CurrentScalingQuantizer", "QuantizedTensorStorage",
    ],
    "transformer_engine.pytorch.tensor.float8_tensor": [
        "Float8Quantizer", "Float8CurrentScalingQuantizer",
    ],
    "transformer_engine.pytorch.quantization": [
        "NVFP4BlockScalingRecipeState", "QuantizerRole", "_amax_and_scale_update",
        "get_align_size_for_quantization",
    ],
    "transformer_engine.pytorch.attention.dot_product_attention": ["_attention_backends"],
    "transformer_engine.pytorch.module": ["is_module_grouped_tensor_path_supported"],
    "transformer_engine.pytorch.module.base": ["get_dummy_wgrad"],
    "transformer_engine.pytorch.module.grouped_linear": [
        "_GroupedLinear", "is_module_grouped_tensor_path_supported",
    ],
    "transformer_engine.common.recipe": ["CustomRecipe"],
}


class StandInError(NotImplementedError, AttributeError):
    """A test reached a stand-in. Also an AttributeError, so that ``hasattr`` probes
    (pytest's among them) see a missing attribute."""


_COLLECTING = [True]            # module-level code of test files runs while collecting


class _InertValue:
    """What calling a stand-in gives while test files are imported (module-level
    parameter lists build objects): a placeholder that raises when a test uses it."""

    def __init__(self, qualname: str, origin: str):
        object.__setattr__(self, "_standin", (qualname, origin))

    def __getattr__(self, name):
        qualname, origin = object.__getattribute__(self, "_standin")
        raise StandInError(f"{qualname}(...).{name}: {origin} is NVIDIA-native and not part "
                           "of this package")

    def __call__(self, *args, **kwargs):
        qualname, origin = object.__getattribute__(self, "_standin")
        raise StandInError(f"{qualname}(...) called: {origin} is NVIDIA-native and not part "
                           "of this package")

    def __repr__(self):
        return f"<stand-in value {object.__getattribute__(self, '_standin')[0]}(...)>"


class _StandInType(type):
    """The metaclass of stand-ins: attribute access and subscription give further
    stand-ins (``tex.DType.kFloat8E4M3`` at import time). Calling one raises during a
    test; while test files are imported it gives an inert placeholder."""

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        child = _make_standin(f"{cls.__qualname__}.{name}", cls._standin_origin)
        setattr(cls, name, child)
        return child

    def __getitem__(cls, key):
        return _make_standin(f"{cls.__qualname__}[{key!r}]", cls._standin_origin)

    def __call__(cls, *args, **kwargs):
        if _COLLECTING[0]:
            return _InertValue(cls.__qualname__, cls._standin_origin)
        raise StandInError(
            f"stand-in {cls.__qualname__} called: {cls._standin_origin} is NVIDIA-native and "
            "not part of this package (qa/te_yardstick deselects the tests that need it)")

    def __iter__(cls):
        return iter(())

    def __repr__(cls):
        return f"<stand-in {cls.__qualname__}>"


def _make_standin(qualname: str, origin: str) -> type:
    cls = _StandInType(qualname.rpartition(".")[2] or qualname, (), {
        "_standin_origin": origin, "__module__": "te_standins"})
    cls.__qualname__ = qualname
    return cls


def is_standin(obj) -> bool:
    return isinstance(obj, _StandInType) or isinstance(obj, _StandInModule)


class _StandInModule(types.ModuleType):
    """A module this package does not have: each attribute is a stand-in."""

    def __init__(self, name: str, origin: str):
        super().__init__(name, f"stand-in for {origin}")
        self.__path__ = []                       # a package: submodules import too
        self._standin_origin = origin

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = STANDIN_VALUES.get((self.__name__, name))
        alias = STANDIN_ALIASES.get((self.__name__, name))
        if alias is not None:
            value = getattr(importlib.import_module(alias[0]), alias[1])
        if value is None:
            value = _make_standin(f"{self.__name__}.{name}", self._standin_origin)
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the submodules of stand-in modules (``...cpp_extensions.fused_attn``)."""

    def find_spec(self, fullname, path, target=None):
        parent = fullname.rpartition(".")[0]
        if isinstance(sys.modules.get(parent), _StandInModule):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        parent = sys.modules[spec.name.rpartition(".")[0]]
        return _StandInModule(spec.name, parent._standin_origin)

    def exec_module(self, module):
        pass


def install_standins() -> None:
    """Put the stand-ins in place (idempotent). Refuses to shadow a real module or
    attribute of this package: the list would then be out of date."""
    import transformer_engine.pytorch  # noqa: F401  (the real package first)
    for name, origin in STANDIN_MODULES.items():
        if name in sys.modules and not isinstance(sys.modules[name], _StandInModule):
            raise RuntimeError(f"te_standins: {name} exists in this package; drop its stand-in")
        try:
            if importlib.util.find_spec(name) is not None:
                raise RuntimeError(f"te_standins: {name} exists in this package; drop its "
                                   "stand-in")
        except (ImportError, ValueError):
            pass                                 # the parent is not a package: fine
        module = _StandInModule(name, origin)
        sys.modules[name] = module
        parent, _, leaf = name.rpartition(".")
        if parent and parent in sys.modules:
            setattr(sys.modules[parent], leaf, module)
    for module_name, names in STANDIN_ATTRS.items():
        module = importlib.import_module(module_name)
        for name in names:
            if hasattr(module, name):
                if is_standin(getattr(module, name)):
                    continue
                raise RuntimeError(f"te_standins: {module_name}.{name} exists in this package; "
                                   "drop its stand-in")
            setattr(module, name, _make_standin(f"{module_name}.{name}",
                                                f"{module_name}.{name}"))
    for (module_name, name), (target, attr) in STANDIN_ALIASES.items():
        if not hasattr(importlib.import_module(target), attr):
            raise RuntimeError(f"te_standins: {module_name}.{name} is aliased to {target}.{attr}, "
                               "which this package does not have")
    if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandInFinder())


# ---- pytest hooks ----------------------------------------------------------------------------

def pytest_addoption(parser):
    group = parser.getgroup("te_yardstick")
    group.addoption("--yardstick-chunk", default=None,
                    help="k/n: keep the k-th (0-based) of every n selected tests")
    group.addoption("--yardstick-log", default=None, help="JSON-lines record of the run")
    group.addoption("--yardstick-resume", action="store_true",
                    help="skip the tests the log has started (finished or crashed)")
    group.addoption("--yardstick-test-timeout", type=float, default=0.0,
                    help="seconds one test may run before the process is ended (0: no limit)")
    group.addoption("--yardstick-only", default=None,
                    help="a file of node ids, one a line: run only those (the serial re-run)")
    group.addoption("--yardstick-no-selection", action="store_true",
                    help="keep every collected test (for the scan of what a file uses)")
    group.addoption("--yardstick-cpu-collect", action="store_true",
                    help="without CUDA, make the torch.cuda RNG calls TE's test files run at "
                         "import time no-ops (for --collect-only checks on a CPU machine)")


def _cpu_collect_patches() -> None:
    """``--yardstick-cpu-collect`` on a machine without CUDA (collection only: nothing
    runs). TE's test files seed the CUDA RNG and move a few tensors to CUDA at import
    time: those become no-ops. They also build parameter lists from the device's
    compute capability: it reads as an H100's (9, 0), so that the CPU collection
    gives the H100's cases."""
    import torch
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch import utils as te_utils
    if torch.cuda.is_available():
        return
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    for name in ("set_rng_state", "manual_seed", "manual_seed_all", "set_rng_state_all"):
        setattr(torch.cuda, name, lambda *a, **k: None)
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.Tensor.cuda = lambda self, *a, **k: self
    te.get_device_compute_capability = te_utils.get_device_compute_capability = lambda: (9, 0)


def pytest_configure(config):
    if config.getoption("--yardstick-cpu-collect"):
        _cpu_collect_patches()
    install_standins()
    config._yardstick_log = None
    path = config.getoption("--yardstick-log")
    if path:
        config._yardstick_log = open(path, "a", buffering=1)


def pytest_unconfigure(config):
    log = getattr(config, "_yardstick_log", None)
    if log is not None:
        log.close()


def _log(config, **record):
    log = getattr(config, "_yardstick_log", None)
    if log is not None:
        record["time"] = time.time()
        log.write(json.dumps(record) + "\n")
        log.flush()
        os.fsync(log.fileno())


def _started(path):
    """Node ids the log has started (whether they finished or the process died)."""
    started = set()
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue                     # a line cut by a kill
                if rec.get("event") in ("start", "finish", "crash"):
                    started.add(rec["nodeid"])
    return started


@pytest.hookimpl(trylast=True)              # after pytest's own -k / -m deselection
def pytest_collection_modifyitems(session, config, items):
    from selection import deselection_reason   # this folder is on sys.path with the plugin
    keep, dropped = [], []
    no_selection = config.getoption("--yardstick-no-selection")
    for item in items:
        reason = None if no_selection else deselection_reason(item.nodeid)
        if reason is None:
            keep.append(item)
        else:
            dropped.append(item)
            _log(config, event="deselect", nodeid=item.nodeid, reason=reason)
    chunk = config.getoption("--yardstick-chunk")
    if chunk:
        k, n = (int(v) for v in chunk.split("/"))
        keep = [item for i, item in enumerate(keep) if i % n == k]
    only = config.getoption("--yardstick-only")
    if only:
        with open(only) as f:
            wanted = set(f.read().split("\n"))
        keep = [item for item in keep if item.nodeid in wanted]
    if config.getoption("--yardstick-resume"):
        started = _started(config.getoption("--yardstick-log"))
        keep = [item for item in keep if item.nodeid not in started]
    else:
        for item in keep:
            _log(config, event="selected", nodeid=item.nodeid)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def pytest_runtest_logstart(nodeid, location):
    config = _CONFIG.get("config")
    if config is not None:
        _log(config, event="start", nodeid=nodeid)
        limit = config.getoption("--yardstick-test-timeout")
        if limit > 0:
            faulthandler.dump_traceback_later(limit, exit=True)


def pytest_runtest_logfinish(nodeid, location):
    config = _CONFIG.get("config")
    if config is not None and config.getoption("--yardstick-test-timeout") > 0:
        faulthandler.cancel_dump_traceback_later()


_CONFIG = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    _CONFIG["config"] = session.config


def pytest_sessionfinish(session):
    """The process's peak of CUDA memory reserved by torch's allocator (what the runner's
    per-file memory weights are checked against)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        _log(session.config, event="memory", peak_gb=torch.cuda.max_memory_reserved() / 2**30)


def pytest_collection_finish(session):
    _COLLECTING[0] = False


def pytest_runtest_logreport(report):
    config = _CONFIG.get("config")
    if config is None:
        return
    rec = _CONFIG.setdefault("results", {}).setdefault(report.nodeid, {})
    if report.when == "setup":
        rec["setup"] = report.outcome
        if report.skipped:
            rec["skip"] = _skip_reason(report)
    if report.failed:
        rec.setdefault("fail_phase", report.when)
        rec.setdefault("message", _failure_message(report))
    if report.when == "call" and report.skipped:
        rec["skip"] = _skip_reason(report)
    if report.when == "call":
        rec["call"] = report.outcome
        rec["duration"] = report.duration
    if report.when == "teardown":
        if rec.get("fail_phase") in ("setup", "teardown"):
            outcome = "error"
        elif rec.get("fail_phase") == "call":
            outcome = "failed"
        elif "skip" in rec:
            outcome = "skipped"
        else:
            outcome = "passed"
        _log(config, event="finish", nodeid=report.nodeid, outcome=outcome,
             duration=rec.get("duration"), message=rec.get("message"), skip=rec.get("skip"))


def _skip_reason(report) -> str:
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2])
    return str(report.longrepr)


def _failure_message(report) -> dict:
    """The exception's last line (type and message) and the test-file line it came
    through, short enough to group failures by."""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr).splitlines()[-1]
    where = ""
    entries = getattr(getattr(report.longrepr, "reprtraceback", None), "reprentries", None)
    if entries:
        loc = getattr(entries[-1], "reprfileloc", None)
        if loc is not None:
            where = f"{os.path.basename(loc.path)}:{loc.lineno}"
    return {"message": message[:2000], "where": where}
