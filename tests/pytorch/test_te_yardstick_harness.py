"""The harness that runs NVIDIA's TE tests against this package (qa/te_yardstick):
its stand-ins import, raise when a test uses them, never replace a name the package
has; its selection is consistent. The stand-ins change global import state, so they
are checked in a child process."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "qa" / "te_yardstick"
sys.path.insert(0, str(HARNESS))
import selection  # noqa: E402


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HARNESS)]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_standins_import_raise_when_used_and_never_shadow_a_real_name():
    proc = _run("""
        import transformer_engine.pytorch as te
        import te_standins
        te.Float8Quantizer = object          # as if the package had grown the name
        try:
            te_standins.install_standins()
        except RuntimeError as err:
            assert "transformer_engine.pytorch.Float8Quantizer exists in this package" in str(err)
        else:
            raise AssertionError("a stand-in replaced a real name")
        del te.Float8Quantizer
        te_standins.install_standins()
        from transformer_engine.pytorch.module.linear import Linear
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend
        from transformer_engine.pytorch.attention.dot_product_attention.utils import (
            check_set_window_size)
        from transformer_engine.pytorch._extra_state import UNSAFE_PICKLE_EXTRA_STATE_ENV
        assert te.Linear is Linear                            # real names stay
        assert not isinstance(1.0, te.Float8Quantizer)
        placeholder = te.Float8Quantizer(tex.DType.kFloat8E4M3)   # import time: inert
        try:
            placeholder.scale
        except NotImplementedError:
            pass
        else:
            raise AssertionError("an inert placeholder answered")
        te_standins._COLLECTING[0] = False                    # a test is running
        for use in (lambda: tex.fused_amax_and_scale_update_after_reduction(),
                    lambda: te.MXFP8Quantizer(), lambda: FusedAttnBackend["F16"]()):
            try:
                use()
            except NotImplementedError as err:
                assert "stand-in" in str(err) and "NVIDIA-native" in str(err), err
            else:
                raise AssertionError("a stand-in ran")
        assert not hasattr(tex, "__version__")           # pytest's probes see no attribute
        assert check_set_window_size("causal") == (-1, 0)
        assert check_set_window_size("padding", (3, 3)) == (3, 3)
        assert UNSAFE_PICKLE_EXTRA_STATE_ENV == "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
        print("OK")
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


def test_selection_is_consistent():
    assert not set(selection.FILES) & set(selection.EXCLUDED_FILES)
    assert all(n >= 1 for n in selection.FILES.values())
    for test, _ids, reason in selection.DESELECT:
        assert test.split("::")[0] in selection.FILES, test
        assert reason and len(reason) < 300, test
    key = "test_cuda_graphs.py::test_make_graphed_callables"
    assert selection.deselection_reason(f"x/y/{key}[None-Float8BlockScaling-dtype0-linear_op]")
    assert selection.deselection_reason(f"{key}[None-Float8BlockScaling-dtype0-linear]") is None
    assert selection.deselection_reason("test_jit.py::test_lazy_compile") is not None
    assert selection.deselection_reason("test_qk_norm.py::test_qk_norm_functionality[a]") is None
