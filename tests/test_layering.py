"""The direction of imports between packages (DESIGN.md): orchestrator -> providers, health, optimizer;
and within health, no cycle."""
from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("providers", "health", "optimizer")


def imported_packages(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def test_peers_never_import_the_orchestrator_or_each_other():
    for package in PEERS:
        imports = imported_packages(package)
        forbidden = {"orchestrator", "tfsn"} | (set(PEERS) - {package})
        offenders = {name: files for name, files in imports.items() if name in forbidden}
        assert not offenders, f"{package} imports {offenders}"


def test_the_cli_does_not_import_torch_on_start():
    import subprocess
    import sys
    code = "import sys, orchestrator.cli.main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "the CLI must start fast: keep torch out of its imports"


def imported_modules(package: str) -> dict[str, set[str]]:
    """For each module of the package, the package's modules it imports (TYPE_CHECKING and local imports too)."""
    modules = {path.stem for path in (ROOT / package).glob("*.py")} - {"__init__"}
    graph: dict[str, set[str]] = {}
    for module in modules:
        path = ROOT / package / f"{module}.py"
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):   # `from health import x` and `from . import x` name modules too
                base = ".".join([package] * bool(node.level) + [node.module] * bool(node.module))
                names += [base] + [f"{base}.{a.name}" for a in node.names]
        graph[module] = {name.split(".")[1] for name in names
                         if name.startswith(f"{package}.") and name.split(".")[1] in modules} - {module}
    return graph


def test_health_modules_do_not_import_each_other_in_a_cycle():
    try:
        TopologicalSorter(imported_modules("health")).prepare()
    except CycleError as err:
        raise AssertionError(f"health's modules import each other in a cycle: {' -> '.join(err.args[1])}") from None
