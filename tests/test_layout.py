"""Architecture checks: the library imports neither Ray nor MLflow; no module imports itself in a circle."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dmltrain"
LIBRARY = [
    "dmltrain.losses",
    "dmltrain.engine",
    "dmltrain.data",
    "dmltrain.models",
    "dmltrain.evaluation",
    "dmltrain.verification",
    "dmltrain.plots",
    "dmltrain.distributed",
    "dmltrain.index",
    "dmltrain.inference",
    "dmltrain.acceleration",
    "dmltrain.small_convs",
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every dmltrain module `path` imports, at any depth of the file (lazy imports count: a cycle through
    a function-level import is still a cycle in the design)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name in known:
                found.add(name)
    return found


def test_no_import_cycles() -> None:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _imports(path, set(files)) - {name} for name, path in files.items()}
    # A package's __init__ re-exporting its submodules is not a cycle of design: drop child -> parent edges
    # that only exist because `from pkg.sub import x` names the parent package.
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not (name.startswith(d + ".") and files[d].name == "__init__.py")}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_library_imports_neither_ray_nor_mlflow() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in LIBRARY)
        + "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'mlflow'))\n"
        + "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_library_does_not_import_the_service() -> None:
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        if name.startswith("dmltrain.service") or name in ("dmltrain.run",):
            continue
        service = {
            m
            for m in _imports(path, {_module_name(p) for p in PACKAGE.rglob("*.py")})
            if m.startswith("dmltrain.service")
        }
        assert not service, f"{name} imports the service: {sorted(service)}"


def test_the_command_line_rejects_a_config_typo_before_loading_torch_ray_or_mlflow() -> None:
    """`python -m dmltrain.run` reads the config before it imports the launch: a typo costs a fraction of a
    second, not the several seconds torch, Ray and MLflow take to import."""
    code = (
        "import sys\n"
        "from dmltrain.run import main\n"
        "status = main(['configs/quickstart.yaml', 'optim.lr_rate=0.1'])\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray', 'mlflow'})\n"
        "print(status, heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["2", "[]"], result.stdout
    assert "error: invalid config configs/quickstart.yaml" in result.stderr
    assert "optim.lr_rate: unknown key" in result.stderr


@pytest.mark.parametrize(
    "argv",
    [["--version"], ["--help"], ["prepare", "--help"], ["train", "configs/quickstart.yaml", "trian.steps=1"]],
)
def test_the_dmltrain_command_answers_help_version_and_typos_before_loading_torch(argv: list[str]) -> None:
    """`dmltrain --help` took 4 s on a 2-core machine: listing the data set formats imported `dmltrain.data`,
    whose package imported torch and torchvision (and its metadata webdataset, which imports torch too)."""
    code = (
        "import sys\n"
        "from dmltrain.service.cli import main\n"
        "try:\n"
        f"    status = main({argv!r})\n"
        "except SystemExit as stop:\n"
        "    status = stop.code\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'torchvision', 'ray', 'mlflow'})\n"
        "print('STATUS', status, heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    status, heavy = result.stdout.split("STATUS ")[-1].split(" ", 1)
    assert heavy.strip() == "[]" and status == ("2" if argv[0] == "train" else "0"), result.stdout[-500:]
    if argv == ["--version"]:
        assert re.match(r"dmltrain \d+\.\d+\.\d+ \(python 3\.\d+\.\d+; torch \d", result.stdout), (
            result.stdout
        )
