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


def test_the_cli_does_not_import_torch_nor_cryptography_on_start():
    import subprocess
    import sys
    code = "import sys, orchestrator.cli.main; print([m for m in ('torch', 'cryptography') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", ("the CLI must start fast: keep torch and cryptography (the controller's "
                                        "TLS) out of its imports")


def test_the_controller_answers_a_nodes_attempt_without_importing_torch():
    """The answer to an agent's `attempt` request names the planned hardware; that name came from the optimizer's
    backend, whose import loads torch: seconds in which the controller answered no heartbeat, and on a busy
    machine it failed both nodes of a job for 'no heartbeat for 3s' as their first attempt began."""
    import subprocess
    import sys
    code = ("import sys, orchestrator.control.controller, orchestrator.control.handlers\n"
            "from orchestrator.planning.placement import planned_hardware\n"
            "names = planned_hardware({}, True), planned_hardware({'accelerator': 'H100'}, False)\n"
            "print(all('@' in n for n in names), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr


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


# orchestrator/ is one folder per role; each may import only the roles listed (and the shared spec and home).
ROLE_IMPORTS = {
    "sdk": {"sdk"},                                   # runs in the user's training process: nothing else
    "agent": {"agent", "sdk"},                        # talks to the controller with the SDK's client
    "planning": {"planning"},
    "control": {"control", "planning", "sdk"},        # sdk: the API's wire constants come from its client
    "k8s": {"k8s", "control", "planning", "sdk"},
    "cli": {"cli", "control", "planning", "k8s", "sdk"},
}
SHARED = {"spec", "home"}


def imports_of(folder: Path) -> dict[str, set[str]]:
    """Every dotted name each file under `folder` imports (`from a.b import c` gives a.b and a.b.c)."""
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        names = found.setdefault(str(path.relative_to(ROOT)), set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_every_orchestrator_module_belongs_to_a_role_or_is_shared():
    top = {p.stem for p in (ROOT / "orchestrator").glob("*.py")} - {"__init__"}
    folders = {p.name for p in (ROOT / "orchestrator").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert top == SHARED and folders == set(ROLE_IMPORTS), (top, folders)


def test_each_role_imports_only_the_roles_below_it():
    for role, allowed in ROLE_IMPORTS.items():
        for file, names in imports_of(ROOT / "orchestrator" / role).items():
            used = {n.split(".")[1] for n in names if n.startswith("orchestrator.")}
            assert used <= allowed | SHARED, f"{file} imports orchestrator.{sorted(used - allowed - SHARED)}"


def test_the_sdk_imports_no_provider_and_the_agent_no_cloud_driver():
    from providers.registry import DRIVERS
    drivers = {module for module, _ in DRIVERS.values()}
    for file, names in imports_of(ROOT / "orchestrator" / "sdk").items():
        assert not {n for n in names if n.split(".")[0] in ("providers", "health")}, f"{file} imports {names}"
    for file, names in imports_of(ROOT / "orchestrator" / "agent").items():
        assert not {n for n in names if ".".join(n.split(".")[:2]) in drivers}, f"{file} imports a cloud driver"


# A function this long or a class this large is a place where two jobs hide; one over the limit needs a reason here.
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 60, 300
OVERSIZED: dict[str, str] = {}   # "path:name" -> why it stays whole


def test_no_function_or_class_in_the_orchestrator_or_health_is_oversized():
    found = []
    for package in ("orchestrator", "health"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                limit = (MAX_FUNCTION_LINES if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                         else MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else None)
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'name', '')}"
                if limit and node.end_lineno - node.lineno + 1 > limit and where not in OVERSIZED:
                    found.append(f"{where} ({node.end_lineno - node.lineno + 1} lines)")
    assert not found, f"over {MAX_FUNCTION_LINES} lines a function or {MAX_CLASS_LINES} a class: {found}"
