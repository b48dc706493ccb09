"""Reports: result files -> tidy DataFrames -> tables (Markdown, LaTeX, CSV, HTML, rich) and figures.

Every step is a small pure function, one module per job::

    records (load, blocks, sides) -> stats (cell/method frames, intervals) -> tables / papers /
    method_tables (Table of Cells, table.py) -> render (Markdown, LaTeX, CSV, HTML) ; figures ; verdicts (per
    setting) -> leaderboard, chart -> page (index.html: headline and leaderboard first) ; build

The report names no method: labels, families and ablation groups come from what each side's method
class declares (``Drafter.label``/``family``/``ablation_of``, recorded in the results header);
paper aliases live in the CSV files of the group ``specbench.paper_numbers``; a method's own tables come through the
entry-point group ``specbench.report_tables``. All numbers come from ``specbench.metrics``; the
only typed-in numbers are the papers' in the CSV files of the group ``specbench.paper_numbers``. Output is deterministic:
rows are sorted, floats have fixed formats and the bootstrap uses a fixed seed.

The names below are re-exported lazily, so importing one module of the package (e.g. ``table`` from
``specbench.analysis.orderings``) loads only what that module needs."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "build": ("Report", "build_report", "write_report", "rich_main_table", "rich_tables"),
    "records": ("PathSpec", "ResultFile", "resolve_paths", "read_result_file", "load_result_files", "load_results",
                "block_records", "block_sides"),
    "names": ("Block", "VANILLA", "MEAN", "MethodInfo", "bench_key", "bench_label", "is_stream", "block_label", "sweep_points",
              "normalise_bench", "normalise_method", "side_infos"),
    "stats": ("BOOTSTRAP_REPS", "BOOTSTRAP_SEED", "BOLD_REPS", "CELL_COLUMNS", "bootstrap_ci", "speedup_ci", "tau_ci",
              "cell_frame", "method_frame", "missing_reasons", "mean_over_benches", "loaded_cells", "dirty_cells",
              "significant_cells", "of_kind", "blocks_of_kind", "mean_frame", "flagged_turns"),
    "checks": ("split_by_machine", "machine_slug", "hardware_label", "aa_frame", "aa_table", "without_aa", "divergence_frame", "divergence_table"),
    "cost": ("block_curves", "cost_notes", "cost_table"),
    "table": ("Cell", "Table", "DASH", "fmt_spd", "fmt_tau", "fmt_pct", "fmt_delta", "fmt_ci", "fmt_spd_n"),
    "tables": ("main_table", "streams_table", "companion_table", "ablation_groups", "ablation_table", "provenance_lines"),
    "papers": ("DEFAULT_PAPER_NUMBERS", "declared_paper_numbers", "paper_files", "load_paper_numbers", "paper_comparison_table", "best_of_sweeps",
               "paper_metric_cells", "paper_metric_table"),
    "method_tables": ("register_table", "plugin_functions", "table_functions", "registered_tables"),
    "render": ("render_markdown", "render_latex", "render_html", "render_csv", "tex_escape"),
    "page": ("render_index_html", "page_settings"),
    "verdicts": ("Bar", "Setting", "settings"),
    "chart": ("speedup_chart",),
    "leaderboard": ("leaderboard_html", "headline_sentence"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'specbench.analysis.report' has no attribute {name!r}")
    return getattr(importlib.import_module(f"specbench.analysis.report.{_WHERE[name]}"), name)
