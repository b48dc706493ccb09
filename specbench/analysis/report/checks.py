"""What the timings can be trusted for: one machine per table (files split by their header's hardware), the
A/A control (vanilla against a second vanilla side of the same run, whose speedup interval must contain
1.00×), and the T = 0 divergence counts (identical / near-tie / unexplained, specbench/divergence.py) with, for
runs made with --check forced, the forced figures beside them (specbench/agreement.py)."""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import pandas as pd

from specbench import agreement, divergence, metrics
from specbench.errors import SpecbenchError
from specbench.analysis.report.names import VANILLA, block_label
from specbench.analysis.report.records import ResultFile
from specbench.analysis.report.stats import BOOTSTRAP_REPS, BOOTSTRAP_SEED, half_width, speedup_ci
from specbench.analysis.report.table import DASH, Cell, Table, fmt_ci, fmt_spd

UNKNOWN_HARDWARE = "unknown hardware"


def hardware_of(f: ResultFile) -> str:
    return str(f.meta.get("hardware") or UNKNOWN_HARDWARE)


def machine_slug(hardware: str) -> str:
    """A file-name form of a hardware string: 'AMD EPYC (2 threads)' -> 'amd-epyc-2-threads'."""
    return re.sub(r"[^a-z0-9]+", "-", hardware.lower()).strip("-") or "unknown"


_ISA = (("amx", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx2", "AVX2"))


def hardware_label(hardware: str) -> str:
    """A short name for a header's hardware string, for places that name it more than once:
    'Intel(R) Xeon(R) Processor [family 6 model 167, avx512_bf16/amx_bf16] (2 threads)' -> 'Xeon 6/167 AMX',
    'AMD EPYC [family 25 model 1, avx2 only] (2 threads)' -> 'EPYC 25/1 AVX2'; a string of another form is cut
    to 28 characters."""
    plain = re.sub(r"\((?:R|TM)\)", "", hardware).split("[")[0].split("(")[0]  # the name, without its thread count
    name = re.sub(r"\b(?:Processor|CPU|Intel|AMD|NVIDIA)\b", "", plain)
    name = " ".join(name.split()) or hardware
    found = re.search(r"\[family (\d+) model (\d+)(?:, ([^\]]*))?\]", hardware)
    if not found:
        return name if len(name) <= 28 else name[:27] + "…"
    isa = next((short for key, short in _ISA if key in (found.group(3) or "")), "")
    return " ".join(part for part in (name, f"{found.group(1)}/{found.group(2)}", isa) if part)


def _part_machines(f: ResultFile) -> set[str]:
    """The hardware of every part a merged file was made from (``specbench merge``: meta parts)."""
    return {str(p.get("hardware") or UNKNOWN_HARDWARE) for p in f.meta.get("parts") or [] if isinstance(p, dict)}


def split_by_machine(files: Sequence[ResultFile]) -> list[tuple[str, list[ResultFile]]]:
    """The files grouped by the hardware string of their header, one group per machine, so that no table
    pools, ranks or bolds timings of different hardware. The machine with the most files (then records)
    comes first: its tables keep their plain names. Files without records go with the first machine.

    A split is impossible only for a merged file whose parts ran on different machines (its records do not
    say which machine timed them): refused in one line naming the file."""
    for f in files:
        if len(parts := _part_machines(f)) > 1:
            raise SpecbenchError(f"{f.path.name} merges parts timed on {len(parts)} machines "
                                 f"({'; '.join(sorted(parts))}) and its records do not say which machine timed "
                                 "each, so it cannot be split by machine: report each part's file on its own")
    by_hw: dict[str, list[ResultFile]] = {}
    for f in files:
        if f.records:
            by_hw.setdefault(hardware_of(f), []).append(f)
    order = sorted(by_hw, key=lambda hw: (-len(by_hw[hw]), -sum(len(f.records) for f in by_hw[hw]), hw))
    groups = [(hw, by_hw[hw]) for hw in order]
    if groups:
        groups[0][1].extend(f for f in files if not f.records)
    return groups


def aa_labels(f: ResultFile) -> list[str]:
    """The file's A/A sides: a second vanilla side (method vanilla, another label)."""
    return [label for label, info in f.sides().items() if info.method == VANILLA and label != VANILLA]


def without_aa(files: Sequence[ResultFile]) -> list[ResultFile]:
    """The files without their A/A sides' records (a control, not a method: no row, rank or bold)."""
    out = []
    for f in files:
        drop = set(aa_labels(f))
        out.append(dataclasses.replace(f, records=tuple(r for r in f.records if r.method not in drop)) if drop else f)
    return out


def aa_frame(files: Sequence[ResultFile], reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED) -> pd.DataFrame:
    """Per file, A/A side and bench: the 'speedup' of vanilla over vanilla with its 95% interval over
    conversations, and whether the interval contains 1."""
    rows = []
    for f in files:
        for label in aa_labels(f):
            for bench in sorted({r.bench for r in f.records if r.method == label}):
                ours = [r for r in f.records if r.method == label and r.bench == bench]
                base = [r for r in f.records if r.method == VANILLA and r.bench == bench]
                point = metrics.speedup(ours, base)
                lo, hi = speedup_ci(ours, base, reps=reps, seed=seed)
                contains = bool(lo <= 1.0 <= hi) if lo == lo and hi == hi else None
                rows.append(dict(file=f.path.name, block=block_label(f.block), side=label, bench=bench,
                                 n=len({r.prompt_id for r in ours}), speedup=point, lo=lo, hi=hi,
                                 half_width=half_width(point, lo, hi), contains_1=contains))
    return pd.DataFrame(rows, columns=["file", "block", "side", "bench", "n", "speedup", "lo", "hi", "half_width",
                                       "contains_1"])


def aa_table(files: Sequence[ResultFile], provenance: Sequence[str] = (), reps: int = BOOTSTRAP_REPS,
             seed: int = BOOTSTRAP_SEED) -> Table | None:
    """The A/A rows: a file whose vanilla-vs-vanilla interval excludes 1.00× is flagged (its intervals are
    narrower than its noise)."""
    frame = aa_frame(files, reps, seed)
    if frame.empty:
        return None
    rows, notes = [], []
    for r in frame.itertuples():
        verdict = DASH if r.contains_1 is None else ("contains 1" if r.contains_1 else "EXCLUDES 1")
        rows.append([Cell(r.file), Cell(r.side), Cell(r.bench), Cell(str(r.n)),
                     Cell(fmt_ci(fmt_spd(r.speedup), r.lo, r.hi, fmt_spd)),
                     Cell(DASH if r.half_width != r.half_width else f"±{100 * r.half_width:.1f}%"),
                     Cell(verdict, r.contains_1 is False)])
        if r.contains_1 is False:
            notes.append(f"{r.file}: vanilla against itself gives {fmt_spd(r.speedup)} [{r.lo:.2f}, {r.hi:.2f}]: "
                         "this file's intervals are narrower than its timing noise (re-time it on an idle machine)")
    notes.insert(0, "A/A control: a second vanilla side interleaved in the same run; its speedup over vanilla is 1.00× "
                    "up to timing noise, so its 95% interval (bootstrap over conversations) must contain 1.00×; "
                    "± = half the interval's width relative to the point, the smallest effect this file resolves")
    return Table("aa_table", "A/A control: vanilla against a second vanilla side of the same run",
                 ["File", "Side", "Bench", "n", "Spd [95% CI]", "±", "Verdict"], [], [("", rows)],
                 frame, notes, list(provenance), align="lllrrrl")


def divergence_frame(files: Sequence[ResultFile]) -> pd.DataFrame:
    """Per block and method side: T = 0 turns identical to vanilla's, near-ties, unexplained, unchecked (by the
    rule that set each status); the turns that diverged counted by the bound (``old_*``) and by the exact rule
    (``exact_*``), the turns they judge differently and the flips the exact rule has not judged; the largest noise
    the exact rule measured at a flip; the largest logit difference seen between the two sides where they agreed (in logits, and in u·|logit|), the
    largest gap m + v at a flip, and the smallest tolerance the near-tie rule gave there."""
    rows = []
    for f, label, found in _greedy_sides(files, "divergence"):
        c = divergence.counts(found)
        rows.append(dict(block=block_label(f.block), file=f.path.name, method=label, dtype=f.meta.get("dtype"),
                         turns=len(found), **{k.replace("-", "_"): v for k, v in c.items()},
                         **divergence.rule_counts(found), position_noise_max=_extreme(max, found, "position_noise"),
                         noise=_extreme(max, found, "noise"),
                         noise_roundings=_extreme(max, found, "noise_roundings"),
                         gap_max=_extreme(max, found, "gap"), tolerance_min=_extreme(min, found, "tolerance")))
    return pd.DataFrame(rows, columns=["block", "file", "method", "dtype", "turns", "identical", "near_tie",
                                       "unexplained", "unchecked", *RULE_COLUMNS, "position_noise_max", "noise",
                                       "noise_roundings", "gap_max", "tolerance_min"])


def _greedy_sides(files: Sequence[ResultFile], field: str):
    """(file, side label, that side's non-empty ``field`` entries) of every T = 0 file, sides in name order."""
    for f in files:
        if f.block[1] != 0:
            continue
        for label in sorted({r.method for r in f.records if getattr(r, field)}):
            yield f, label, [getattr(r, field) for r in f.records if r.method == label and getattr(r, field)]


RULE_COLUMNS = ("old_near_tie", "old_unexplained", "exact_near_tie", "exact_unexplained", "disagree", "not_rescored")


def _extreme(pick, found: Sequence[dict], key: str) -> float:
    """max or min of ``key`` over the divergence records that have it, NaN when none does. ``gap`` is a flip's
    m + v: how far the two sides' forwards disagreed about l[a] − l[b] at the first difference."""
    if key == "gap":
        values = [d["method_margin"] + d["vanilla_margin"] for d in found
                  if "method_margin" in d and "vanilla_margin" in d]
    else:
        values = [d[key] for d in found if key in d]
    values = [v for v in values if v == v]  # NaN: no tolerance where a margin was only bounded (unexplained)
    return pick(values) if values else float("nan")


def divergence_table(files: Sequence[ResultFile], provenance: Sequence[str] = ()) -> Table | None:
    """Identical / near-tie / unexplained per method and file (T = 0 runs that recorded it)."""
    frame = divergence_frame(files)
    if frame.empty:
        return None
    rows = [[Cell(r.file), Cell(r.method), Cell(str(r.dtype)), Cell(str(r.turns)), Cell(str(r.identical)),
             Cell(str(r.near_tie)), Cell(str(r.unexplained), r.unexplained > 0), Cell(str(r.unchecked)),
             Cell(f"{r.old_near_tie}/{r.old_unexplained}"), *_exact_cells(r),
             Cell(_fmt_logit(r.noise)), Cell(_fmt_logit(r.gap_max)), Cell(_fmt_logit(r.tolerance_min))]
            for r in frame.itertuples()]
    notes = ["Each T = 0 method turn against vanilla's same turn: identical text; near-tie = at the first differing "
             "position both sides' logit margins between the two tokens add up to no more than the dtype's rounding "
             "of those logits (per side √(2L+2) · u · (|l_a| + |l_b|): 2L+2 roundings of a logit through L layers "
             "adding like a random walk, u = eps/2 of the dtype: 2^-8 bf16, 2^-24 fp32), each token among the other "
             "side's "
             f"{divergence.TOP_K} best; unexplained = anything else (a bug until shown otherwise); a later turn of a "
             "diverged conversation takes its first divergence's status; unchecked = a side's logits were not kept "
             "(resumed run)",
             "Noise = the largest difference between the two sides' logit of a token both committed (in logits): how "
             "far the batched verify and vanilla's one-row step are seen to disagree where their texts agree. Gap max = "
             "the largest m + v at this side's flips: how far the two forwards disagreed about l[a] − l[b] where the "
             "texts part, a difference of two logits: a gap within twice the noise is a flip inside the disagreement "
             "the same turns show elsewhere. δ min = the smallest tolerance the rule gave at this side's flips (both "
             "sides' δ summed)",
             "Exact rule (bf16/fp16 flips; it sets Near-tie/Unexplained where it has judged): the shared prefix is "
             "re-scored by a plain float32 forward, giving the exact gap e = l_a − l_b, and by correct forwards in the "
             "run's dtype at that position (vanilla's one-row decode steps; the method's verify shapes replayed; caches "
             "built by verifies of 2, 4, 8, 16 rows; verifies of 1–16 rows after a prefill; as chains and as trees); "
             "the position's noise N is the farthest their gaps land from e, at least one rounding of each logit; a "
             "near-tie when both sides' recorded gaps lie within N of e (so |e| ≤ N), else unexplained. Bound n/u = the verdicts of the δ rule above on the same turns (kept for "
             "one release); Exact n/u = the exact rule's, with N max the largest noise it measured; Disagree = turns "
             "the two rules judge differently; a + after Exact counts flips not yet judged by it (run `specbench "
             "recheck FILE`)"]
    notes += rescored_elsewhere(files)
    return with_forced(Table("divergence_table", "Greedy divergences from vanilla: identical, near-tie or unexplained",
                             ["File", "Method", "dtype", "Turns", "Identical", "Near-tie", "Unexplained", "Unchecked",
                              "Bound n/u", "Exact n/u", "N max", "Disagree", "Noise", "Gap max", "δ min"], [],
                             [("", rows)], frame, notes, list(provenance), align="lllrrrrrrrrrrrr"), files)


def rescored_elsewhere(files: Sequence[ResultFile]) -> list[str]:
    """A note per file whose flips `specbench recheck` re-scored on another machine than the one that ran it: the
    noise N its exact verdicts rest on is that machine's forwards, not the ones that made the texts."""
    notes = []
    for f in files:
        machines = {str(d["rescored_on"]) for r in f.records if (d := r.divergence) and d.get("rescored_on")}
        if other := sorted(machines - {hardware_of(f)}):
            notes.append(f"{f.path.name}: its exact verdicts were re-scored on {'; '.join(other)}, not on the machine "
                         f"that ran it ({hardware_of(f)}): N is measured with that machine's kernels")
    return notes


def _exact_cells(r) -> list[Cell]:
    """Exact n/u (+ flips it has not judged), N max, Disagree: dashes where the exact rule judged nothing."""
    judged = r.exact_near_tie + r.exact_unexplained
    if not _rescored_dtype(r.dtype):  # fp32 keeps the bound
        return [Cell(DASH), Cell(DASH), Cell(DASH)]
    if not judged:
        return [Cell(DASH if not r.not_rescored else f"+{r.not_rescored}"), Cell(DASH), Cell(DASH)]
    text = f"{r.exact_near_tie}/{r.exact_unexplained}" + (f" +{r.not_rescored}" if r.not_rescored else "")
    return [Cell(text, r.exact_unexplained > 0), Cell(_fmt_logit(r.position_noise_max)),
            Cell(str(r.disagree), r.disagree > 0)]


def _fmt_logit(x: float) -> str:
    return DASH if x != x else f"{x:.3g}"


FORCED_FIGURES = ("turns", "positions", "turns_off_tokens", "p50", "p90", "p99", "max", "top1")


def forced_frame(files: Sequence[ResultFile]) -> pd.DataFrame:
    """Per file and method side of a T = 0 run with --check forced: the forced figures pooled over its turns
    (agreement.pooled: quantiles of every position's max |Δlogit|, top-1 agreement), and the A/A side's beside."""
    rows = []
    for f, label, found in _greedy_sides(files, "forced"):
        ours, aa = agreement.pooled(found), agreement.pooled(d["aa"] for d in found)
        rows.append(dict(file=f.path.name, method=label, dtype=f.meta.get("dtype"),
                         **{f"forced_{k}": ours[k] for k in FORCED_FIGURES},
                         **{f"aa_{k}": aa[k] for k in FORCED_FIGURES}))
    return pd.DataFrame(rows, columns=["file", "method", "dtype", *(f"{side}_{k}" for side in ("forced", "aa")
                                                                       for k in FORCED_FIGURES)])


def _fmt_quantiles(r: dict, side: str) -> str:
    values = [r[f"{side}_{k}"] for k in ("p50", "p90", "p99", "max")]
    return DASH if any(v is None or v != v for v in values) else "/".join(f"{v:.3g}" for v in values)


def _fmt_share(x) -> str:
    return DASH if x is None or x != x else f"{100 * x:.1f}%"


def with_forced(table: Table, files: Sequence[ResultFile]) -> Table:
    """The divergence table with the forced check's columns when records carry them (its rows follow its data's):
    per method the quantiles of the per-position max |Δlogit| and the top-1 agreement, the A/A side's beside them.
    Bold: a side that committed a token other than vanilla's, or an fp32 row past the engine's bound."""
    forced = forced_frame(files)
    if forced.empty:
        return table
    by_side = {(r["file"], r["method"]): r for r in forced.to_dict("records")}
    rows = table.sections[0][1]
    for row, (file, method) in zip(rows, zip(table.data["file"], table.data["method"])):
        r = by_side.get((file, method))
        if r is None:
            row += [Cell(DASH)] * 4
            continue
        fp32 = str(r["dtype"]) in ("float32", "fp32")
        bad = {side: r[f"{side}_turns_off_tokens"] > 0 or (fp32 and (r[f"{side}_max"] or 0) > agreement.FP32_BOUND)
               for side in ("forced", "aa")}
        row += [Cell(_fmt_quantiles(r, "forced"), bad["forced"]), Cell(_fmt_share(r["forced_top1"])),
                Cell(_fmt_quantiles(r, "aa"), bad["aa"]), Cell(_fmt_share(r["aa_top1"]))]
    data = table.data.merge(forced.drop(columns="dtype"), on=["file", "method"], how="left")
    note = ("Forced (--check forced): every method turn run again, untimed, committing vanilla's tokens, so each "
            "verify row that chose a token has a twin in vanilla's one-row steps: |Δ| p50/p90/p99/max = quantiles over "
            "every position of the largest |Δlogit| over the vocabulary, top-1 = positions where both rows' argmax "
            "agree; A/A = the same for a chain of vanilla's own tokens at the method's row counts (the forward's own "
            "noise, no tree). In fp32 every row must be within "
            f"{agreement.FP32_BOUND:g}; in bf16 the method's quantiles must match the A/A ones")
    return dataclasses.replace(table, columns=[*table.columns, "Forced |Δ| p50/p90/p99/max", "Top-1",
                                               "A/A |Δ| p50/p90/p99/max", "A/A top-1"],
                               data=data, notes=[*table.notes, note], align=table.align + "rrrr")


def _rescored_dtype(dtype) -> bool:
    try:
        return divergence.exact_rule_applies(str(dtype))
    except ValueError:  # no dtype recorded
        return False
