"""Reports: result files -> tidy DataFrames -> tables (Markdown, LaTeX, CSV, HTML, rich) and figures.

Every step is a small pure function::

    resolve_paths -> read_result_file -> block_records -> cell_frame / method_frame (pandas)
                  -> Table (formatted cells) -> render_markdown / render_latex / render_html / CSV

All numbers come from ``specbench.metrics`` over GenerationRecords; the only typed-in numbers are the
papers' reference numbers in ``reports/paper_numbers.csv``. Output is deterministic: rows are sorted,
floats have fixed formats and the bootstrap uses a fixed seed, so the same records give byte-identical
Markdown and CSV.
"""

from __future__ import annotations

import base64
import dataclasses
import glob
import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Sequence, Union

import numpy as np
import pandas as pd

from specbench import metrics
from specbench.cost_model import ideal_and_efficiency
from specbench.errors import SpecbenchError
from specbench.machine_load import LOAD_SHARE, MARK, under_load
from specbench.records import GenerationRecord

PathSpec = Union[str, Path, Sequence[Union[str, Path]]]
Block = tuple[str, float]  # (target, temperature): one group of rows in every table

VANILLA = "vanilla"
MEAN = "mean"
DASH = "—"
DEFAULT_PAPER_NUMBERS = Path(__file__).resolve().parents[1] / "reports" / "paper_numbers.csv"
BOOTSTRAP_REPS = 1000
BOOTSTRAP_SEED = 0
BOLD_REPS = 2000  # resamples of the paired test behind bold

# Paper column order first (SpecBlock Table 1), then the other benches we ship, then anything else.
BENCH_ORDER = ("humaneval", "math500", "alpaca", "natural_questions", "mt_bench", "wmt23", "gsm8k",
               "cnn_dailymail", "spec_bench", "alpaca_eval")
BENCH_LABELS = {"humaneval": "HumanEval", "math500": "MATH-500", "alpaca": "Alpaca", "natural_questions": "NQ",
                "mt_bench": "MT-Bench", "wmt23": "WMT-23", "gsm8k": "GSM8K", "cnn_dailymail": "CNN/DM",
                "spec_bench": "Spec-Bench", "alpaca_eval": "AlpacaEval"}

# Printed benchmark names in the papers -> our bench names (lower-cased keys).
PAPER_BENCH_ALIASES = {
    "humaneval": "humaneval", "math-500": "math500", "math500": "math500", "alpaca": "alpaca",
    "nq": "natural_questions", "natural questions": "natural_questions", "mt-bench": "mt_bench",
    "mt bench": "mt_bench", "wmt": "wmt23", "wmt-23": "wmt23", "gsm8k": "gsm8k", "cnn/dm": "cnn_dailymail",
    # DVI reports Spec-Bench categories; these three draw on the same sources as our benches.
    "summarization": "cnn_dailymail", "qa": "natural_questions", "math": "gsm8k",
    "mean": MEAN, "avg.": MEAN, "average": MEAN,
}
# Printed method names -> our method labels. Variant labels are the runner's; adjust here if they differ.
PAPER_METHOD_ALIASES = {
    "sps": "sps", "speculative": "sps", "medusa": "medusa", "eagle-3": "eagle3", "eagle-2": "eagle2",
    "eagle-1": "eagle", "specblock": "specblock", "specblock+osd": "specblock-osd",
    "specblock+adapt": "specblock-adapt", "dflash": "dflash", "dflash+ddtree": "ddtree", "pacer": "pacer",
    "dvi": "dvi", "vanilla": VANILLA,
    "specblock – prefix broadcast": "specblock-no-prefix-broadcast",
    "specblock – layer-wise shift": "specblock-no-shift",
    "specblock – valid-prefix curriculum": "specblock-no-valid-prefix",
    "specblock – rank-guided branching": "specblock-uniform-tree",
    "specblock+adapt – cost-aware bandit": "specblock-adapt-no-bandit",
    "specblock+adapt – head-only action": "specblock-adapt-full-only",
    "pacer w/o pos-emb": "pacer-no-pos-emb", "pacer w/o growth-factor": "pacer-no-growth",
}
_BUDGET = re.compile(r"^(?P<base>[^@]+)@budget=(?P<budget>\d+)$")
# Fields a result line may lack (older writers); everything else GenerationRecord requires.
_RECORD_DEFAULTS = {"new_tokens": [], "prompt_tokens": 0, "stop_reason": "", "times": {}, "n_verify": 0,
                    "accept_lengths": [], "tree_sizes": [], "depth_attempts": [], "depth_accepts": []}


# ----------------------------------------------------------------------------------------------- loading

@dataclass(frozen=True)
class ResultFile:
    path: Path
    meta: dict
    records: tuple[GenerationRecord, ...]

    @property
    def block(self) -> Block:
        temperature = self.meta.get("temperature")
        if temperature is None:
            temperature = self.records[0].temperature if self.records else 0.0
        return str(self.meta.get("target", "unknown")), float(temperature)


def resolve_paths(spec: PathSpec) -> list[Path]:
    """A glob, a file, a folder (its *.jsonl) or a list of those -> sorted unique files."""
    items = [spec] if isinstance(spec, (str, Path)) else list(spec)
    found: set[Path] = set()
    for item in items:
        path = Path(item)
        if path.is_dir():
            found.update(path.glob("*.jsonl"))
        elif path.is_file():
            found.add(path)
        else:
            found.update(Path(p) for p in glob.glob(str(item)) if Path(p).is_file())
    if not found:
        shown = ", ".join(str(i) for i in items) or "(nothing given)"
        raise SpecbenchError(f"no result files matched {shown}; run `specbench run ...` first")
    return sorted(found, key=str)


def _record_from(obj: dict) -> GenerationRecord:
    return GenerationRecord.from_dict({**_RECORD_DEFAULTS, **obj})


def read_result_file(path: str | Path) -> ResultFile:
    """Header line -> meta; record lines -> GenerationRecords. Unparseable lines are skipped: an
    interrupted run leaves a torn last line, and everything before it is still good."""
    path = Path(path)
    meta: dict = {}
    records: list[GenerationRecord] = []
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecbenchError(f"cannot read results file {path} ({exc.strerror}); check it or leave it out") from None
    except UnicodeDecodeError:
        raise SpecbenchError(f"{path} is not a specbench results file (not UTF-8 text); leave it out") from None
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        if obj.get("type") == "header" and not meta:
            meta = dict(obj.get("meta") or {})
        elif obj.get("type") == "record":
            try:
                records.append(_record_from(obj))
            except TypeError:  # a line that parses but is not a record (e.g. cut exactly at a brace)
                continue
    return ResultFile(path, meta, tuple(records))


def load_result_files(spec: PathSpec) -> list[ResultFile]:
    files = [read_result_file(p) for p in resolve_paths(spec)]
    if not any(f.records for f in files):
        names = ", ".join(f.path.name for f in files)
        raise SpecbenchError(f"no records in {names}; run `specbench run ...` first")
    return files


def load_results(paths: PathSpec) -> tuple[list[GenerationRecord], dict[str, dict]]:
    """All records of the matched files, and each file's header meta keyed by its path."""
    files = load_result_files(paths)
    return [r for f in files for r in f.records], {str(f.path): f.meta for f in files}


def block_records(files: Sequence[ResultFile]) -> dict[Block, list[GenerationRecord]]:
    """Records per (target, temperature). Speedups must pair a method with the vanilla run of the
    same file, and metrics match by (bench, prompt_id, turn): so when a block spans several files,
    prompt ids are prefixed with the file name to keep each file's pairs apart."""
    by_block: dict[Block, list[ResultFile]] = {}
    for f in files:
        if f.records:
            by_block.setdefault(f.block, []).append(f)
    out: dict[Block, list[GenerationRecord]] = {}
    for block, group in sorted(by_block.items()):
        if len(group) == 1:
            out[block] = list(group[0].records)
        else:
            out[block] = [dataclasses.replace(r, prompt_id=f"{f.path.name}:{r.prompt_id}")
                          for f in group for r in f.records]
    return out


# ------------------------------------------------------------------------------------- names and order

def bench_key(bench: str) -> tuple[int, str]:
    return (BENCH_ORDER.index(bench) if bench in BENCH_ORDER else len(BENCH_ORDER), bench)


def bench_label(bench: str) -> str:
    return BENCH_LABELS.get(bench, bench)


def block_label(block: Block) -> str:
    return f"{block[0]} · T = {block[1]:g}"


def family(label: str) -> str:
    """Variants of one method share the part before the first '-' or '@'."""
    return re.split(r"[-@]", label, maxsplit=1)[0]


def budget_of(label: str) -> tuple[str, int] | None:
    m = _BUDGET.match(label)
    return (m["base"], int(m["budget"])) if m else None


def normalise_bench(name: str) -> str:
    key = name.strip().lower()
    return PAPER_BENCH_ALIASES.get(key, re.sub(r"[^a-z0-9]+", "_", key).strip("_"))


def normalise_method(name: str) -> str:
    key = name.strip().lower()
    return PAPER_METHOD_ALIASES.get(key, re.sub(r"\s+", "", key).replace("+", "-"))


# --------------------------------------------------------------------------------------- statistics

def bootstrap_ci(columns: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray], reps: int = BOOTSTRAP_REPS,
                 seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of ``statistic`` over prompt resamples.

    ``columns[i]`` holds prompt i's additive totals (tokens, seconds, ...); every metric here is a ratio
    of pooled sums, so a resample's statistic needs only the resampled column sums: draw n prompts with
    replacement per rep, count how often each was drawn, and take one matrix product."""
    from specbench.paired import percentile_interval, resampled_sums

    if len(columns) == 0 or reps <= 0:
        return math.nan, math.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        values = statistic(resampled_sums(columns, reps, seed))
    return percentile_interval(values, level)


def _by_prompt(records: Iterable[GenerationRecord]) -> dict[str, list[GenerationRecord]]:
    # The resampling unit is a prompt: its turns (MT-Bench has two) move together.
    out: dict[str, list[GenerationRecord]] = {}
    for r in records:
        out.setdefault(r.prompt_id, []).append(r)
    return dict(sorted(out.items()))


def speedup_ci(method: Sequence[GenerationRecord], baseline: Sequence[GenerationRecord], **kw) -> tuple[float, float]:
    """Bootstrap interval of metrics.speedup (end-to-end) over matched prompts."""
    pairs = metrics.matched(method, baseline)
    units = _by_prompt(m for m, _ in pairs)
    base = {metrics.key(b): b for _, b in pairs}
    rows = []
    for recs in units.values():
        twins = [base[metrics.key(r)] for r in recs]
        rows.append([sum(r.num_new for r in recs), sum(r.total_time for r in recs),
                     sum(b.num_new for b in twins), sum(b.total_time for b in twins)])
    return bootstrap_ci(np.array(rows, dtype=float).reshape(-1, 4),
                        lambda s: (s[:, 0] / s[:, 1]) / (s[:, 2] / s[:, 3]), **kw)


def tau_ci(records: Sequence[GenerationRecord], **kw) -> tuple[float, float]:
    """Bootstrap interval of metrics.tau over prompts."""
    rows = [[sum(r.committed for r in recs), sum(r.n_verify for r in recs)] for recs in _by_prompt(records).values()]
    return bootstrap_ci(np.array(rows, dtype=float).reshape(-1, 2), lambda s: s[:, 0] / s[:, 1], **kw)


CELL_COLUMNS = ["target", "temperature", "method", "bench", "n_prompts", "speedup", "speedup_lo", "speedup_hi",
                "speedup_decode", "tau", "tau_lo", "tau_hi", "tau_macro", "td", "greedy_match", "tokens_per_s",
                "tokens_per_s_decode", "vanilla_tokens_per_s", "ideal_speedup", "efficiency", "reason"]


def _cell(block: Block, method: str, bench: str, ours: Sequence[GenerationRecord], base: Sequence[GenerationRecord],
          reps: int, seed: int) -> dict:
    """Every statistic of one (block, method, bench) cell; ``base`` = the block's vanilla records there."""
    row = dict.fromkeys(CELL_COLUMNS, math.nan)
    row.update(target=block[0], temperature=block[1], method=method, bench=bench, n_prompts=0, reason="")
    if not ours:
        row["reason"] = f"not run on {bench}"
        return row
    row.update(n_prompts=len({r.prompt_id for r in ours}), tau=metrics.tau(ours), tau_macro=metrics.tau_macro(ours),
               td=metrics.draft_share(ours), tokens_per_s=metrics.tokens_per_second(ours),
               tokens_per_s_decode=metrics.tokens_per_second(ours, decode_only=True))
    row["tau_lo"], row["tau_hi"] = tau_ci(ours, reps=reps, seed=seed)
    matched_base = [b for _, b in metrics.matched(ours, base)]
    if not matched_base:
        row["reason"] = f"no vanilla baseline for {bench} in the same file"
        return row
    row.update(speedup=metrics.speedup(ours, base), speedup_decode=metrics.speedup(ours, base, decode_only=True),
               vanilla_tokens_per_s=metrics.tokens_per_second(matched_base))
    row["speedup_lo"], row["speedup_hi"] = speedup_ci(ours, base, reps=reps, seed=seed)
    row["ideal_speedup"], row["efficiency"] = ideal_and_efficiency(ours, base)
    if block[1] == 0:  # exact match is only expected under greedy decoding
        row["greedy_match"] = metrics.greedy_match_rate(ours, base)
    return row


def cell_frame(blocks: dict[Block, list[GenerationRecord]], reps: int = BOOTSTRAP_REPS,
               seed: int = BOOTSTRAP_SEED) -> pd.DataFrame:
    """One row per (block, method, bench) over the full grid; missing cells carry a reason."""
    benches = sorted({r.bench for recs in blocks.values() for r in recs}, key=bench_key)
    rows = []
    for block, recs in sorted(blocks.items()):
        groups: dict[tuple[str, str], list[GenerationRecord]] = {}
        for r in recs:
            groups.setdefault((r.method, r.bench), []).append(r)
        for method in sorted({r.method for r in recs} - {VANILLA}):
            rows.extend(_cell(block, method, bench, groups.get((method, bench), []), groups.get((VANILLA, bench), []),
                              reps, seed) for bench in benches)
    return pd.DataFrame(rows, columns=CELL_COLUMNS)


def method_frame(blocks: dict[Block, list[GenerationRecord]]) -> pd.DataFrame:
    """Per (block, method): T_D over all its records; at T = 0 the share of its turns whose text equals
    vanilla's (greedy_match) and how many turns paired (greedy_n)."""
    rows = []
    for block, recs in sorted(blocks.items()):
        base = [r for r in recs if r.method == VANILLA]
        for method in sorted({r.method for r in recs}):
            ours = [r for r in recs if r.method == method]
            greedy_n = len(metrics.matched(ours, base)) if block[1] == 0 and method != VANILLA else 0
            rows.append(dict(target=block[0], temperature=block[1], method=method, td=metrics.draft_share(ours),
                             n_records=len(ours), greedy_match=metrics.greedy_match_rate(ours, base) if greedy_n
                             else math.nan, greedy_n=greedy_n))
    return pd.DataFrame(rows, columns=["target", "temperature", "method", "td", "n_records", "greedy_match",
                                       "greedy_n"])


def missing_reasons(cells: pd.DataFrame) -> dict[tuple[str, float, str, str], str]:
    """(target, temperature, method, bench) -> why that cell shows "—" (in cell_frame order)."""
    return {(r.target, r.temperature, r.method, r.bench): r.reason for r in cells.itertuples() if r.reason}


def mean_over_benches(cells: pd.DataFrame, column: str, benches: Iterable[str] | None = None) -> pd.Series:
    """Mean of a per-bench value over the benches a method has (NaN cells skipped), per (block, method)."""
    part = cells if benches is None else cells[cells.bench.isin(list(benches))]
    return part.groupby(["target", "temperature", "method"], sort=True)[column].mean()


# -------------------------------------------------------------------------------------------- formats

def fmt_spd(x: float) -> str:
    return DASH if not _finite(x) else f"{x:.2f}×"


def fmt_tau(x: float) -> str:
    return DASH if not _finite(x) else f"{x:.2f}"


def fmt_pct(fraction: float) -> str:
    return DASH if not _finite(fraction) else f"{100 * fraction:.0f}%"


def fmt_delta(x: float, unit: str = "") -> str:
    return DASH if not _finite(x) else f"{x:+.2f}{unit}".replace("-", "−")


def fmt_ci(point: str, lo: float, hi: float, fmt: Callable[[float], str]) -> str:
    if point == DASH or not (_finite(lo) and _finite(hi)):
        return point
    return f"{point} [{fmt(lo).rstrip('×')}, {fmt(hi).rstrip('×')}]"


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


class Cell(NamedTuple):
    text: str
    bold: bool = False


@dataclass
class Table:
    """A formatted table: the one input of every renderer."""
    name: str  # output file stem
    title: str
    columns: list[str]  # leaf header
    groups: list[tuple[str, int]]  # top header spans (label, n columns); "" for none
    sections: list[tuple[str, list[list[Cell]]]]  # (section label, rows)
    data: pd.DataFrame  # numeric form, written as CSV
    notes: list[str] = field(default_factory=list)
    provenance: list[str] = field(default_factory=list)
    align: str = ""  # one of l/r per column; default: names left in the first column, numbers right

    def __post_init__(self) -> None:
        self.align = self.align or "l" + "r" * (len(self.columns) - 1)


def fmt_spd_n(x: float, n, loaded: bool = False) -> str:
    """A speedup with the prompts behind it, and the under-load mark when its file was recorded under load."""
    if not _finite(x):
        return DASH
    return f"{fmt_spd(x)} (n={int(n)})" + (f" {MARK}" if loaded else "")


def _bench_groups(benches: Sequence[str], lead: Sequence[str]) -> tuple[list[str], list[tuple[str, int]]]:
    columns = list(lead)
    groups: list[tuple[str, int]] = [("", len(lead))]
    for bench in benches:
        columns += ["Spd", "τ"]
        groups.append((bench_label(bench), 2))
    return columns, groups


def provenance_lines(files: Sequence[ResultFile]) -> list[str]:
    """One line per block: result files, prompts per bench, hardware, dtype, seed, git sha."""
    by_block: dict[Block, list[ResultFile]] = {}
    for f in files:
        if f.records:
            by_block.setdefault(f.block, []).append(f)
    lines = []
    for block, group in sorted(by_block.items()):
        prompts: dict[str, set] = {}
        for f in group:
            for r in f.records:
                prompts.setdefault(r.bench, set()).add(r.prompt_id)

        def meta(name: str) -> str:
            values = sorted({str(f.meta.get(name)) for f in group if f.meta.get(name) is not None})
            return " / ".join(values) if values else "?"

        per_bench = ", ".join(f"{b} {len(prompts[b])}" for b in sorted(prompts, key=bench_key))
        lines.append(f"{block_label(block)}: files {', '.join(sorted(f.path.name for f in group))}; "
                     f"prompts per bench: {per_bench}; hardware {meta('hardware')}; device {meta('device')}; "
                     f"dtype {meta('dtype')}; max_new_tokens {meta('max_new_tokens')}; seed {meta('seed')}; "
                     f"git {meta('git_sha')}")
    return lines


def main_table(cells: pd.DataFrame, methods: pd.DataFrame, provenance: Sequence[str] = (),
               bold: frozenset = frozenset(), loaded: frozenset = frozenset()) -> Table:
    """SpecBlock Table 1 layout: a block per (target, T), a row per method, Spd (n)/τ per bench, Mean with the
    cost model's ideal speedup and efficiency, T_D%, greedy match. ``bold``: (target, T, method, bench or
    'mean') whose speedup's paired interval excludes the runner-up's; ``loaded``: (target, T, method, bench)
    recorded under load."""
    benches = sorted(cells.bench.unique(), key=bench_key)
    columns, groups = _bench_groups(benches, ["Method"])
    columns += ["Spd", "τ", "Ideal", "Eff.", "T_D%", "Greedy"]
    groups += [("Mean", 4), ("", 2)]
    mean_spd, mean_tau = mean_over_benches(cells, "speedup"), mean_over_benches(cells, "tau")
    mean_ideal, mean_eff = mean_over_benches(cells, "ideal_speedup"), mean_over_benches(cells, "efficiency")
    per_method = methods.set_index(["target", "temperature", "method"])
    sections, records = [], []
    for (target, temp), block in cells.groupby(["target", "temperature"], sort=True):
        rows = []
        for method, part in block.groupby("method", sort=True):
            part = part.set_index("bench")
            key = (target, temp, method)
            row = [Cell(method)]
            data = dict(target=target, temperature=f"{temp:g}", method=method)
            n_all = 0
            for bench in benches:
                spd, tau, n = part.at[bench, "speedup"], part.at[bench, "tau"], part.at[bench, "n_prompts"]
                n_all += int(n) if _finite(spd) else 0
                row += [Cell(fmt_spd_n(spd, n, (*key, bench) in loaded), (*key, bench) in bold), Cell(fmt_tau(tau))]
                data.update({f"{bench}_spd": spd, f"{bench}_tau": tau, f"{bench}_n": n})
            greedy, greedy_n = per_method.at[key, "greedy_match"], per_method.at[key, "greedy_n"]
            any_loaded = any((*key, b) in loaded for b in benches)
            row += [Cell(fmt_spd_n(mean_spd[key], n_all, any_loaded), (*key, MEAN) in bold),
                    Cell(fmt_tau(mean_tau[key])), Cell(fmt_spd(mean_ideal[key])), Cell(fmt_pct(mean_eff[key])),
                    Cell(fmt_pct(per_method.at[key, "td"])),
                    Cell(f"{fmt_pct(greedy)} ({int(greedy_n)})" if greedy_n else DASH)]
            data.update(mean_spd=mean_spd[key], mean_tau=mean_tau[key], mean_ideal_spd=mean_ideal[key],
                        mean_efficiency=mean_eff[key], td_percent=100 * per_method.at[key, "td"],
                        greedy_match=greedy, greedy_n=greedy_n, under_load=any_loaded)
            rows.append(row)
            records.append(data)
        sections.append((block_label((target, temp)), rows))
    notes = ["Spd (n=prompts) = end-to-end speedup over the same file's vanilla; Mean = mean over the benchmarks "
             "each method ran (n summed); T_D% = drafter share of decode time over all its prompts; bold = the "
             "best speedup of its column within a block whose paired bootstrap interval (over prompt turns, "
             f"{BOLD_REPS} resamples) against the runner-up lies above 1 (Mean: pooled over the benchmarks)",
             "Ideal = τ · t_vanilla_step / (t_draft + t_verify) from the measured forward times per verify call "
             "(see specbench/cost_model.py); Eff. = measured decode-only speedup / ideal (overhead beyond model "
             "forwards); both means over benchmarks",
             "Greedy = share of T = 0 turns (n) whose text equals vanilla's token for token"]
    if loaded:
        notes.append(f"{MARK} = recorded under load: other work took more than {LOAD_SHARE:.0%} of the machine's "
                     "CPUs before the run or after one of its turns (header load_start, record load_avg); its timings are suspect")
    notes += [f"{m} × {b} ({block_label((t, temp))}): {why}" for (t, temp, m, b), why in missing_reasons(cells).items()]
    return Table("main_table", "Speedup (Spd) over vanilla and mean accepted length τ per benchmark", columns,
                 groups, sections, pd.DataFrame(records), notes, list(provenance))


def companion_table(cells: pd.DataFrame, provenance: Sequence[str] = ()) -> Table:
    """Per method and bench: end-to-end vs decode-only speedup with 95% CIs, greedy match, tokens/s, n."""
    columns = ["Method", "Bench", "n", "Spd [95% CI]", "Spd decode", "Ideal", "Eff.", "τ [95% CI]", "τ macro", "T_D%",
               "Greedy match", "tok/s", "vanilla tok/s"]
    ran = cells[cells.n_prompts > 0]
    sections, notes = [], []
    for (target, temp), block in ran.groupby(["target", "temperature"], sort=True):
        rows = []
        for r in sorted(block.itertuples(), key=lambda r: (r.method, bench_key(r.bench))):
            greedy = DASH if not _finite(r.greedy_match) else f"{100 * r.greedy_match:.0f}%"
            rows.append([Cell(r.method), Cell(r.bench), Cell(str(r.n_prompts)),
                         Cell(fmt_ci(fmt_spd(r.speedup), r.speedup_lo, r.speedup_hi, fmt_spd)),
                         Cell(fmt_spd(r.speedup_decode)), Cell(fmt_spd(r.ideal_speedup)), Cell(fmt_pct(r.efficiency)),
                         Cell(fmt_ci(fmt_tau(r.tau), r.tau_lo, r.tau_hi, fmt_tau)),
                         Cell(fmt_tau(r.tau_macro)), Cell(fmt_pct(r.td)), Cell(greedy),
                         Cell(_fmt_tps(r.tokens_per_s)), Cell(_fmt_tps(r.vanilla_tokens_per_s))])
            if r.reason:
                notes.append(f"{r.method} × {r.bench} ({block_label((target, temp))}): {r.reason}")
        sections.append((block_label((target, temp)), rows))
    if (ran.temperature > 0).any():
        notes.append("greedy match is reported at T = 0 only; at T > 0 outputs are samples")
    notes.append("Ideal = the cost model's speedup from measured forward times (specbench/cost_model.py); "
                 "Eff. = Spd decode / Ideal")
    data = ran.assign(temperature=ran.temperature.map(lambda t: f"{t:g}"), td_percent=100 * ran.td)
    data = data.sort_values(["target", "temperature", "method", "bench"]).reset_index(drop=True)
    data = data[[c if c != "td" else "td_percent" for c in CELL_COLUMNS]]
    return Table("companion_table", "Speedup end-to-end vs decode-only, with bootstrap 95% intervals over prompts",
                 columns, [], sections, data, notes, list(provenance), align="ll" + "r" * 11)


def _fmt_tps(x: float) -> str:
    return DASH if not _finite(x) else f"{x:.1f}"


def ablation_families(labels: Iterable[str]) -> dict[str, list[str]]:
    """Method families with ≥2 variants at the same node budget, keyed by the base label
    (``specblock`` or ``specblock@budget=16``). Labels differing only in budget form a sweep
    (its own figure), not an ablation."""
    fams: dict[str, list[str]] = {}
    for label in sorted(set(labels)):
        if label == VANILLA:
            continue
        budget = budget_of(label)
        key = family(label) + (f"@budget={budget[1]}" if budget else "")
        fams.setdefault(key, []).append(label)
    return {f: sorted(v, key=lambda m: (m != f, m)) for f, v in sorted(fams.items()) if len(v) >= 2}


def ablation_table(cells: pd.DataFrame, provenance: Sequence[str] = ()) -> Table | None:
    """SpecBlock Table 2 layout: rows = variants of one method; Spd/τ per bench, Mean, Δ vs the base."""
    ran = cells[cells.n_prompts > 0]
    sections, records, notes = [], [], []
    benches_all: set[str] = set()
    plan = []
    for (target, temp), block in ran.groupby(["target", "temperature"], sort=True):
        for fam, labels in ablation_families(block.method).items():
            part = block[block.method.isin(labels)]
            benches_all.update(part.bench)
            plan.append(((target, temp), fam, labels, part))
    if not plan:
        return None
    benches = sorted(benches_all, key=bench_key)
    columns, groups = _bench_groups(benches, ["Variant"])
    columns += ["Spd", "τ", "ΔSpd", "Δτ"]
    groups += [("Mean", 2), ("vs base", 2)]
    for block, fam, labels, part in plan:
        by = {(r.method, r.bench): r for r in part.itertuples()}
        base_benches = {b for (m, b) in by if m == fam}
        rows = []
        for label in labels:
            mine = {b for (m, b) in by if m == label}
            common = mine & base_benches  # deltas compare like with like: benches both ran
            spd = [by[(label, b)].speedup if (label, b) in by else math.nan for b in benches]
            tau = [by[(label, b)].tau if (label, b) in by else math.nan for b in benches]
            mean = (_nanmean(spd), _nanmean(tau))
            if fam in labels and common:
                d_spd = _nanmean([by[(label, b)].speedup - by[(fam, b)].speedup for b in sorted(common)])
                d_tau = _nanmean([by[(label, b)].tau - by[(fam, b)].tau for b in sorted(common)])
            else:
                d_spd = d_tau = math.nan
                if label != fam:
                    notes.append(f"{label} ({block_label(block)}): no '{fam}' run on the same benches to compare with")
            row = [Cell(label)]
            for s, t in zip(spd, tau):
                row += [Cell(fmt_spd(s)), Cell(fmt_tau(t))]
            deltas = [Cell(""), Cell("")] if label == fam else [Cell(fmt_delta(d_spd, "×")), Cell(fmt_delta(d_tau))]
            row += [Cell(fmt_spd(mean[0])), Cell(fmt_tau(mean[1]))] + deltas
            rows.append(row)
            data = dict(target=block[0], temperature=f"{block[1]:g}", family=fam, method=label)
            for b, s, t in zip(benches, spd, tau):
                data.update({f"{b}_spd": s, f"{b}_tau": t})
            data.update(mean_spd=mean[0], mean_tau=mean[1], delta_spd=d_spd, delta_tau=d_tau)
            records.append(data)
        sections.append((f"{block_label(block)} · {fam}", rows))
    notes.append("Δ = variant minus base method, averaged over the benches both ran")
    return Table("ablation_table", "Ablations: variants of one method", columns, groups, sections,
                 pd.DataFrame(records), notes, list(provenance))


RANK_BUCKETS = ("b0 (rank 1)", "b1 (2–4)", "b2 (5–10)", "b3 (>10)")


def rank_head_table(blocks: dict[Block, list[GenerationRecord]], provenance: Sequence[str] = ()) -> Table | None:
    """SpecBlock Table 3 from decoding: per bucket, the share of valid-prefix block-1 slots whose
    target token fell in it, and the rank head's precision / recall / F1 there (records whose
    ``extra`` carries ``rank_confusion`` [true][predicted])."""
    sections, records = [], []
    for block, recs in sorted(blocks.items()):
        by_method: dict[str, np.ndarray] = {}
        for r in recs:
            if "rank_confusion" in r.extra:
                by_method.setdefault(r.method, np.zeros((4, 4)))
                by_method[r.method] += np.asarray(r.extra["rank_confusion"], dtype=float)
        rows = []
        for method, conf in sorted(by_method.items()):
            total = conf.sum()
            for c, name in enumerate(RANK_BUCKETS):
                true, pred, hit = conf[c].sum(), conf[:, c].sum(), conf[c, c]
                precision = hit / pred if pred else math.nan
                recall = hit / true if true else math.nan
                f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else math.nan
                freq = true / total if total else math.nan
                rows.append([Cell(method if c == 0 else ""), Cell(name), Cell(fmt_pct(freq)),
                             Cell(f"{precision:.3f}" if _finite(precision) else DASH),
                             Cell(f"{recall:.3f}" if _finite(recall) else DASH),
                             Cell(f"{f1:.3f}" if _finite(f1) else DASH), Cell(f"{int(true)}")])
                records.append(dict(target=block[0], temperature=f"{block[1]:g}", method=method, bucket=c,
                                    frequency=freq, precision=precision, recall=recall, f1=f1, positions=int(true)))
        if rows:
            sections.append((block_label(block), rows))
    if not sections:
        return None
    notes = ["positions: block-1 slots whose greedy prefix the target accepted (the valid-prefix positions); "
             "true bucket = rank of the committed token in that slot's draft distribution"]
    return Table("rank_head_table", "Rank head: bucket frequency and classification quality (SpecBlock Table 3)",
                 ["Method", "Bucket", "Freq", "Precision", "Recall", "F1", "Positions"], [("", 7)], sections,
                 pd.DataFrame(records), notes, list(provenance), align="llrrrrr")


def _nanmean(values: Sequence[float]) -> float:
    finite = [v for v in values if _finite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def load_paper_numbers(path: str | Path = DEFAULT_PAPER_NUMBERS) -> pd.DataFrame:
    """The papers' printed numbers, kept as text (exactly as printed), plus normalised join keys."""
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    return df.assign(bench_key=df.bench.map(normalise_bench), method_key=df.method.map(normalise_method))


def paper_comparison_table(cells: pd.DataFrame, methods: pd.DataFrame, papers: pd.DataFrame,
                           files: Sequence[ResultFile], provenance: Sequence[str] = ()) -> Table:
    """Ours vs paper where method and bench match. Our sweep labels (x@budget=B) match the paper's x."""
    columns = ["Method", "Bench", "Spd", "τ", "T_D%", "Source", "Model", "Hardware", "T", "Spd", "τ", "T_D%"]
    groups = [("", 2), ("ours", 3), ("paper", 7)]
    td = methods.set_index(["target", "temperature", "method"])["td"]
    hardware = {f.block: f.meta.get("hardware", "?") for f in files if f.records}
    paper_td = {(r.paper, r.table, r.model, r.temperature, r.method_key): r.td_percent
                for r in papers[papers.bench_key == MEAN].itertuples() if r.td_percent}
    ran = cells[cells.n_prompts > 0]
    sections, records = [], []
    for (target, temp), block in ran.groupby(["target", "temperature"], sort=True):
        rows = []
        for r in best_of_sweeps(block).sort_values(["method", "bench"]).itertuples():
            hits = papers[(papers.method_key == r.key) & (papers.bench_key == r.bench)]
            same_t = np.array([t == "" or float(t) == temp for t in hits.temperature], dtype=bool)  # "": unstated
            hits = hits[same_t]
            for p in hits.sort_values(["paper", "table", "model", "temperature"]).itertuples():
                p_td = paper_td.get((p.paper, p.table, p.model, p.temperature, p.method_key), "")
                ours_td = td[(target, temp, r.method)]
                rows.append([Cell(r.method), Cell(r.bench), Cell(fmt_spd(r.speedup)), Cell(fmt_tau(r.tau)),
                             Cell(fmt_pct(ours_td)), Cell(_source(p.paper, p.table)), Cell(p.model), Cell(p.hardware),
                             Cell(p.temperature or "?"), Cell(f"{p.speedup}×" if p.speedup else DASH),
                             Cell(p.tau or DASH), Cell(f"{p_td}%" if p_td else DASH)])
                records.append(dict(target=target, temperature=f"{temp:g}", method=r.method, bench=r.bench,
                                    hardware=hardware.get((target, temp), "?"), speedup=r.speedup, tau=r.tau,
                                    td_percent=100 * ours_td, paper=p.paper, paper_table=p.table,
                                    paper_model=p.model, paper_hardware=p.hardware,
                                    paper_temperature=p.temperature, paper_method=p.method,
                                    paper_speedup=p.speedup, paper_tau=p.tau, paper_td_percent=p_td))
        if rows:
            label = f"{block_label((target, temp))} on {hardware.get((target, temp), '?')}"
            sections.append((label, rows))
    notes = ["Models and hardware differ: our rows ran the target and hardware named in each section; the "
             "papers' rows are their own models on their own GPUs. Compare orderings and trade-offs, not absolute "
             "values.",
             "Paper numbers are copied as printed from reports/paper_numbers.csv (see its notes column); "
             "a paper T_D% is its per-method share, printed once per row; T ? = the paper does not state it."]
    if not records:
        notes.insert(0, "No method and benchmark of ours appears in the papers' tables.")
    notes.append("A budget sweep (x@budget=B) is compared at its best-speedup budget per benchmark, as DDTree "
                 "reports each cell at its best node budget.")
    return Table("paper_comparison", "Ours vs published numbers (same method and benchmark)", columns, groups,
                 sections, pd.DataFrame(records), notes, list(provenance), align="llrrrllllrrr")


def _source(paper: str, table: str) -> str:
    return f"{paper} Table {table}" if table.isdigit() else f"{paper} {table}"


def best_of_sweeps(cells: pd.DataFrame) -> pd.DataFrame:
    """Plain labels as they are; of each x@budget=B sweep only the best-speedup label per bench. Adds the
    join column ``key`` (x for a sweep, the label otherwise)."""
    cells = cells.assign(key=cells.method.map(lambda m: budget_of(m)[0] if budget_of(m) else m))
    sweep = cells.method.map(lambda m: budget_of(m) is not None)
    best = (cells[sweep].sort_values(["key", "bench", "speedup", "method"], ascending=[True, True, False, True])
            .groupby(["key", "bench"], sort=True).head(1))
    return pd.concat([cells[~sweep], best])


# ------------------------------------------------------------------------------------------ renderers

def render_markdown(table: Table) -> str:
    """A heading, one Markdown table per section, then notes and provenance."""
    heads = _flat_headers(table)
    out = [f"## {table.title}", ""]
    for label, rows in table.sections:
        rule = "|" + "|".join("---" if a == "l" else "---:" for a in table.align) + "|"
        out += [f"### {label}", "", _md_row(heads), rule]
        out += [_md_row([f"**{c.text}**" if c.bold else c.text for c in row]) for row in rows]
        out.append("")
    if not table.sections:
        out += ["(no rows)", ""]
    if table.notes:
        out += ["Notes:", ""] + [f"- {n}" for n in table.notes] + [""]
    out += ["Provenance:", ""] + [f"- {p}" for p in table.provenance] + [""]
    return "\n".join(out)


def _flat_headers(table: Table) -> list[str]:
    if not table.groups:
        return list(table.columns)
    labels = [g for g, span in table.groups for _ in range(span)]
    return [f"{g} {c}" if g else c for g, c in zip(labels, table.columns)]


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "×": r"$\times$", "τ": r"$\tau$",
        "Δ": r"$\Delta$", "—": "---", "−": "$-$", "·": r"$\cdot$", "–": "--", "‡": r"\ddag{}"}


def tex_escape(text: str) -> str:
    if text == "T_D%":
        return r"$T_D\%$"
    return "".join(_TEX.get(ch, ch) for ch in text)


def render_latex(table: Table) -> str:
    """A booktabs table; sections become italic spanning rows like the papers' temperature rows."""
    n = len(table.columns)
    out = [f"% {table.title}"] + [f"% provenance: {p}" for p in table.provenance]
    out += [r"\begin{table}[t]", r"\centering", r"\small", rf"\begin{{tabular}}{{{table.align}}}", r"\toprule"]
    if table.groups:
        heads, rules, col = [], [], 1
        for label, span in table.groups:
            if label:
                heads.append(rf"\multicolumn{{{span}}}{{c}}{{{tex_escape(label)}}}")
                rules.append(rf"\cmidrule(lr){{{col}-{col + span - 1}}}")
            else:
                heads += [""] * span
            col += span
        out += [" & ".join(heads) + r" \\", " ".join(rules)]
    out.append(" & ".join(tex_escape(c) for c in table.columns) + r" \\")
    for label, rows in table.sections:
        out += [r"\midrule", rf"\multicolumn{{{n}}}{{l}}{{\textit{{{tex_escape(label)}}}}} \\"]
        for row in rows:
            out.append(" & ".join(rf"\textbf{{{tex_escape(c.text)}}}" if c.bold else tex_escape(c.text)
                                  for c in row) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}"]
    if table.notes:
        out += [r"\par\smallskip{\footnotesize"] + [tex_escape(note) + r"\\" for note in table.notes] + ["}"]
    out += [rf"\caption{{{tex_escape(table.title)}}}", r"\end{table}"]
    return "\n".join(out) + "\n"


def render_html(table: Table) -> str:
    """A <table> with a grouped header, section rows, notes and provenance (no external assets)."""
    esc = html.escape
    out = [f"<h2>{esc(table.title)}</h2>", "<table>", "<thead>"]
    if table.groups:
        out.append("<tr>" + "".join(f'<th colspan="{span}">{esc(label)}</th>' for label, span in table.groups)
                   + "</tr>")
    out += ["<tr>" + "".join(f"<th>{esc(c)}</th>" for c in table.columns) + "</tr>", "</thead>", "<tbody>"]
    for label, rows in table.sections:
        out.append(f'<tr class="section"><td colspan="{len(table.columns)}">{esc(label)}</td></tr>')
        for row in rows:
            cells = [(f"<b>{esc(c.text)}</b>" if c.bold else esc(c.text), a) for c, a in zip(row, table.align)]
            out.append("<tr>" + "".join(f'<td class="l">{t}</td>' if a == "l" else f"<td>{t}</td>"
                                        for t, a in cells) + "</tr>")
    out += ["</tbody>", "</table>"]
    if table.notes:
        out += ['<ul class="notes">'] + [f"<li>{esc(n)}</li>" for n in table.notes] + ["</ul>"]
    out += ['<p class="provenance">' + "<br>".join(esc(p) for p in table.provenance) + "</p>"]
    return "\n".join(out)


def render_csv(table: Table) -> str:
    """Numeric CSV (4 decimals, empty = missing) under '#' provenance lines (pandas: comment='#')."""
    head = "".join(f"# {p}\n" for p in table.provenance)
    return head + table.data.to_csv(index=False, float_format="%.4f", na_rep="", lineterminator="\n")


def rich_main_table(source: "Report | PathSpec"):
    """The main table as a rich.table.Table for the console."""
    from rich.table import Table as RichTable
    from rich.text import Text

    report = source if isinstance(source, Report) else build_report(source, reps=0)
    table = report.main
    rich = RichTable(title=table.title, caption="\n".join(table.provenance), caption_justify="left")
    for head, align in zip(_flat_headers(table), table.align):
        rich.add_column(head, justify="left" if align == "l" else "right")
    for s, (label, rows) in enumerate(table.sections):
        if s:
            rich.add_section()
        rich.add_row(Text(label, style="italic"), *[""] * (len(table.columns) - 1))
        for row in rows:
            rich.add_row(*[Text(c.text, style="bold" if c.bold else "") for c in row])
    return rich


# ------------------------------------------------------------------------------------------ the report

@dataclass
class Report:
    files: list[ResultFile]
    blocks: dict[Block, list[GenerationRecord]]
    cells: pd.DataFrame
    methods: pd.DataFrame
    main: Table
    companion: Table
    ablation: Table | None
    papers: Table | None
    rank: Table | None = None
    paper_metric: Table | None = None
    orderings: Table | None = None

    @property
    def tables(self) -> list[Table]:
        return [t for t in (self.main, self.companion, self.ablation, self.rank, self.papers, self.paper_metric,
                            self.orderings) if t is not None]


def build_report(results: PathSpec, paper_numbers: str | Path | None = DEFAULT_PAPER_NUMBERS,
                 reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED) -> Report:
    """Everything computed, nothing written. ``reps=0`` skips the bootstrap (console preview)."""
    files = load_result_files(results)
    blocks = block_records(files)
    cells = cell_frame(blocks, reps=reps, seed=seed)
    methods = method_frame(blocks)
    prov = provenance_lines(files)
    papers = None
    if paper_numbers is not None and Path(paper_numbers).is_file():
        papers = paper_comparison_table(cells, methods, load_paper_numbers(paper_numbers), files,
                                        prov + [f"paper numbers: {Path(paper_numbers).name}"])
    from specbench.orderings import ordering_frame, orderings_table

    bold = significant_cells(files, reps=BOLD_REPS if reps else 0, seed=seed)  # reps=0: a preview, no tests
    main = main_table(cells, methods, prov, bold, loaded_cells(files))
    orderings = orderings_table(ordering_frame(files, seed=seed), prov) if reps else None
    return Report(files, blocks, cells, methods, main, companion_table(cells, prov),
                  ablation_table(cells, prov), papers, rank_head_table(blocks, prov), paper_metric_table(files),
                  orderings)


def loaded_cells(files: Sequence[ResultFile]) -> frozenset:
    """(target, T, method, bench) of every record in a file recorded under load (machine_load.under_load)."""
    return frozenset((*f.block, r.method, r.bench) for f in files
                     if under_load(f.meta, [r.load_avg for r in f.records]) for r in f.records)


def significant_cells(files: Sequence[ResultFile], reps: int = BOLD_REPS, seed: int = BOOTSTRAP_SEED) -> frozenset:
    """(target, T, method, bench or 'mean') whose speedup is the column's best with a paired bootstrap interval
    against the runner-up above 1 (``paired.significant_best``); nothing when ``reps`` is 0."""
    from specbench.orderings import units
    from specbench.paired import significant_best

    if not reps:
        return frozenset()
    by_block: dict[Block, list[ResultFile]] = {}
    for f in files:
        if f.records:
            by_block.setdefault(f.block, []).append(f)
    out = set()
    for block, group in by_block.items():
        labels = sorted({r.method for f in group for r in f.records} - {VANILLA})
        benches = sorted({r.bench for f in group for r in f.records})
        for bench in benches + [None]:
            sides = {label: units(group, label, bench, False) for label in labels}
            best = significant_best({k: v for k, v in sides.items() if v}, "speedup", reps, seed)
            if best:
                out.add((*block, best, bench or MEAN))
    return frozenset(out)


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1400px}
table{border-collapse:collapse;margin:1em 0;font-size:13px}th,td{padding:3px 8px;text-align:right}
th:first-child,td:first-child,td.l{text-align:left}thead tr:last-child th{border-bottom:1px solid #444}
table{border-top:2px solid #444;border-bottom:2px solid #444}tr.section td{font-style:italic;text-align:left;
border-top:1px solid #999;background:#f4f4f4}.notes,.provenance{font-size:12px;color:#555}
figure{display:inline-block;margin:1em}figure img{max-width:640px}figcaption{font-size:12px}"""


def render_index_html(report: Report, figures: Sequence[Path]) -> str:
    """One self-contained page: inline CSS, every table, figures as base64 PNG."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8"><title>specbench report</title>',
             f"<style>{_CSS}</style></head><body>", "<h1>specbench report</h1>"]
    parts += [render_html(t) for t in report.tables]
    if figures:
        parts.append("<h2>Figures</h2>")
    for png in figures:
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        parts.append(f'<figure><img alt="{html.escape(png.stem)}" src="data:image/png;base64,{data}">'
                     f"<figcaption>{html.escape(png.stem)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_report(results_glob_or_paths: PathSpec = "results/*.jsonl", out_dir: str | Path = "reports",
                 paper_numbers: str | Path | None = DEFAULT_PAPER_NUMBERS, figures: bool = True) -> list[Path]:
    """Write every table as .md/.tex/.csv, the figures as PNG+PDF and a self-contained index.html.

    Returns the written paths, sorted."""
    from specbench.report_figures import write_figures

    report = build_report(results_glob_or_paths, paper_numbers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for table in report.tables:
        for suffix, text in ((".md", render_markdown(table)), (".tex", render_latex(table)),
                             (".csv", render_csv(table))):
            path = out / f"{table.name}{suffix}"
            path.write_text(text, encoding="utf-8")
            written.append(path)
    figure_paths = write_figures(report, out / "figures") if figures else []
    written += figure_paths
    index = out / "index.html"
    index.write_text(render_index_html(report, [p for p in figure_paths if p.suffix == ".png"]), encoding="utf-8")
    written.append(index)
    return sorted(written)


# ------------------------------------------------------------------------------- paper metrics (presets)

PAPER_METRIC_LABELS = {
    "end_to_end_speedup": "end-to-end tokens/s ratio, pooled; τ pooled",
    "faster_baseline_tpot_speedup": "decode-only mean time/token vs the faster vanilla; τ per response (macro)",
    "spec_bench_speedup": "Spec-Bench speed.py: mean per-question tokens/s ratio; MAT pooled",
}


def paper_metric_cells(files: Sequence[ResultFile]) -> pd.DataFrame:
    """For runs made by a paper preset (header ``preset``): each method's speedup and τ computed the way
    that paper computes them, beside our headline (end-to-end pooled speedup, pooled τ). Vanilla runs
    are told apart by the header's attention implementation (DDTree takes the faster one)."""
    from specbench.preset import load_preset

    groups: dict[tuple, dict[str, list]] = {}
    for f in files:
        preset = f.meta.get("preset")
        if not preset or not f.records:
            continue
        attn = str(f.meta.get("attn_implementation", "sdpa"))
        for r in f.records:
            g = groups.setdefault((preset, *f.block, r.bench), {"methods": {}, "baselines": {}})
            if r.method == VANILLA:
                g["baselines"].setdefault(attn, []).append(r)
            else:
                g["methods"].setdefault(r.method, []).append(r)
    rows = []
    for (preset, target, temp, bench), g in sorted(groups.items()):
        try:
            metric = load_preset(preset)["metric"]["name"]
        except SpecbenchError:
            metric = "unknown preset"
        sdpa = g["baselines"].get("sdpa") or next(iter(g["baselines"].values()), [])
        for method, recs in sorted(g["methods"].items()):
            used = "sdpa" if "sdpa" in g["baselines"] else next(iter(g["baselines"]), "")
            if metric == "faster_baseline_tpot_speedup":
                spd, used = metrics.faster_baseline_tpot_speedup(recs, g["baselines"])
                tau = metrics.tau_macro(recs)
                if len(g["baselines"]) < 2:
                    used += " (only baseline run)"
            elif metric == "spec_bench_speedup":
                spd, tau = metrics.spec_bench_speedup(recs, sdpa), metrics.tau(recs)
            else:
                spd, tau = metrics.speedup(recs, sdpa), metrics.tau(recs)
            rows.append(dict(preset=preset, target=target, temperature=temp, bench=bench, method=method,
                             metric=metric, paper_speedup=spd, paper_tau=tau, speedup=metrics.speedup(recs, sdpa),
                             tau=metrics.tau(recs), baseline=used, n_turns=len(recs)))
    return pd.DataFrame(rows)


def paper_metric_table(files: Sequence[ResultFile]) -> Table | None:
    """The 'paper metric' table: one section per preset, target and temperature; None without preset runs."""
    cells = paper_metric_cells(files)
    if cells.empty:
        return None
    columns = ["Bench", "Method", "Turns", "Spd", "τ", "Spd", "τ", "Baseline"]
    groups = [("", 3), ("paper's metric", 2), ("ours", 2), ("", 1)]
    sections = []
    for (preset, target, temp), block in cells.groupby(["preset", "target", "temperature"], sort=True):
        rows = [[Cell(bench_label(r.bench)), Cell(r.method), Cell(str(r.n_turns)), Cell(fmt_spd(r.paper_speedup)),
                 Cell(fmt_tau(r.paper_tau)), Cell(fmt_spd(r.speedup)), Cell(fmt_tau(r.tau)), Cell(r.baseline or DASH)]
                for r in block.sort_values(["bench", "method"], key=lambda s: s.map(str)).itertuples()]
        metric = block.metric.iloc[0]
        sections.append((f"{preset}: {target}, T = {temp:g}; paper metric {metric} "
                         f"({PAPER_METRIC_LABELS.get(metric, '?')})", rows))
    notes = ["'paper's metric' is computed the way the preset's paper computes it (its metric is named in each "
             "section); 'ours' is specbench's headline: end-to-end pooled tokens/s ratio and pooled τ, against the "
             "SDPA vanilla side. Baseline = the vanilla run the paper's speedup used."]
    return Table("paper_metric", "Runs of paper presets: the paper's metric beside ours", columns, groups, sections,
                 cells, notes, provenance_lines(files), align="llrrrrrl")
