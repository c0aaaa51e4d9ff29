"""The import graph of ``recsys_core`` and ``dlrm_app``: no circles, no arrows back up.

Every module's imports are read with ``ast`` (module level and inside functions, ``from . import
x`` resolved, ``importlib.import_module("...")`` with a literal name); imports under ``if
TYPE_CHECKING:`` never run and are left out. ``from a.b import c`` is an arrow to ``a.b.c`` when
that is a module, else to ``a.b``. Two checks:

- no circle between modules (a strongly connected set of two or more modules);
- no arrow from a lower layer to a higher one (``LAYERS``, ground floor first).

Reads source only (no import), so it is fast and needs no torch.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("recsys_core", "dlrm_app")

# Ground floor first; a module belongs to the longest prefix that names it. A module may import
# from its own layer or any layer below, never from one above.
LAYERS: list[tuple[tuple[str, ...], str]] = [
    (("recsys_core.types", "recsys_core.streamable", "recsys_core.sparse._native_lib",
      "recsys_core.sparse._native"),
     "plain enums, protocols and the C helpers' loader: they need torch and nothing else"),
    (("recsys_core.kernels",), "the only fbgemm_gpu import and its torch fallback: tensors in, out"),
    (("recsys_core.sparse",), "JaggedTensor / KJT / KeyedTensor, built on the kernels' sparse ops"),
    (("recsys_core.optim",), "fused optimizer configs and keyed optimizers over kernel tables"),
    (("recsys_core.modules",), "unsharded embedding modules: sparse types in, kernels, optim"),
    (("recsys_core.datasets",), "sample batches (sparse types) for models and serving"),
    (("recsys_core.models",), "DLRM / DeepFM composed from modules"),
    (("recsys_core.plan",), "plan data (ShardingPlan, ParameterSharding) about modules' tables"),
    (("recsys_core.quant",), "quantized collections and their one-process placement by plan data"),
    (("recsys_core.planner",), "plans modules' tables into plan data; needs no runtime"),
    (("recsys_core.distributed",), "the runtime: sharders, sharded modules, DMP (asks the planner)"),
    (("recsys_core.fx",), "the tracer, which resolves the runtime's awaitables"),
    (("recsys_core.inference",), "serving helpers over quant and the runtime's quant sharders"),
    (("recsys_core.metrics",), "rec metrics: a leaf that uses torch alone"),
    (("recsys_core.testing",), "the gloo harness that runs sharded code against unsharded"),
    (("recsys_core",), "the package's public re-exports, over everything it re-exports"),
    (("dlrm_app",), "the application, above all of recsys_core (which never imports it)"),
]

# Circles and arrows back up accepted for now, each to be cut (none today). Each entry must
# still occur, so a cut one is removed from the list.
KNOWN_CIRCLES: list[frozenset[str]] = []
KNOWN_ARROWS: list[tuple[str, str]] = []


class Arrow(NamedTuple):
    src: str
    dst: str
    where: str  # path:line of the import


def find_modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for .py files and compiled extensions (which import nothing here),
    found by their built file or their C source: a checkout need not have built them."""
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*")):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            if path.suffix == ".py":
                parts = list(path.relative_to(root).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
            elif path.suffix in (".so", ".pyd", ".c"):  # an extension, built or not yet
                parts = list(path.relative_to(root).parts)
                parts[-1] = parts[-1].split(".")[0]
            else:
                continue
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(module: str, path: Path, tree: ast.AST) -> Iterator[tuple[list[str], int]]:
    """(candidate dotted names, best first; line) for every import that runs."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield [alias.name], child.lineno
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[: len(package) - (child.level - 1)]
                    src = ".".join(base + ([child.module] if child.module else []))
                else:
                    src = child.module or ""
                for alias in child.names:  # a submodule if there is one, else the package
                    yield [f"{src}.{alias.name}", src], child.lineno
            elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                  and child.func.attr == "import_module" and child.args
                  and isinstance(child.args[0], ast.Constant)
                  and isinstance(child.args[0].value, str)):
                yield [child.args[0].value], child.lineno
            stack.append(child)


def find_arrows(root: Path = REPO) -> tuple[dict[str, Path], list[Arrow]]:
    mods = find_modules(root)
    arrows: list[Arrow] = []
    for module, path in mods.items():
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for candidates, line in _imported_names(module, path, tree):
            name = next((c for c in candidates if c in mods), candidates[-1])
            while name and name not in mods:  # ``import a.b.c`` of a name inside a.b
                name = name.rpartition(".")[0]
            if name and name != module:
                arrows.append(Arrow(module, name, f"{path.relative_to(root)}:{line}"))
    return mods, sorted(set(arrows), key=lambda a: (a.src, a.where, a.dst))


def circles(nodes: Iterable[str], arrows: list[Arrow]) -> list[list[str]]:
    """Strongly connected sets of two or more modules (Tarjan, iterative), each sorted."""
    adj: dict[str, list[str]] = defaultdict(list)
    for a in arrows:
        adj[a.src].append(a.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(adj[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(adj[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for level, (prefixes, _reason) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = level, len(prefix)
    if best < 0:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS in {__file__}")
    return best


def back_arrows(arrows: list[Arrow]) -> list[Arrow]:
    return [a for a in arrows if layer_of(a.dst) > layer_of(a.src)]


def _known_arrow(a: Arrow) -> bool:
    return (a.src, a.dst) in KNOWN_ARROWS


def describe_circle(comp: list[str], arrows: list[Arrow]) -> str:
    """The circle's modules and its arrows inside it, each with file:line."""
    inside = set(comp)
    lines = [f"  {a.src} -> {a.dst} ({a.where})" for a in arrows
             if a.src in inside and a.dst in inside]
    return "circle of " + ", ".join(comp) + ":\n" + "\n".join(lines)


def measure(root: Path = REPO) -> tuple[list[list[str]], list[Arrow]]:
    """All circles and arrows back up, KNOWN ones included (for reports: `python this_file`)."""
    mods, arrows = find_arrows(root)
    return circles(mods, arrows), back_arrows(arrows)


def test_no_import_circles() -> None:
    mods, arrows = find_arrows()
    found = circles(mods, [a for a in arrows if not _known_arrow(a)])
    new = [c for c in found if frozenset(c) not in KNOWN_CIRCLES]
    assert not new, "import circles (cut one arrow of each):\n" + "\n".join(
        describe_circle(c, arrows) for c in new)
    stale = [sorted(k) for k in KNOWN_CIRCLES if list(sorted(k)) not in found]
    assert not stale, f"no longer a circle, remove it from KNOWN_CIRCLES: {stale}"


def test_no_arrows_back_up() -> None:
    _, arrows = find_arrows()
    up = [a for a in back_arrows(arrows) if not _known_arrow(a)]
    assert not up, "imports from a lower layer to a higher one (see LAYERS):\n" + "\n".join(
        f"  {a.where}: {a.src} (layer {layer_of(a.src)}) -> {a.dst} (layer {layer_of(a.dst)})"
        for a in up)
    present = {(a.src, a.dst) for a in arrows}
    stale = [k for k in KNOWN_ARROWS if k not in present]
    assert not stale, f"no longer imported, remove it from KNOWN_ARROWS: {stale}"


def test_recsys_core_never_imports_dlrm_app() -> None:
    _, arrows = find_arrows()
    bad = [a for a in arrows if a.src.startswith("recsys_core") and a.dst.startswith("dlrm_app")]
    assert not bad, "\n".join(f"{a.where}: {a.src} imports {a.dst}" for a in bad)


def test_the_checks_see_what_they_must(tmp_path: Path) -> None:
    """A package with a lazy circle through ``from . import x`` and an import under
    TYPE_CHECKING (not an arrow): the circle is found, with its file:line."""
    pkg = tmp_path / "recsys_core" / "sparse"
    pkg.mkdir(parents=True)
    (tmp_path / "recsys_core" / "__init__.py").write_text("")
    (tmp_path / "dlrm_app").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from recsys_core.sparse.a import f\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from recsys_core import x\n"
        "import importlib\nimportlib.import_module('recsys_core.kernels')\n")
    mods, arrows = find_arrows(tmp_path)
    assert sorted((a.src, a.dst, a.where) for a in arrows) == [
        ("recsys_core.sparse.a", "recsys_core.sparse.b", "recsys_core/sparse/a.py:2"),
        ("recsys_core.sparse.b", "recsys_core.sparse.a", "recsys_core/sparse/b.py:1"),
        ("recsys_core.sparse.c", "recsys_core", "recsys_core/sparse/c.py:5"),
    ]
    assert circles(mods, arrows) == [["recsys_core.sparse.a", "recsys_core.sparse.b"]]
    assert [a.where for a in back_arrows(arrows)] == ["recsys_core/sparse/c.py:5"]


if __name__ == "__main__":  # the counts, for reports
    found, up = measure(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
    pairs = sorted({(a.src.split(".")[1] if a.src.count(".") else a.src,
                     a.dst.split(".")[1] if a.dst.count(".") else a.dst) for a in up})
    print(f"{len(found)} circles, {len(up)} imports back up "
          f"({len({(a.src, a.dst) for a in up})} module pairs, {len(pairs)} package pairs)")
    for c in found:
        print("circle:", " ".join(c))
    for p in pairs:
        print("up:", " -> ".join(p))
