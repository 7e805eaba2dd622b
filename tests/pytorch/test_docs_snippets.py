"""The Python code blocks of the docs pages listed here run as printed (each block
in a fresh namespace, on the CPU)."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = ["rotary.md", "attention_masks.md"]


@pytest.mark.parametrize("page", PAGES)
def test_code_blocks_run(page):
    text = (DOCS / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, f"{page} has no python block"
    for i, block in enumerate(blocks):
        exec(compile(block, f"{page} block {i}", "exec"), {})
