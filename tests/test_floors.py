"""The package is a house of floors: each module imports only from its own floor or the ones below,
and no modules import each other in a circle. Imports are read with ast, function-level and
TYPE_CHECKING imports included. Also: the baseline's name is defined once."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specbench"
# Top floor first. A module's floor is that of its longest listed prefix.
FLOORS = {
    "specbench.cli": 6, "specbench.console": 6, "specbench.__main__": 6,  # the command line
    "specbench.run": 5,  # the runner, run configurations, paper plans, parity, merging parts, the writer
    "specbench.analysis": 4,  # result files -> tables, figures, orderings, the export
    "specbench.training": 3,  # trains drafters on the target's answers
    "specbench.data": 2,  # what run, training and analysis share: bench cards, streams, result files, presets
    "specbench.engine": 1,  # the decode loop, the target, trees, verification, the clock, the baseline
    "specbench": 0,  # the ground: errors, the generation record and its metrics
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports (``from a import b`` counts a.b where that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found.add(full if full in known else node.module)
    return {m for m in found if m in known}


def floor(module: str) -> int:
    return FLOORS[max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)]


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(p, set(mods)) - {m} for m, p in mods.items()}


def test_no_arrow_runs_up_a_floor():
    up = [f"{a} (floor {floor(a)}) -> {b} (floor {floor(b)})"
          for a, targets in graph().items() for b in sorted(targets) if floor(b) > floor(a)]
    assert not up, "imports from a lower floor up:\n" + "\n".join(up)


def test_no_import_circle():
    edges, state, circles = graph(), {}, []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                circles.append(" -> ".join(path[path.index(n):] + [n]))
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_checker_sees_an_upward_arrow_and_a_circle(tmp_path):
    # The parser is the one the tests above use: a function-level import counts.
    source = tmp_path / "x.py"
    source.write_text("def f():\n    from specbench.cli import main\n    from specbench.engine import VANILLA\n")
    assert imports(source, {"specbench.cli", "specbench.engine"}) == {"specbench.cli", "specbench.engine"}
    assert floor("specbench.engine.target") == 1 and floor("specbench.metrics") == 0 and floor("specbench.cli") == 6


def within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_training_and_analysis_read_the_data_floor_not_run():
    """A trainer or a report reads bench cards, result files and presets from specbench.data, never from run/
    (none of the runner comes with them), and the data floor imports nothing of the three above it."""
    assert floor("specbench.data.results") < floor("specbench.training.fit") < floor("specbench.run.runner")
    assert floor("specbench.analysis.orderings") < floor("specbench.run.runner")
    above_data = ("specbench.run", "specbench.training", "specbench.analysis", "specbench.cli")
    wrong = [f"{a} -> {b}" for a, targets in graph().items() for b in sorted(targets)
             if (within(a, "specbench.training", "specbench.analysis") and within(b, "specbench.run"))
             or (within(a, "specbench.data") and within(b, *above_data))]
    assert not wrong, "\n".join(wrong)


def test_the_baseline_name_is_defined_once():
    definitions = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant) \
                    and node.value.value == "vanilla":
                definitions.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert definitions == ["specbench/engine/__init__.py:3"], definitions
