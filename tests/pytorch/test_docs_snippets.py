"""The Python code blocks of the user documentation in docs/ run as printed (each
file's blocks in order, in one namespace)."""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
FILES = ["backward_override.md", "fp8_primary_weights.md", "block_scaled_gemm.md",
         "graphed_callables.md", "rotary.md", "attention_masks.md", "torch-compile.md"]


def _python_blocks(text: str):
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.parametrize("name", FILES)
def test_python_blocks_run_as_printed(name):
    blocks = _python_blocks((DOCS / name).read_text())
    assert blocks, f"{name} has no python block"
    namespace = {"__name__": f"docs_{name}"}
    for block in blocks:
        exec(compile(block, str(DOCS / name), "exec"), namespace)
