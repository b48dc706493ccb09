"""The report knows no method: labels, families and ablation groups come from what method classes
declare (recorded per side in the results header, or looked up in the registry for older files);
method-specific tables come through the ``specbench.report_tables`` entry-point group; the package's
modules import each other without a circle."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specbench import metrics
from specbench.engine.registry import available_methods
from specbench.records import DECODE_PHASES
from specbench.analysis.report import build_report, side_infos, write_report
from specbench.analysis.report.figures import stage_colors, stages
from specbench.analysis.report.method_tables import _LOCAL, register_table, table_functions
from specbench.analysis.report.names import header_sides, registered_info
from specbench.analysis.report.table import Cell, Table
from test_cli import base_args, cli, read
from test_report import drafted, method_records, vanilla_records, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specbench" / "analysis" / "report"
BLOCK = ("smollm2-135m", 0.0)


def side(method: str, label: str = "", family: str = "", ablation_of: str | None = None) -> dict:
    return {"method": method, "label": label or method, "family": family or method, "ablation_of": ablation_of}


@pytest.fixture
def toy_file(tmp_path: Path) -> Path:
    """Sides of methods no registry knows, described only by the header's `methods` field."""
    methods = {"toy": side("toy", "Toy"), "toy-lite": side("toy-lite", "Toy Lite", "toy", "toy"),
               "toy-plus": side("toy-plus", "Toy+", "toy"), "vanilla": side("vanilla")}
    records = vanilla_records() + method_records("toy", quality=2) + method_records("toy-lite", quality=1) + \
        method_records("toy-plus", quality=3)
    return write_jsonl(tmp_path / "toy.jsonl", records, method="toy", methods=methods)


def test_unknown_methods_are_grouped_by_the_ablation_of_in_the_header(toy_file: Path):
    report = build_report(toy_file, reps=0)
    # toy-lite ablates toy; toy-plus shares the family but is a method in its own right (like +adapt).
    assert [label for label, _ in report.ablation.sections] == ["smollm2-135m · T = 0 · toy"]
    assert [row[0].text for row in report.ablation.sections[0][1]] == ["toy", "toy-lite"]
    assert report.sides[BLOCK]["toy-plus"].family == "toy" and report.sides[BLOCK]["toy-plus"].ablation_of is None


def test_paper_rows_join_by_the_csv_alias_or_the_declared_label(toy_file: Path, tmp_path: Path):
    papers = tmp_path / "papers.csv"
    head = "paper,table,model,hardware,temperature,bench,method,speedup,tau,td_percent,notes,specbench_method\n"
    papers.write_text(head + "P,1,M,H,0,HumanEval,Toy Lite,2.50,3.00,,,\n"  # the label toy-lite declares
                             "P,1,M,H,0,HumanEval,Classic Toy,1.50,2.00,,,toy\n"  # an alias in the CSV
                             "P,1,M,H,0,HumanEval,Toy+,9.99,9.99,,,toy-lite\n")  # the alias wins over a label
    data = build_report(toy_file, paper_numbers=papers, reps=0).papers.data
    pairs = sorted(zip(data.method, data.paper_method))
    assert pairs == [("toy", "Classic Toy"), ("toy-lite", "Toy Lite"), ("toy-lite", "Toy+")]


def test_older_headers_find_each_sides_method_through_the_registry():
    # A header written before `methods` existed: main side relabelled, a sweep and --also specs.
    meta = {"method": "specblock", "label": "specblock-stream", "sweep": None,
            "also": ["specblock-osd@budget=16@label=specblock-osd", "specblock-adapt",
                     "specblock-no-shift@budget=16@path=x@label=specblock-no-shift@budget=16", "sps-confidence",
                     "sps@gamma=2"]}
    infos = side_infos(meta, ["specblock-stream", "specblock-osd", "specblock-adapt", "specblock-no-shift@budget=16",
                              "sps-confidence", "sps@gamma=2", "vanilla", "mystery"])
    assert infos["specblock-stream"].method == "specblock" and infos["sps@gamma=2"].method == "sps"
    assert infos["specblock-no-shift@budget=16"].ablation_of == "specblock"
    for name in ("specblock-adapt", "specblock-osd", "sps-confidence"):  # methods, not ablations
        assert infos[name].ablation_of is None
    assert (infos["specblock-adapt"].family, infos["sps-confidence"].family) == ("specblock", "sps")
    mystery = infos["mystery"]  # a label the header does not declare: a method of its own, nothing read from it
    assert (mystery.method, mystery.label, mystery.family, mystery.ablation_of, mystery.budget) == \
        ("mystery", "mystery", "mystery", None, None)
    sweep = header_sides({"method": "ddtree", "label": "ddtree", "sweep": "budget=8,32"})
    assert {label: (side.method, dict(side.options), side.shown) for label, side in sweep.items()} == \
        {"ddtree@budget=8": ("ddtree", {"budget": "8"}, ("budget",)),
         "ddtree@budget=32": ("ddtree", {"budget": "32"}, ("budget",))}


def test_every_registered_method_declares_a_distinct_label_and_a_registered_base():
    registered = available_methods()
    infos = {name: registered_info(name) for name in registered}
    labels = [info.label for info in infos.values()]
    assert len(set(labels)) == len(labels), labels  # a subclass that forgot its own label repeats its parent's
    for name, info in infos.items():
        assert info.method == name
        assert info.ablation_of is None or info.ablation_of in registered, name
        assert info.family in registered, name


def test_run_header_records_each_sides_method_names(models, tmp_path, capsys):
    out = tmp_path / "run.jsonl"
    args = base_args(models, out, "--sweep", "gamma=1,2", "--also", f"sps@gamma=4@draft={models['draft']}@label=mine")
    args[args.index("--limit") + 1] = "1"
    code, _, err = cli(args, capsys)
    assert code == 0, err
    meta = read(out)[0]["meta"]
    sps = {"method": "sps", "label": "SpS", "family": "sps", "ablation_of": None, "budget_option": None}
    assert meta["methods"] == {"sps@gamma=1": sps, "sps@gamma=2": sps, "mine": sps,
                               "vanilla": {"method": "vanilla", "label": "Vanilla", "family": "vanilla",
                                           "ablation_of": None, "budget_option": None}}
    # The sides as the run declared them: method, options as given, stem and the options the label shows.
    sides = header_sides(meta)
    assert {label: side.method for label, side in sides.items()} == \
        {label: entry["method"] for label, entry in meta["methods"].items() if label != "vanilla"}
    assert sides["sps@gamma=2"].options == {"draft": models["draft"], "gamma": "2"}
    assert (sides["mine"].stem, sides["mine"].shown, sides["mine"].options["gamma"]) == ("mine", (), "4")


def toy_table(blocks, provenance):
    rows = [[Cell(r.method), Cell(str(r.extra["toy"]))] for recs in blocks.values() for r in recs if "toy" in r.extra]
    if not rows:
        return None
    return Table("toy_table", "Toy counts", ["Method", "Count"], [], [("all", rows)], __import__("pandas").DataFrame(),
                 provenance=list(provenance))


def test_a_registered_table_function_is_called_with_the_records(tmp_path: Path):
    records = vanilla_records(benches=("humaneval",)) + method_records("sps", benches=("humaneval",))
    records[-1].extra = {"toy": 7}
    src = write_jsonl(tmp_path / "t.jsonl", records)
    register_table("toy")(toy_table)
    try:
        assert "specblock-rank-head" in table_functions()  # declared in pyproject.toml
        written = {p.name for p in write_report(src, tmp_path / "out", figures=False)}
        assert {"toy_table.md", "toy_table.tex", "toy_table.csv"} <= written
        assert "| sps | 7 |" in (tmp_path / "out" / "toy_table.md").read_text()
        assert "Toy counts" in (tmp_path / "out" / "index.html").read_text()
        assert build_report(write_jsonl(tmp_path / "none.jsonl", records[:-1]), reps=0).table("toy_table") is None
    finally:
        _LOCAL.pop("toy")


def test_a_table_from_an_installed_package_is_found_by_its_entry_point(tmp_path: Path):
    # A throwaway distribution outside the tree: a module and its dist-info with the entry point.
    (tmp_path / "toyreport.py").write_text("def table(blocks, provenance):\n    return None\n")
    info = tmp_path / "toyreport-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyreport\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[specbench.report_tables]\ntoy = toyreport:table\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = "from specbench.analysis.report.method_tables import table_functions; print(table_functions()['toy'].__module__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "toyreport"


def _imports(path: Path) -> set[str]:
    """specbench modules a file imports, anywhere in it (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specbench"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from specbench.analysis.report import build`
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(("specbench", "methods")))
    return found


def test_the_report_package_has_no_import_circle_and_imports_no_method():
    modules = {f"specbench.analysis.report.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    modules["specbench.analysis.orderings"] = ROOT / "specbench" / "analysis" / "orderings.py"
    edges = {m: {i for i in _imports(p) if i in modules} for m, p in modules.items()}
    for m, p in modules.items():
        assert not any(i == "methods" or i.startswith("methods.") for i in _imports(p)), m
    # The package's __init__ imports nothing of its own at import time (its exports load lazily).
    assert not {i for i in _imports(PACKAGE / "__init__.py") if i.startswith("specbench.analysis.report")}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges[m]):
            assert state.get(n) != 1, " -> ".join(path + [n])
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            visit(m, [m])


def test_each_module_imports_first():
    # One fresh interpreter; before each module, every specbench module is forgotten, so each is the
    # first of the project's modules to load (third-party libraries stay loaded, which saves seconds).
    names = sorted(f"specbench.analysis.report.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    script = textwrap.dedent("""
        import importlib, sys
        for name in sys.argv[1:]:
            for loaded in [m for m in sys.modules if m.split(".")[0] in ("specbench", "methods")]:
                del sys.modules[loaded]
            importlib.import_module(name)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script, "specbench.analysis.orderings", *names, "specbench.analysis.report"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_phases_come_from_the_records_engine_phases_first():
    r = drafted("toy", "humaneval", "p0", [1, 2], draft=0.5, verify=0.4, tree_build=0.0)
    r.times = {"toy_update": 0.1, "commit": 0.1, "verify": 0.4, "draft": 0.5, "prefill": 0.1, "toy_index": 0.15}
    assert metrics.phase_names([r]) == ["prefill", "draft", "verify", "commit", "toy_update", "toy_index"]
    assert metrics.draft_subphases([r]) == ["toy_update", "toy_index"]
    assert metrics.phase_breakdown([r])["draft_fwd"] == pytest.approx(0.25)
    names = stages([r])
    assert names == ["draft_fwd", "toy_update", "toy_index", "verify", "commit"]
    colors = stage_colors(names)
    assert len(set(colors.values())) == len(names)
    r.times["compile"] = 0.05  # the engine's compile phase sits between draft and verify wherever it is timed
    assert metrics.phase_names([r])[:4] == ["prefill", "draft", "compile", "verify"]
    assert metrics.draft_subphases([r]) == ["toy_update", "toy_index"]  # never a drafter's part of draft
    assert "compile" in DECODE_PHASES and stages([r])[3] == "compile"  # a stage once records time it


def test_figures_with_many_methods_split_into_panels_whose_legends_stay_on_the_canvas(tmp_path):
    """Thirty methods in one block: at most MAX_SERIES per panel (a family kept whole where it fits), each panel's
    legend inside the figure (nothing cut off), and the layout still solves (no collapsed axes)."""
    import warnings

    from specbench.analysis.report.figures import (MAX_SERIES, acceptance_figure, histogram_figure, panels,
                                                   save_figure, stage_figure)

    families = {f"method-{i}": f"family-{i % 4}" for i in range(30)}
    groups = panels(list(families), families)
    assert all(len(members) <= MAX_SERIES for _, members in groups)
    assert sorted(m for _, members in groups for m in members) == sorted(families)
    assert all(len({families[m] for m in members}) == len(names.split(", ")) for names, members in groups)
    many_hist = histogram_figure({m: {1: 0.5, 2: 0.3, 3: 0.2} for m in families}, "many methods", families)
    many_rates = acceptance_figure({m: [0.6, 0.5, 0.4] for m in families}, "many methods", families)
    shares = {m: {"draft_fwd": 0.3, "verify": 0.6, "commit": 0.1} for m in families}
    for name, fig in (("hist", many_hist), ("rates", many_rates), ("stages", stage_figure(shares, "stages"))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # matplotlib warns when a legend squeezes the axes to nothing
            save_figure(fig, tmp_path / name)
        canvas = fig.bbox
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
        assert legends and all(len(legend.get_texts()) <= MAX_SERIES for legend in legends)
        for legend in legends:
            box = legend.get_window_extent()
            assert box.x0 >= canvas.x0 - 1 and box.x1 <= canvas.x1 + 1 and box.y0 >= canvas.y0 - 1 \
                and box.y1 <= canvas.y1 + 1, name
    assert len([ax for ax in many_rates.axes if ax.get_visible()]) == len(groups) >= 3
    few = histogram_figure({"a": {1: 1.0}, "b": {2: 1.0}}, "two methods")
    assert not few.legends and len(few.axes) == 1 and few.axes[0].get_legend() is not None


def test_speedup_vs_drafting_cost_labels_do_not_overprint(tmp_path):
    """Eight methods at nearly one point: every label still gets a place of its own, and each point has its interval."""
    import pandas as pd

    from specbench.analysis.report.figures import label_box, save_figure, tradeoff_figure

    points = pd.DataFrame({"speedup": [1.0 + 0.005 * i for i in range(8)], "lo": [0.9] * 8, "hi": [1.2] * 8,
                           "td_percent": [20.0 + 0.1 * i for i in range(8)]},
                          index=pd.Index([f"a-long-method-name-{i}" for i in range(8)], name="method"))
    fig = tradeoff_figure(points, "crowded")
    save_figure(fig, tmp_path / "crowded")
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()  # the labels' placement drew the figure on an Agg canvas
    boxes = [label_box(t, renderer) for t in ax.texts]
    assert len(boxes) == 8
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert len(ax.containers) == 8  # an error bar (the interval) per point