"""The house's rules, read from the source: imports flow one way and never in a circle, and the product's text
points only inside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lightning_oomb", "csrc_triton")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from a import b`` names module ``a.b`` when that is one;
    parent packages imported implicitly do not count)."""
    modules = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert not node.level, f"{name}: the project uses absolute imports"
                base = node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_imports_flow_one_way():
    """Kernels import nothing of the project; the engine nothing of the Lightning layer or the integrations;
    the integrations nothing of the Lightning layer; the pages module is a leaf of the engine."""
    graph = import_graph()
    lightning_layer = {m for m in graph if m.startswith("lightning_oomb.") and ".engine" not in m
                       and ".integrations" not in m} | {"lightning_oomb"}  # fmt: skip
    for module, imports in graph.items():
        if module.startswith("csrc_triton"):
            assert not {i for i in imports if i.startswith("lightning_oomb")}, module
        if module.startswith("lightning_oomb.engine"):
            assert not imports & lightning_layer, module
            assert not {i for i in imports if i.startswith("lightning_oomb.integrations")}, module
        if module.startswith("lightning_oomb.integrations"):
            assert not imports & lightning_layer, module
    assert graph["lightning_oomb.engine.pages"] <= {"lightning_oomb.engine.errors"}
    assert not {i for i in graph["lightning_oomb.engine.offload.schedule"] if i.startswith("lightning_oomb")}


def test_engine_and_integrations_do_not_import_lightning():
    for path in [*(ROOT / "lightning_oomb" / "engine").rglob("*.py"), *(ROOT / "lightning_oomb" / "integrations").rglob("*.py"),
                 *(ROOT / "csrc_triton").rglob("*.py")]:  # fmt: skip
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n == "lightning" or n.startswith("lightning.")], path


def test_nothing_points_outside_the_repository():
    """README, docs, CHANGELOG, docstrings and configs name only files of this repository."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")]
    files += [p for d in ("lightning_oomb", "csrc_triton", "examples", "benchmarks") for p in (ROOT / d).rglob("*")
              if p.suffix in (".py", ".yaml", ".sh")]  # fmt: skip
    outside = re.compile(r"\.\./shared|shared/DESIGN|notes/(lightning|hf)-integration|DESIGN\.md")
    offenders = [str(p.relative_to(ROOT)) for p in files if outside.search(p.read_text())]
    assert not offenders, offenders
    links = re.compile(r"\]\((?!https?://|#)([^)#]+)")
    for p in files:
        if p.suffix == ".md":
            for target in links.findall(p.read_text()):
                assert (p.parent / target).exists(), f"{p.relative_to(ROOT)} links to missing {target}"
