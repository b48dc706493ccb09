"""The documents read as documents: no line a reader must scroll sideways for, method notes the code
can cite (every `docs/methods.md#<section>` the code names is a heading there), no citation of a
document that is not in the project, and a README whose set-up commands are the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]
METHODS_PAGE = REPO / "docs" / "methods.md"
LONGEST_LINE = 300
CITATION = re.compile(r"docs/methods\.md#([a-z0-9_-]+)")
SOURCES = [p for folder in ("specbench", "methods", "bench", "tests") for p in sorted((REPO / folder).rglob("*"))
           if p.suffix in (".py", ".yaml", ".md", ".csv")]


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)  # no headings in code
    return {anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def test_anchor_follows_github():
    assert anchor("EAGLE-3 training") == "eagle-3-training"
    assert anchor("SpecBlock serving-time adaptation") == "specblock-serving-time-adaptation"
    assert anchor("Files on disk: nothing lost, nothing overwritten") == "files-on-disk-nothing-lost-nothing-overwritten"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_line_over_300_characters(page: Path):
    long = [(n, len(line)) for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > LONGEST_LINE]
    assert not long, f"{page.name}: lines over {LONGEST_LINE} characters (line, length): {long}"


def test_method_notes_have_a_section_per_method():
    """Every family has a section named by its label, and every registered method is named on the page."""
    from specbench.engine.registry import available_methods, method_class

    page, sections = METHODS_PAGE.read_text(encoding="utf-8"), anchors(METHODS_PAGE)
    names = {name: method_class(name).report_names() for name in available_methods()}
    bases = {name: info["label"] for name, info in names.items() if info["family"] == name}
    assert {"specblock", "sps", "vanilla"} <= set(bases)
    missing = sorted(label for label in bases.values() if anchor(label) not in sections)
    assert not missing, f"docs/methods.md has no section for {missing}"
    unnamed = sorted(name for name in names if f"`{name}`" not in page)
    assert not unnamed, f"docs/methods.md never names {unnamed}"


def test_every_citation_of_the_method_notes_names_a_section():
    sections = anchors(METHODS_PAGE)
    cited = {(p.relative_to(REPO).as_posix(), a) for p in SOURCES + DOCS
             for a in CITATION.findall(p.read_text(encoding="utf-8", errors="replace"))}
    assert cited, "the code cites docs/methods.md nowhere"
    dangling = sorted((where, a) for where, a in cited if a not in sections)
    assert not dangling, f"citations of docs/methods.md sections that do not exist: {dangling}"
    links = set(re.findall(r"\]\(#([a-z0-9_-]+)\)", METHODS_PAGE.read_text(encoding="utf-8")))
    assert links <= sections, f"docs/methods.md links to missing sections: {sorted(links - sections)}"


def test_no_citation_of_documents_outside_the_project():
    outside = ("METHODS" + ".md", "DESIGN" + ".md", "METHODS" + " §", "shared" + "/papers")  # split: no self-match
    found = [(p.relative_to(REPO).as_posix(), name) for p in SOURCES + DOCS
             for name in outside if name in p.read_text(encoding="utf-8", errors="replace")]
    assert not found, f"citations of documents that are not in the project: {found}"


def _make_recipe(target: str) -> list[str]:
    """The commands of one Makefile target (its recipe lines, comments dropped)."""
    lines = (REPO / "Makefile").read_text(encoding="utf-8").splitlines()
    start = lines.index(f"{target}:") if f"{target}:" in lines else next(
        i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        if not line.strip().startswith("#"):
            recipe.append(line.strip())
    return recipe


def test_readme_quick_start_is_what_ci_and_make_run():
    """The README's set-up block is the two commands CI runs, and its main job is `make run`'s command."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    setup = re.search(r"## Install\n.*?```bash\n(.*?)```", readme, re.DOTALL)
    assert setup, "README has no Install section with a bash block"
    commands = [line.split("#")[0].strip() for line in setup.group(1).splitlines() if line.split("#")[0].strip()]
    assert commands == ["make setup", "make test"]
    assert all(re.search(rf"^{re.escape(c)}$", ci, re.MULTILINE) for c in commands), ".ci/run no longer runs them"
    job = re.search(r"## The main job\n.*?```bash\n(.*?)```", readme, re.DOTALL)
    assert job, "README has no main-job section with a bash block"
    run_recipe = _make_recipe("run")
    assert [line.replace("$(VENV)", ".venv") for line in run_recipe] == [job.group(1).strip()]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_links_between_documents_resolve(page: Path):
    """Every relative link of a page names a file of the project, and every #section one of its headings."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        path, _, section = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (section and linked.suffix == ".md" and section not in anchors(linked)):
            broken.append(target)
    assert not broken, f"{page.name}: links that lead nowhere: {broken}"
