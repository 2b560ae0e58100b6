"""The import graph of fived has no circles, and the layers import one way.

Every module under ``fived/`` is parsed with ``ast`` (nothing is imported). An edge A → B is any
``import``/``from … import`` in A that names module B of the package — at the top of the file or
inside a function (a deferred import is still a dependency), relative imports resolved, and
``from pkg import name`` counted as importing the submodule ``pkg.name`` when that module exists
(else as importing ``pkg``). Imports under ``if TYPE_CHECKING:`` are not executed and are left
out. A package's ``__init__`` is only an edge when it is named itself.

The rules:

* no strongly connected component of more than one module (an import circle);
* ``fived.model`` imports nothing of ``fived.parallel``, ``fived.comm``, ``fived.train``;
* ``fived.ledger`` imports no ``torch``, and nothing of ``fived.parallel``, ``fived.train``,
  ``fived.model``, ``fived.bench`` (it plans clusters that are not here).
"""

from __future__ import annotations

import ast
import textwrap
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (importer prefix, forbidden prefixes) relative to the package: "model" is pkg.model and below
FORBIDDEN = {
    "model": ("parallel", "comm", "train"),
    "ledger": ("parallel", "train", "model", "bench"),
}
NO_TORCH = ("ledger",)


# ------------------------------------------------------------------------------ the checker
def module_files(root: Path, pkg: str) -> dict[str, Path]:
    """Dotted module name → file, for every .py file of the package ``root/pkg``."""
    out = {}
    for path in sorted((root / pkg).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node that runs (anywhere, functions included), not the
    ``if TYPE_CHECKING:`` ones."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, pkg: str):
    """(edges, external): edges[A][B] = line numbers of A importing B (both modules of the
    package); external[A] = top-level names of the other packages A imports (``torch``, …)."""
    files = module_files(root, pkg)
    edges: dict[str, dict[str, list[int]]] = {m: defaultdict(list) for m in files}
    external: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        here = mod if is_pkg else mod.rpartition(".")[0]  # the package relative imports start in
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == pkg or a.name.startswith(pkg + "."):
                        targets.append(a.name)
                    else:
                        external[mod].add(a.name.split(".")[0])
                found = targets
            else:
                if node.level:
                    base = here.split(".")
                    if node.level > 1:
                        base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                if src != pkg and not src.startswith(pkg + "."):
                    external[mod].add(src.split(".")[0])
                    continue
                found = []
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    found.append(sub if sub in files else src)
            for t in found:
                while t not in files and "." in t:  # `import pkg.mod.attr`-like: the module
                    t = t.rpartition(".")[0]
                if t in files and t != mod:
                    edges[mod][t].append(node.lineno)
    return edges, external


def strongly_connected(edges: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """Tarjan's algorithm; the components, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on, stack, out = set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def a_cycle(edges: dict[str, dict[str, list[int]]], comp: list[str]) -> list[str]:
    """One shortest circle through the first member of ``comp``: [a, b, …, a]."""
    start, members = comp[0], set(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, start]
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def _lines(lines: list[int]) -> str:
    return ", ".join(map(str, sorted(set(lines))))


def problems(root: Path, pkg: str) -> list[str]:
    """Every broken rule, one readable line (or block) each."""
    edges, external = import_graph(root, pkg)
    out = []
    for comp in strongly_connected(edges):
        if len(comp) > 1:
            cyc = a_cycle(edges, comp)
            steps = "\n".join(f"      {a} → {b}  (line {_lines(edges[a][b])})"
                              for a, b in zip(cyc, cyc[1:]))
            out.append(f"import circle of {len(comp)} modules: {', '.join(comp)}\n"
                       f"    one circle:\n{steps}")
    for mod, targets in sorted(edges.items()):
        for low, banned in FORBIDDEN.items():
            if not _under(mod, f"{pkg}.{low}"):
                continue
            for t, lines in sorted(targets.items()):
                if any(_under(t, f"{pkg}.{b}") for b in banned):
                    out.append(f"{mod} imports {t} (line {_lines(lines)}): "
                               f"{pkg}.{low} must not import {', '.join(banned)}")
    for mod, names in sorted(external.items()):
        if any(_under(mod, f"{pkg}.{low}") for low in NO_TORCH) and "torch" in names:
            out.append(f"{mod} imports torch: {pkg}.ledger is torch-free")
    return out


# ------------------------------------------------------------------------------ the checker works
def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return tmp_path


def test_checker_finds_a_planted_circle(tmp_path):
    """a → b (relative, top level) → c (``from pkg import c``, inside a function) → a."""
    root = _fake_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "def f():\n    from pkg import c\n    return c\n",
        "pkg/c.py": "import pkg.a\n",
        "pkg/d.py": "from .a import something\nfrom typing import TYPE_CHECKING\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/e.py": "from .. import d\nif TYPE_CHECKING:\n    from pkg.sub import f\n",
        "pkg/sub/f.py": "from ..sub import e\n",
    })
    edges, _ = import_graph(root, "pkg")
    assert set(edges["pkg.a"]) == {"pkg.b"}
    assert set(edges["pkg.b"]) == {"pkg.c"}  # the submodule, not pkg/__init__
    assert set(edges["pkg.d"]) == {"pkg.a"}  # a name from a module: that module
    assert set(edges["pkg.sub.e"]) == {"pkg.d"}  # TYPE_CHECKING: left out
    assert set(edges["pkg.sub.f"]) == {"pkg.sub.e"}  # `from ..sub import e` resolved
    found = problems(root, "pkg")
    assert len(found) == 1, found
    assert "pkg.a, pkg.b, pkg.c" in found[0]
    assert "pkg.a → pkg.b  (line 1)" in found[0] and "pkg.b → pkg.c  (line 2)" in found[0]


def test_checker_finds_a_two_module_circle_and_layering(tmp_path):
    root = _fake_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/model/__init__.py": "",
        "pkg/model/layers.py": "import torch\nfrom ..parallel import plan\n",
        "pkg/parallel/__init__.py": "",
        "pkg/parallel/plan.py": "def g():\n    from pkg.model.layers import Linear\n",
        "pkg/ledger/__init__.py": "",
        "pkg/ledger/memory.py": "import math\nimport torch.nn\nfrom pkg.train import x\n",
        "pkg/train.py": "",
    })
    found = "\n".join(problems(root, "pkg"))
    assert "import circle of 2 modules: pkg.model.layers, pkg.parallel.plan" in found
    assert "pkg.model.layers imports pkg.parallel.plan (line 2)" in found
    assert "pkg.ledger.memory imports pkg.train (line 3)" in found
    assert "pkg.ledger.memory imports torch" in found
    assert "pkg.model.layers imports torch" not in found  # torch is fine in the model


def test_clean_fake_package_passes(tmp_path):
    root = _fake_package(tmp_path, {
        "pkg/__init__.py": "from . import a\n",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "import os\n",
    })
    assert problems(root, "pkg") == []


# ------------------------------------------------------------------------------ the real tree
def test_fived_imports_one_way():
    found = problems(ROOT, "fived")
    assert not found, "\n" + "\n".join(found)


def package_arrows(root: Path, pkg: str) -> dict[str, set[str]]:
    """Sub-package (or top module) → the sub-packages of ``pkg`` it imports."""
    edges, _ = import_graph(root, pkg)

    def top(mod: str) -> str:
        parts = mod.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    out: dict[str, set[str]] = defaultdict(set)
    for a, targets in edges.items():
        for b in targets:
            if top(a) != top(b):
                out[top(a)].add(top(b))
    return out


def documented_arrows(text: str) -> dict[str, set[str]]:
    """The ``name -> a, b.c, ...`` lines of docs/architecture.md, as package → packages."""
    out = {}
    for line in text.splitlines():
        head, sep, rest = line.partition("->")
        if not sep or " " in head.strip() or not head.strip():
            continue
        rest = rest.split("(")[0]
        out[head.strip()] = {t.strip().split(".")[0] for t in rest.split(",") if t.strip()}
    return out


def test_architecture_page_draws_the_real_arrows():
    """docs/architecture.md lists, per package, exactly what it imports from fived."""
    real = package_arrows(ROOT, "fived")
    doc = documented_arrows((ROOT / "docs" / "architecture.md").read_text())
    for name in ("cli", "bench", "viz", "train", "parallel", "optim", "model", "ledger", "ranks",
                 "comm", "data", "checkpoint", "infer", "probe", "ui"):
        assert doc.get(name) == real.get(name, set()), (name, doc.get(name), real.get(name))


def test_the_commands_are_the_top_floor():
    """Nothing imports ``fived.cli`` but itself and ``fived.__main__``: the flag set and the
    tables (``fived.ui``) and the machine probes (``fived.probe``) live below the commands."""
    real = package_arrows(ROOT, "fived")
    assert sorted(k for k, v in real.items() if "cli" in v and k != "cli") == ["__main__"]
