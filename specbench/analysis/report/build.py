"""The report: result files -> every table (and the figures) -> files on disk, or the main table
for the console."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import pandas as pd

from specbench.analysis.orderings import ordering_frame, orderings_table
from specbench.records import GenerationRecord
from specbench.analysis.report.batch import batch_detail_table, batch_frame, batch_table, split_batched
from specbench.analysis.report.drafters import drafters_table
from specbench.analysis.report.engines import engine_table
from specbench.analysis.report.figures import write_figures
from specbench.analysis.report.method_tables import registered_tables
from specbench.analysis.report.names import Block, MethodInfo
from specbench.analysis.report.papers import (DEFAULT_PAPER_NUMBERS, load_paper_numbers, paper_comparison_table, paper_files,
                                     paper_metric_table)
from specbench.analysis.report.records import (PathSpec, ResultFile, apart_dtypes, block_records, block_sides,
                                              load_result_files)
from specbench.analysis.report.checks import (aa_labels, aa_table, divergence_table, hardware_label, machine_slug,
                                             split_by_machine, without_aa)
from specbench.analysis.report.cost import block_curves, cost_table
from specbench.analysis.report.owned import owned_files, remove_stale, write_manifest
from specbench.analysis.report.page import render_index_html
from specbench.analysis.report.render import flat_headers, render_csv, render_latex, render_markdown
from specbench.analysis.report.stats import (BOLD_REPS, BOOTSTRAP_REPS, BOOTSTRAP_SEED, blocks_of_kind, cell_frame,
                                    dirty_cells, loaded_cells, mean_frame, method_frame, of_kind, significant_cells)
from specbench.analysis.report.table import Table
from specbench.analysis.report.tables import ablation_table, companion_table, main_table, provenance_lines, streams_table


@dataclass
class Report:
    files: list[ResultFile]
    blocks: dict[Block, list[GenerationRecord]]
    cells: pd.DataFrame  # every (block, method, bench) cell, mixed streams included
    methods: pd.DataFrame  # per (block, method) over the single benchmarks' records
    main: Table
    companion: Table
    ablation: Table | None
    papers: Table | None
    method_tables: list[Table] = field(default_factory=list)  # tables methods register (method_tables.py)
    paper_metric: Table | None = None
    orderings: Table | None = None
    sides: dict[Block, dict[str, MethodInfo]] = field(default_factory=dict)
    drafters: Table | None = None  # the held-out figures of the drafter folders the records name
    streams: Table | None = None  # the main table's layout for the mixed streams, when any ran
    aa: Table | None = None  # the A/A control rows (a second vanilla side per file)
    divergence: Table | None = None  # T = 0: identical / near-tie / unexplained per method
    cost: Table | None = None  # the forward-cost curve of this hardware, when measured (bench/forward_cost.py)
    batch: Table | None = None  # batched files: speedup over vanilla at the same B against B, crossover B
    batch_detail: Table | None = None  # batched files: throughput, latency, τ, T_D%, ideal per method and B
    engines: Table | None = None  # each method's speedup with the eager and the compiled engine, when both ran
    hardware: str = ""  # the one machine whose files this report's tables hold
    others: list["Report"] = field(default_factory=list)  # the other machines' reports (split_by_machine)

    @property
    def bench_cells(self) -> pd.DataFrame:
        """The cells of the single benchmarks (what means over benches and the trade-off figure use)."""
        return of_kind(self.cells, streams=False)

    @property
    def tables(self) -> list[Table]:
        """This machine's tables, then every other machine's that has rows (named apart by name_apart)."""
        return self.own_tables + [t for other in self.others for t in other.own_tables if t.sections]

    @property
    def own_tables(self) -> list[Table]:
        return [t for t in (self.main, self.streams, self.aa, self.divergence, self.companion, self.ablation,
                            *self.method_tables, self.papers, self.paper_metric, self.orderings, self.drafters,
                            self.engines, self.cost, self.batch, self.batch_detail) if t is not None]

    @property
    def batch_frame(self) -> pd.DataFrame:
        """The batched files' numbers per (block, bench, method, B) (what the speedup-vs-B figure draws)."""
        return self.batch.data if self.batch is not None else pd.DataFrame()

    def table(self, name: str) -> Table | None:
        """A table by its file stem (e.g. a method's own table), or None."""
        return next((t for t in self.tables if t.name == name), None)


def build_report(results: PathSpec, paper_numbers: str | Path | Sequence[Path] | None = DEFAULT_PAPER_NUMBERS,
                 reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED) -> Report:
    """Everything computed, nothing written. ``reps=0`` skips the bootstrap (console preview).

    One machine per table: the files are split by their header's hardware (checks.split_by_machine) and every
    table is built from one machine's files only; the machine with the most files is the returned report,
    the others hang off its ``others``."""
    machines = [(hw, apart_dtypes(files)) for hw, files in split_by_machine(load_result_files(results))]
    reports = [machine_report(files, hardware, paper_numbers, reps, seed) for hardware, files in machines]
    if len(reports) > 1:
        name_apart(reports)
    head = reports[0]
    head.others = reports[1:]
    return head


def name_apart(reports: Sequence[Report]) -> None:
    """Tables of several machines: every heading names its hardware; a table kind that more than one machine
    has keeps its plain name for the first machine (most files) and takes the hardware as a suffix elsewhere,
    so no file holds two machines' rows and links to the first machine's tables stay valid."""
    taken: set[str] = set()
    for report in reports:
        for table in report.own_tables:
            table.title = f"{table.title} — {report.hardware}"
            if table.name in taken:
                table.name = f"{table.name}_{machine_slug(report.hardware)}"
            taken.add(table.name)


def machine_report(every: Sequence[ResultFile], hardware: str = "",
                   paper_numbers: str | Path | Sequence[Path] | None = DEFAULT_PAPER_NUMBERS,
                   reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED) -> Report:
    """Every table of one machine's files; the files decoded through the batched loop have tables of their own
    (batch.py) and stay out of the others, whose times are a request's alone."""
    every, batched = split_batched(every)
    files = without_aa(every)  # the A/A sides are a control (aa_table), not a method
    blocks = block_records(files)
    sides = block_sides(files)
    cells = cell_frame(blocks, reps=reps, seed=seed, curves=block_curves(files))
    # Mixed streams get a table of their own: a benchmark mean, T_D% or paper row never pools a stream run.
    bench_cells, methods = of_kind(cells, streams=False), method_frame(blocks_of_kind(blocks, streams=False))
    prov = provenance_lines(files)
    papers = None
    if paper_csvs := paper_files(paper_numbers):
        known = [info for block in sides.values() for info in block.values()]
        papers = paper_comparison_table(bench_cells, methods, load_paper_numbers(paper_csvs, known), files,
                                        prov + [f"paper numbers: {', '.join(p.name for p in paper_csvs)}"], sides)
    bold_reps, loaded, dirty = BOLD_REPS if reps else 0, loaded_cells(files), dirty_cells(files)  # reps=0: a preview, no tests
    bench_blocks = blocks_of_kind(blocks, streams=False)
    has_aa = any(aa_labels(f) for f in every)  # the resolution note points to the A/A rows only where there are any
    main = main_table(bench_cells, methods, prov, significant_cells(files, bold_reps, seed), loaded,
                      mean_frame(bench_blocks, reps, seed), aa=has_aa, dirty=dirty)
    streams = None
    if stream_blocks := blocks_of_kind(blocks, streams=True):
        streams = streams_table(of_kind(cells, streams=True), method_frame(stream_blocks), prov,
                                significant_cells(files, bold_reps, seed, streams=True), loaded,
                                mean_frame(stream_blocks, reps, seed), aa=has_aa, dirty=dirty)
    orderings = orderings_table(ordering_frame(files, seed=seed), prov) if reps else None
    batch = batch_frame(without_aa(batched), block_curves(batched), reps, seed)
    batch_prov = provenance_lines(batched) if batched else []
    return Report(files, blocks, cells, methods, main, companion_table(cells, prov), ablation_table(cells, sides, prov),
                  papers, registered_tables(blocks, prov), paper_metric_table(files), orderings, sides,
                  drafters_table(files, prov), streams, aa_table(every, prov, reps, seed) if reps else None,
                  divergence_table(files, prov), cost_table(files, prov), batch_table(batch, batch_prov),
                  batch_detail_table(batch, batch_prov), engine_table(bench_cells, prov), hardware)


def write_report(results_glob_or_paths: PathSpec = "results/*.jsonl", out_dir: str | Path = "reports",
                 paper_numbers: str | Path | Sequence[Path] | None = DEFAULT_PAPER_NUMBERS, figures: bool = True) -> list[Path]:
    """Write every table as .md/.tex/.csv, the figures as PNG+PDF and index.html (page.py: the headline and the
    leaderboard first, then the verdicts, the tables with links to their files, and the figures, which the page
    shows from the PNG files beside it).

    The folder's ``.report-files.json`` lists what this report wrote; whatever the previous report there wrote
    and this one does not is removed (owned.py), so no stale table or figure outlives its inputs.
    Returns the written paths, sorted."""
    report = build_report(results_glob_or_paths, paper_numbers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    previous = owned_files(out)
    written: list[Path] = []
    for table in report.tables:
        for suffix, text in ((".md", render_markdown(table)), (".tex", render_latex(table)),
                             (".csv", render_csv(table))):
            path = out / f"{table.name}{suffix}"
            path.write_text(text, encoding="utf-8")
            written.append(path)
    figure_paths: list[Path] = []
    captions: dict[Path, str] = {}
    if figures:  # the other machines' figures carry their hardware in the file name
        several = bool(report.others)
        figure_paths = write_figures(report, out / "figures", captions=captions,
                                     machine=hardware_label(report.hardware) if several else "")
        for other in report.others:
            figure_paths += write_figures(other, out / "figures", f"_{machine_slug(other.hardware)}", captions,
                                          hardware_label(other.hardware))
    written += figure_paths
    index = out / "index.html"
    pngs = [p for p in figure_paths if p.suffix == ".png"]
    index.write_text(render_index_html(report, pngs, captions, out), encoding="utf-8")
    written.append(index)
    remove_stale(out, previous, written)
    write_manifest(out, written)
    return sorted(written)


def rich_main_table(source: "Report | PathSpec"):
    """The main table as a rich.table.Table for the console."""
    return rich_tables(source)[0]


def rich_tables(source: "Report | PathSpec") -> list:
    """The main table, then the mixed streams' table when any stream ran, then the batch table when any file
    was decoded through the batched loop, as rich.table.Tables (a main table without rows, when only streams or
    batches ran, is left out); one machine after the other."""
    report = source if isinstance(source, Report) else build_report(source, reps=0)
    shown = [t for r in (report, *report.others) for t in (r.main, r.streams, r.batch) if t is not None and t.sections]
    return [_rich(t) for t in shown or [report.main]]


def _rich(table: Table):
    from rich.table import Table as RichTable
    from rich.text import Text

    # Text, not markup: a hardware string's "[family 25 model 17, ...]" would read as a style tag and vanish
    rich = RichTable(title=Text(table.title), caption=Text("\n".join(table.provenance)), caption_justify="left")
    for head, align in zip(flat_headers(table), table.align):
        rich.add_column(Text(head), justify="left" if align == "l" else "right")
    for s, (label, rows) in enumerate(table.sections):
        if s:
            rich.add_section()
        rich.add_row(Text(label, style="italic"), *[""] * (len(table.columns) - 1))
        for row in rows:
            rich.add_row(*[Text(c.text, style="bold" if c.bold else "") for c in row])
    return rich
