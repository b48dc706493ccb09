"""`specbench recheck`: the exact rule (``specbench/divergence.py``) applied to results files already
written, without re-timing anything.

Re-scoring a flip needs only its turn's prompt ids and tokens. The records keep the tokens; the prompt is
rendered again as the run rendered it: the bench's prompt by the record's id (the stream's ``#passN``
suffix dropped), the header's system prompt and chat template (its sha must match the header's), and, for
a later turn of a conversation, the method's own earlier answers (its records of the earlier turns). The
rendered ids must be as many as the record's ``prompt_tokens``; the target loads as the header names it,
in the run's dtype, on the run's device unless told otherwise. Each file is rewritten atomically under the
writer lock, every line but the re-judged records' byte for byte (those keep every other field's bytes
too: the writer's own JSON form)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specbench import commands, divergence
from specbench.engine import VANILLA
from specbench.engine.devices import resolve_device
from specbench.engine.prompts import ChatFormat, render_chat
from specbench.engine.rescore import Rescorer
from specbench.engine.target import Target, resolve_dtype
from specbench.errors import SpecbenchError
from specbench.options import check_values, declared_by_name
from specbench.records import GenerationRecord
from specbench.data.benchmarks import Prompt
from specbench.data.results import hardware, read_results
from specbench.data.safe_files import WriterLock, check_output, rewrite_results
from specbench.data.streams import load_stream_prompts
from specbench.run.tool_configs import RecheckConfig

_PASS_SUFFIX = re.compile(r"#pass\d+$")  # build_queries' id of a prompt's second and later passes


@dataclass
class Outcome:
    """One file's recheck: per method side, the bound's and the exact rule's verdict counts (``rule_counts``),
    how many flips were re-scored now, and a note (skipped, or where the noise was measured)."""

    path: Path
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    rescored: int = 0
    note: str = ""


class _Targets:
    """Targets loaded so far, one per (spec, revision, dtype, device, attention): a glob of files of one
    target loads it once."""

    def __init__(self) -> None:
        self.loaded: dict[tuple, Rescorer] = {}

    def get(self, meta: dict, device: str, exact_dtype: str) -> Rescorer:
        key = (meta.get("target"), meta.get("target_revision"), meta.get("dtype"), device,
               meta.get("attn_implementation") or "sdpa", exact_dtype)
        if key not in self.loaded:
            target = Target.load(key[0], key[2], device, key[4], key[1])
            recorded = ((meta.get("weights") or {}).get("target") or {}).get("sha")
            found = target.source.sha if target.source is not None else None
            if recorded and found and recorded != found:
                raise SpecbenchError(f"its target {key[0]} resolves to commit {found}, the run used {recorded}; "
                                     "pin that revision (--target-revision) in a new run instead")
            self.loaded[key] = Rescorer(target, exact_dtype)
        return self.loaded[key]


def _device(meta: dict, device: str | None) -> str:
    """The run's device unless one is given; a CUDA file on a machine without CUDA is refused."""
    if device is not None:
        return resolve_device(device)
    recorded = str(meta.get("device") or "cpu")
    if recorded.startswith("cuda") and not torch.cuda.is_available():
        raise SpecbenchError(f"it was run on {recorded} and this machine has no CUDA device; re-check it on one, or "
                             "pass --device cpu --other-machine (the noise is then this CPU's)")
    return recorded


def _same_machine(meta: dict, machine: str, other_machine: bool) -> None:
    """Refuses to re-score a file made on another machine unless asked: the exact rule holds the run's recorded
    gaps to the noise of this machine's forwards, and other kernels (another CPU, other threads, a GPU) round
    differently, so a correct flip can come out unexplained (docs/usage.md measures one)."""
    recorded = meta.get("hardware")
    if recorded and recorded != machine and not other_machine:
        raise SpecbenchError(f"it was run on {recorded}, and this is {machine}: the exact rule would hold its gaps to "
                             "this machine's rounding, not the one that made them; re-check it on the machine that "
                             "ran it, or pass --other-machine to re-score it here anyway")


def _chat(meta: dict, target: Target) -> ChatFormat:
    """The run's prompt format; refused when the target's template no longer renders as the run's did."""
    if target.tokenizer is None:
        raise SpecbenchError(f"its target {meta.get('target')} has no tokenizer to render the prompts with")
    chat = ChatFormat(meta.get("chat_template") or "auto", meta.get("chat_template_kwargs") or {})
    chat = chat.resolve(target.tokenizer, target.name)
    recorded = meta.get("prompt_format")
    if recorded and recorded != chat.describe(target.tokenizer):
        raise SpecbenchError(f"its prompts were rendered with {recorded}, the target now gives "
                             f"{chat.describe(target.tokenizer)}; they cannot be rendered again")
    return chat


def _prompts(meta: dict, data_dir: str | None) -> dict[str, Prompt]:
    prompts = load_stream_prompts(str(meta.get("bench")), data_dir, category=meta.get("category"))
    return {p.id: p for p in prompts}


def prompt_ids(target: Target, chat: ChatFormat, system_prompt: str | None, prompt: Prompt,
               answers: list[GenerationRecord], turn: int) -> list[int]:
    """The ids turn ``turn`` of ``prompt`` was generated from: its user turns so far and, before each later
    one, the side's own answer (``answers[k]``: its record of turn k), as ``generate_turns`` renders them."""
    messages: list[dict] = []
    for k in range(turn + 1):
        messages.append({"role": "user", "content": prompt.turns[k]})
        if k < turn:
            messages.append({"role": "assistant",
                             "content": target.tokenizer.decode(answers[k].new_tokens, skip_special_tokens=True)})
    return render_chat(target.tokenizer, messages, system_prompt, chat)


def _render(meta: dict, target: Target, chat: ChatFormat, prompts: dict[str, Prompt],
            by_key: dict[tuple, GenerationRecord], record: GenerationRecord) -> list[int]:
    base_id = _PASS_SUFFIX.sub("", record.prompt_id)
    prompt = prompts.get(base_id)
    where = f"{record.method} prompt {record.prompt_id} turn {record.turn}"
    if prompt is None or record.turn >= len(prompt.turns):
        raise SpecbenchError(f"{where}: bench {meta.get('bench')} has no such prompt (turn); pass the --data-dir "
                             "the run read")
    earlier = [by_key.get((record.method, record.bench, record.prompt_id, k)) for k in range(record.turn)]
    if any(r is None for r in earlier):
        raise SpecbenchError(f"{where}: an earlier turn's record is missing, so its prompt cannot be rendered")
    ids = prompt_ids(target, chat, meta.get("system_prompt"), prompt, earlier, record.turn)
    if len(ids) != record.prompt_tokens:
        raise SpecbenchError(f"{where} renders to {len(ids)} ids, the record says {record.prompt_tokens}; the "
                             "prompt cannot be rendered as the run rendered it")
    return ids


def _counts(records: list[GenerationRecord]) -> dict[str, dict[str, int]]:
    sides = sorted({r.method for r in records if r.divergence and r.method != VANILLA})
    return {side: divergence.rule_counts(r.divergence for r in records if r.method == side) for side in sides}


def _follow_inherited(records: list[GenerationRecord], by_key: dict[tuple, GenerationRecord]) -> set[int]:
    """Later turns of a diverged conversation take their first flip's (re-judged) verdict; their indices."""
    changed = set()
    for index, record in enumerate(records):
        d = record.divergence
        if not d or "after_turn" not in d:
            continue
        first = by_key.get((record.method, record.bench, record.prompt_id, d["after_turn"]))
        if first is None or not first.divergence or first.divergence.get("rule") != divergence.EXACT:
            continue
        new = divergence.inherited(first.divergence, d["after_turn"])
        new.update({k: v for k, v in d.items() if k not in new})
        if new != d:
            record.divergence = new
            changed.add(index)
    return changed


def _rewrite(path: Path, numbers: dict[int, GenerationRecord], lock: WriterLock) -> None:
    """``path`` with the record lines ``numbers`` (1-based line -> record) written again, the other lines
    (and a torn tail) byte for byte; atomically under its writer ``lock``, keeping the file's mode."""
    with open(path, "rb") as fh:
        raw = fh.readlines()  # the lines as read_results numbered them

    def line(number: int, text: bytes) -> bytes:
        if number not in numbers:
            return text
        obj = json.loads(text)
        obj["divergence"] = numbers[number].divergence
        return (json.dumps(obj, ensure_ascii=False, default=str) + "\n").encode("utf-8")

    rewrite_results(path, [line(n, text) for n, text in enumerate(raw, 1)], lock)


def recheck_file(path: str | Path, targets: _Targets, device: str | None = None, data_dir: str | None = None,
                 again: bool = False, exact_dtype: str = "float32", other_machine: bool = False) -> Outcome:
    """Re-judge every first flip of one results file by the exact rule (``again``: those already judged
    too), rewrite it, and count both rules' verdicts per method side. A file made on another machine is
    refused unless ``other_machine`` (``_same_machine``)."""
    path = Path(path)
    check_output(path, what="results file")
    if not path.is_file():
        raise SpecbenchError("no such results file")
    lock = WriterLock(path, "results file")  # a run still appending to it is refused, and no run starts meanwhile
    try:
        content = read_results(path)
        meta = content.meta
        if meta is None:
            raise SpecbenchError("it has no header line; it is not a specbench results file")
        indexed = [r for _, r in content.records]
        if float(meta.get("temperature") or 0.0) != 0.0:
            return Outcome(path, note=f"T = {meta.get('temperature')}: no greedy divergences to re-check")
        dtype = str(meta.get("dtype") or "")
        first_flips = [(n, r) for n, r in content.records if divergence.rescorable(r.divergence)]
        if not divergence.exact_rule_applies(resolve_dtype(dtype)):
            judged = "every flip exceeds it" if first_flips else "no flips to judge"
            return Outcome(path, _counts(indexed), note=f"{dtype}: the bound stands ({judged})")
        flips = [(n, r) for n, r in first_flips if again or r.divergence.get("rule") != divergence.EXACT]
        if not flips:
            why = "nothing new to re-score" if first_flips else "no flips to judge"
            return Outcome(path, _counts(indexed), note=why)
        where = resolve_device(_device(meta, device))
        machine = hardware(where)
        _same_machine(meta, machine, other_machine)
        rescorer = targets.get(meta, where, exact_dtype)
        target = rescorer.target
        chat, prompts = _chat(meta, target), _prompts(meta, data_dir)
        by_key = {(r.method, r.bench, r.prompt_id, r.turn): r for r in indexed}
        ids = {n: _render(meta, target, chat, prompts, by_key, r) for n, r in flips}  # every prompt before any forward
        for n, record in flips:
            judged = rescorer.judge(record.divergence, ids[n], record)
            judged["rescored_on"] = machine
            record.divergence = judged
        numbers = {n: r for n, r in flips}
        line_of = {id(r): n for n, r in content.records}
        numbers.update({line_of[id(indexed[i])]: indexed[i] for i in _follow_inherited(indexed, by_key)})
        _rewrite(path, numbers, lock)
        note = "" if machine == meta.get("hardware") else f"noise measured on {machine} (the run: {meta.get('hardware')})"
        return Outcome(path, _counts(indexed), len(flips), note)
    finally:
        lock.release()


def check_flags(device: str | None, data_dir: str | None, exact_dtype: str = "float32") -> None:
    """``--device``, ``--data-dir`` and ``--exact-dtype`` refused by `specbench recheck`'s declarations (the same
    checks `specbench run` makes of the first two), before any file is read: a file without flips to re-score
    would otherwise never look at them."""
    values = {"device": device, "data_dir": data_dir, "exact_dtype": exact_dtype}
    check_values(values, declared_by_name(RecheckConfig), commands.label(RecheckConfig))


def recheck(paths: list[Path], device: str | None = None, data_dir: str | None = None, again: bool = False,
            exact_dtype: str = "float32", refused: Callable[[Path, str], None] = lambda path, why: None,
            other_machine: bool = False) -> list[Outcome]:
    """``recheck_file`` over ``paths``; a file that cannot be re-checked is reported to ``refused`` with its
    one-line reason and left as it was."""
    check_flags(device, data_dir, exact_dtype)
    targets, out = _Targets(), []
    for path in paths:
        try:
            out.append(recheck_file(path, targets, device, data_dir, again, exact_dtype, other_machine))
        except SpecbenchError as exc:
            refused(path, str(exc))
    return out
