"""The Python code of the user documentation runs as printed: every Python block of
README.rst and of docs/*.md, each file's blocks in order in one namespace (as a
reader pasting them into one session would run them).

The convention, for whoever writes a page:

- Markdown: a ```` ```python ```` block runs. The line right before its fence may say
  ``<!-- no-run: REASON -->`` (not run; the reason is required) or
  ``<!-- run-by: tests/pytorch/FILE.py -->`` (run there instead, e.g. under torchrun;
  that file must exist and name the page). Shell and console blocks (```` ``` ````,
  ```` ```console ````, ```` ```bash ````) are not run.
- reStructuredText: a ``.. code-block:: python`` block runs, unless the line before
  it is a comment ``.. no-run: REASON``. Literal blocks (``::``) are shell, not run.
"""

import pathlib
import re
import traceback
from dataclasses import dataclass
from typing import List, Optional

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.rst", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "docs").glob("*.rst"))]

_MD_BLOCK = re.compile(r"(?:^<!-- (?P<mark>no-run|run-by): (?P<why>[^\n]*?) -->\n)?"
                       r"^```python\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)
_RST_BLOCK = re.compile(r"(?:^\.\. (?P<mark>no-run): (?P<why>[^\n]*)\n(?:[ \t]*\n)*)?"
                        r"^\.\. code-block:: python[ \t]*\n(?P<body>(?:[ \t]*\n|[ \t]+[^\n]*\n)+)",
                        re.M)


@dataclass
class Block:
    page: pathlib.Path
    line: int
    code: str
    mark: Optional[str]     # None (runs), "no-run" or "run-by"
    why: Optional[str]


def _dedent_rst(body: str) -> str:
    lines = body.rstrip().split("\n")
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return "\n".join(line[indent:] for line in lines) + "\n"


def python_blocks(page: pathlib.Path) -> List[Block]:
    text = page.read_text()
    if page.suffix == ".md":
        matches = [(m, m.group("code")) for m in _MD_BLOCK.finditer(text)]
    else:
        matches = [(m, _dedent_rst(m.group("body"))) for m in _RST_BLOCK.finditer(text)]
    blocks = []
    for m, code in matches:
        start = m.start("code") if page.suffix == ".md" else m.start("body")
        # compile at the page's own line numbers, so a traceback points into the page
        line = text.count("\n", 0, start)
        blocks.append(Block(page, line, code, m.group("mark"), m.group("why")))
    return blocks


PAGES_WITH_CODE = [p for p in PAGES if python_blocks(p)]
PAGES_TO_RUN = [p for p in PAGES_WITH_CODE if any(b.mark is None for b in python_blocks(p))]


def test_the_pages_with_python_are_found():
    names = {p.name for p in PAGES_WITH_CODE}
    assert {"README.rst", "checkpointing.md", "recipes.md"} <= names, names
    assert len(python_blocks(ROOT / "README.rst")) >= 2


def test_python_blocks_run_as_printed():
    """Every page in one test (the suite's per-test fixtures cost more than most
    pages' code); a failure names each page and line that failed."""
    failures = []
    for page in PAGES_TO_RUN:
        namespace = {"__name__": f"docs_{page.stem}"}
        for block in python_blocks(page):
            if block.mark is not None:
                continue
            try:
                exec(compile("\n" * block.line + block.code, str(page), "exec"), namespace)
            except Exception as err:            # reported with its page and line below
                tb = traceback.extract_tb(err.__traceback__)
                line = next((f.lineno for f in reversed(tb) if f.filename == str(page)), "?")
                failures.append(f"{page.relative_to(ROOT)}:{line}: {type(err).__name__}: {err}")
                break                   # later blocks of the page build on this one
    assert not failures, "documentation code that does not run as printed:\n" + "\n".join(failures)


def test_blocks_left_out_say_why_or_where_they_run():
    for page in PAGES_WITH_CODE:
        for block in python_blocks(page):
            where = f"{page.name}:{block.line}"
            if block.mark == "no-run":
                assert block.why and len(block.why.split()) >= 2, f"{where}: no-run needs a reason"
            elif block.mark == "run-by":
                runner = ROOT / block.why.strip()
                assert runner.is_file(), f"{where}: run-by names a missing file {block.why!r}"
                assert page.name in runner.read_text(), f"{where}: {runner.name} never reads {page.name}"


def test_no_python_fence_is_mistyped():
    """A block a reader would run but the convention would not (```py, ```python3, an
    RST ``code::`` directive) is caught here."""
    for page in PAGES:
        text = page.read_text()
        if page.suffix == ".md":
            assert not re.search(r"^```(py|python3|Python)\s*$", text, re.M), page.name
        else:
            assert not re.search(r"^\.\. code::|^\.\. sourcecode::", text, re.M), page.name
