"""The layers of DESIGN.md, checked on every import statement of the source tree:

    controller/                 may import anything below it; of worker/ only the actor
    worker/                     worker, programs, slicewise.common
    programs/                   programs, slicewise.common
    slicewise (client library)  slicewise, protos; never the server side
    slicewise.common            slicewise.common only: the vocabulary everyone shares

Imports inside functions count as much as those at the top of a file: a lazy import
is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("controller", "worker", "programs", "slicewise", "protos", "benchmarks")


def layer_of(module: str) -> str:
    """The layer a dotted module name belongs to ("" when it is not ours)."""
    top = module.split(".")[0]
    if top not in OURS:
        return ""
    if module == "slicewise.common" or module.startswith("slicewise.common."):
        return "common"
    return top


# layer -> the layers it may import (its own included)
ALLOWED = {
    "common": {"common"},
    "slicewise": {"slicewise", "common", "protos"},
    "programs": {"programs", "common"},
    "worker": {"worker", "programs", "common"},
    "controller": {
        "controller",
        "worker",
        "programs",
        "slicewise",
        "common",
        "protos",
        "benchmarks",
    },
}
# controller/ names the actor class it launches, and nothing else of worker/.
CONTROLLER_MAY_IMPORT_FROM_WORKER = {"worker.actor"}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in the file, with `from a import b`
    reported as `a.b` when `a.b` is a module of ours (so `from controller import wire`
    counts as importing controller.wire)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                where = root / Path(*candidate.split("."))
                is_module = where.with_suffix(".py").exists() or where.is_dir()
                found.append((node.lineno, candidate if is_module else node.module))
    return found


def violations(package: str, root: Path = ROOT) -> list[str]:
    """Every import in `package` (a top-level folder under `root`) that its layer forbids."""
    bad = []
    for path in sorted((root / package).rglob("*.py")):
        if "_pb2" in path.name:
            continue
        layer = layer_of(module_name(path, root))
        where = path.relative_to(root)
        for line, module in imports_of(path, root):
            target = layer_of(module)
            if not target:
                continue
            if target not in ALLOWED[layer]:
                bad.append(f"{where}:{line}: {layer} imports {module}")
            elif (layer, target) == ("controller", "worker") and not any(
                module == m or module.startswith(m + ".") for m in CONTROLLER_MAY_IMPORT_FROM_WORKER
            ):
                bad.append(
                    f"{where}:{line}: controller imports {module} "
                    "(only worker.actor, to name the actor class it launches)"
                )
    return bad


@pytest.mark.parametrize("package", ["slicewise", "programs", "worker", "controller"])
def test_no_import_crosses_a_layer_upwards(package):
    assert violations(package) == []


def test_the_check_sees_forbidden_imports(tmp_path):
    # A tree of our shape whose worker imports the controller lazily, and whose
    # controller reaches past the actor into the worker's executor.
    (tmp_path / "worker").mkdir()
    (tmp_path / "controller").mkdir()
    (tmp_path / "controller" / "gang.py").write_text("from worker.executor import X\n")
    (tmp_path / "worker" / "executor.py").write_text("X = 1\n")
    (tmp_path / "worker" / "bad.py").write_text(
        "def f():\n    from controller import gang\n    return gang\n"
    )
    assert violations("worker", tmp_path) == ["worker/bad.py:2: worker imports controller.gang"]
    assert violations("controller", tmp_path) == [
        "controller/gang.py:1: controller imports worker.executor (only worker.actor, to "
        "name the actor class it launches)"
    ]


def test_the_client_library_imports_without_the_server():
    # In a fresh interpreter: `import slicewise` and a client call's module load no
    # part of controller/ or worker/.
    import subprocess
    import sys

    code = (
        "import sys, slicewise, slicewise.client; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('controller', 'worker')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr
