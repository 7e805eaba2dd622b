"""Which TE test functions use a stand-in (te_standins.py), found from the source.

    python3 scan.py <TE tests/pytorch> [file.py ...]

For every test function (module level or in a ``Test*`` class) it follows, within
the file and into the test folder's ``utils.py``, the module-level helpers it calls
and the parameter lists its decorators name, and reports each stand-in (and each
``te.ops`` operation this package's ``te.ops`` lacks) that is *used*: called,
subscripted or read an attribute of. An ``isinstance`` / ``issubclass`` check
against one is not a use (it is simply False). The result is the candidate list
from which selection.py's deselections were written, each then read and given its
reason; it over-approximates (a use in a branch the test never takes counts).
"""

from __future__ import annotations

import ast
import os
import sys
from typing import Dict, List, Set

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from te_standins import STANDIN_ALIASES, STANDIN_ATTRS, STANDIN_MODULES, STANDIN_VALUES  # noqa: E402

# te.ops operations: a capitalised name this package's te.ops lacks counts as a stand-in
# (te.ops.ScaledSwiGLU, te.ops.GroupedLinear, ...).
REFUSED_OPS_MODULE = "transformer_engine.pytorch.ops"


def _built_ops() -> Set[str]:
    import transformer_engine.pytorch.ops as te_ops
    return {name for name in dir(te_ops) if not name.startswith("_")}


BUILT_OPS = _built_ops()


def _standin_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in STANDIN_MODULES)


class _Imports:
    """What each imported local name refers to: a module path, or (module, attr)."""

    def __init__(self, tree: ast.Module):
        self.modules: Dict[str, str] = {}
        self.attrs: Dict[str, tuple] = {}
        for node in tree.body:
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.modules[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    self.attrs[a.asname or a.name] = (node.module, a.name)

    def standin(self, chain: List[str]) -> str:
        """The stand-in a dotted name chain (``tex.DType``, ``te.Float8Quantizer``,
        ``general_gemm``) refers to, or ''."""
        head, rest = chain[0], chain[1:]
        if head in self.attrs:
            module, attr = self.attrs[head]
            full = [module, attr] + rest
        elif head in self.modules:
            full = [self.modules[head]] + rest
        else:
            return ""
        return self.standin_path(".".join(full).split("."))

    @staticmethod
    def standin_path(parts: List[str]) -> str:
        """The stand-in a fully qualified dotted path reaches, or ''."""
        dotted = ".".join(parts)
        for i in range(1, len(parts) + 1):
            mod, nxt = ".".join(parts[:i]), (parts[i] if i < len(parts) else None)
            if _standin_module(mod):
                real = (mod, nxt) in STANDIN_VALUES or (mod, nxt) in STANDIN_ALIASES
                return "" if real else dotted
            if nxt is not None and nxt in STANDIN_ATTRS.get(mod, ()):
                return f"{mod}.{nxt}"
            if mod == REFUSED_OPS_MODULE and nxt is not None and nxt not in BUILT_OPS \
                    and nxt[:1].isupper():
                return f"{mod}.{nxt}"
        return ""


def _chain(node) -> List[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return []


class _Uses(ast.NodeVisitor):
    """Stand-ins used and module-level names referenced in one function or decorator."""

    def __init__(self, imports: _Imports):
        self.imports, self.used, self.names = imports, set(), set()

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("isinstance", "issubclass") \
                and len(node.args) == 2:
            self.visit(node.args[0])            # the class argument is no use
            return
        self.generic_visit(node)

    def visit_Attribute(self, node):
        chain = _chain(node)
        if chain:                   # a dotted name: judged whole (tex.multi_tensor_scale is real)
            found = self.imports.standin(chain)
            if found:
                self.used.add(found)
            self.names.add(chain[0])
            return
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        """An import inside a test (``from transformer_engine.pytorch.jit import ...``)."""
        if node.module:
            for alias in node.names:
                found = self.imports.standin_path(node.module.split(".") + [alias.name])
                if found:
                    self.used.add(found)

    def visit_Name(self, node):
        self.names.add(node.id)
        found = self.imports.standin([node.id])
        if found and isinstance(node.ctx, ast.Load):
            self.used.add(found)


def _definitions(tree: ast.Module) -> Dict[str, ast.AST]:
    defs = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        defs[n.id] = node
    return defs


class FileScan:
    def __init__(self, path: str, utils: "FileScan" = None):
        self.path = path
        with open(path) as f:
            self.tree = ast.parse(f.read())
        self.imports = _Imports(self.tree)
        self.defs = _definitions(self.tree)
        self.utils = utils
        self._memo: Dict[str, Set[str]] = {}

    def uses_of_name(self, name: str, seen: Set[str]) -> Set[str]:
        """Stand-ins used by the module-level definition ``name`` (transitively)."""
        if name in self._memo:
            return self._memo[name]
        key = f"{self.path}:{name}"
        if key in seen:
            return set()
        seen.add(key)
        used: Set[str] = set()
        node = self.defs.get(name)
        if node is not None:
            used |= self.uses_of_node(node, seen)
        elif self.utils is not None and self.imports.attrs.get(name, ("",))[0] == "utils":
            used |= self.utils.uses_of_name(self.imports.attrs[name][1], seen)
        self._memo[name] = used
        return used

    def uses_of_node(self, node: ast.AST, seen: Set[str]) -> Set[str]:
        v = _Uses(self.imports)
        v.visit(node)
        used = set(v.used)
        for n in v.names:
            if n != getattr(node, "name", None):
                used |= self.uses_of_name(n, seen)
        return used

    def tests(self):
        """``(qualified test name, stand-ins it uses)`` for each test function."""
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.name.startswith("test"):
                yield node.name, self.uses_of_node(node, set())
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                class_uses = set()
                for d in node.decorator_list:
                    class_uses |= self.uses_of_node(d, set())
                methods = {m.name: m for m in node.body
                           if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
                for m in methods.values():
                    if m.name.startswith("test"):
                        used = self.uses_of_node(m, set()) | class_uses
                        text = ast.unparse(m)
                        for other in methods.values():          # self.helper(...) calls
                            if not other.name.startswith("test") and (
                                    f"self.{other.name}" in text
                                    or f"{node.name}.{other.name}" in text):
                                used |= self.uses_of_node(other, set())
                        yield f"{node.name}::{m.name}", used


def main(argv: List[str]) -> int:
    """Print each flagged test and what it uses; with ``--check`` (the files of
    selection.FILES by default), print only those selection.py neither deselects nor
    lists as reviewed, and fail if there are any."""
    check = "--check" in argv
    argv = [a for a in argv if a != "--check"]
    root = argv[0]
    import selection
    files = argv[1:] or (list(selection.FILES) if check else sorted(
        f for f in os.listdir(root) if f.startswith("test_") and f.endswith(".py")))
    covered = {t for t, _, _ in selection.DESELECT} | set(selection.REVIEWED_KEPT)
    utils_path = os.path.join(root, "utils.py")
    utils = FileScan(utils_path) if os.path.exists(utils_path) else None
    missing = 0
    for name in files:
        scan = FileScan(os.path.join(root, name), utils)
        for test, used in scan.tests():
            if used and not (check and f"{name}::{test}" in covered):
                missing += 1
                print(f"{name}::{test}\t{', '.join(sorted(used))}")
    if check:
        print(f"{missing} flagged test(s) neither deselected nor reviewed")
    return 1 if check and missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
