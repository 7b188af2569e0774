"""The direction of imports between packages (DESIGN.md): orchestrator -> providers, health, optimizer."""
from __future__ import annotations

import ast
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
