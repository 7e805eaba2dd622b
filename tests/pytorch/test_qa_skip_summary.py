"""qa/skip_summary.py, the last line of the L0 job: it counts the skipped tests of the
per-file JUnit reports by reason, from reports that real pytest runs wrote."""

import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]
SUMMARY = ROOT / "qa" / "skip_summary.py"


def _pytest_report(tmp_path, name, source):
    (tmp_path / f"test_{name}.py").write_text(textwrap.dedent(source))
    report = tmp_path / f"{name}.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={report}", f"test_{name}.py"], cwd=tmp_path,
                   capture_output=True, text=True, timeout=120)
    return report


def test_one_line_counts_skips_by_reason_across_reports(tmp_path):
    first = _pytest_report(tmp_path, "a", """
        import pytest

        @pytest.mark.skipif(True, reason="needs a CUDA GPU")
        @pytest.mark.parametrize("n", [1, 2, 3])
        def test_cuda(n):
            assert n in (1, 2, 3)

        def test_cpu():
            assert sum([1, 2]) == 3
        """)
    second = _pytest_report(tmp_path, "b", """
        import pytest

        def test_cuda_inside():
            pytest.skip("needs a CUDA GPU")

        def test_triton():
            pytest.skip("needs Triton")

        def test_fails():
            assert False
        """)
    missing = tmp_path / "c.xml"                      # a file whose run died: no report
    done = subprocess.run([sys.executable, str(SUMMARY), str(first), str(second), str(missing)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Skipped 5 tests by reason: [4] needs a CUDA GPU; [1] needs Triton\n"


def test_no_skips_say_so(tmp_path):
    report = _pytest_report(tmp_path, "d", "def test_ok():\n    assert len([0]) == 1\n")
    done = subprocess.run([sys.executable, str(SUMMARY), str(report)], capture_output=True,
                          text=True, timeout=60)
    assert done.stdout == "Skipped: none.\n"
