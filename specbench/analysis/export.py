"""Spec-Bench interop: our results files as Spec-Bench answer files, so its own ``evaluation/speed.py``
reads our runs.

Spec-Bench (hemingkx/Spec-Bench ``evaluation/eval.py``) writes one JSON line per question::

    {"question_id", "category", "answer_id", "model_id", "tstamp",
     "choices": [{"index": 0, "turns": [text per turn], "decoding_steps": [verify calls per turn],
                  "new_tokens": [tokens per turn], "wall_time": [seconds per turn],
                  "accept_lengths": [tokens committed per step, all turns]}]}

and ``speed.py`` compares a method's file with the vanilla file. One file per method label is written:
``<model_id>-<label>.jsonl`` (vanilla included). ``wall_time`` is our end-to-end time (prefill + decode),
as Spec-Bench times the whole forward function; ``accept_lengths`` are committed tokens per verify call
(accepted + bonus); the baseline gets ``[1] * new_tokens`` as Spec-Bench's baseline_forward writes.

Categories: speed.py groups questions by ``category``; each comes from the results header
(``prompt_categories``, written by the run from the prompts' own category field) or, for files written
before the header had it, from the bench's data; a question whose category is unknown stops the export
(one line), never labelled with the bench's name.

Token counts: speed.py recounts the baseline's tokens as ``len(tokenizer(text).input_ids) - 1`` per turn,
i.e. it re-tokenizes the text and drops a BOS. So every turn's text is the exact decode of its tokens
(special tokens such as the EOS kept, nothing stripped), and a copy of the target's tokenizer that adds
exactly one BOS is written beside the answers (``tokenizer/``, for ``--tokenizer-path``): SmolLM2's own adds
none, which would undercount every turn by one. A turn whose tokens do not survive decode and re-encode
(a non-canonical tokenization) is counted in a one-line warning.
"""

from __future__ import annotations

import json
import uuid
import warnings
from pathlib import Path
from typing import Callable, Sequence

from specbench.errors import SpecbenchError
from specbench.data.benchmarks import HEADER_KEY, category_header
from specbench.engine import VANILLA as BASELINE
from specbench.records import GenerationRecord
from specbench.data.safe_files import atomic_text, check_output

FORMATS = ("spec-bench",)
TOKENIZER_DIR = "tokenizer"  # the counting tokenizer, beside the answer files


def question_id(prompt_id: str):
    """Spec-Bench's ids are integers; ours are their strings (other benches keep their own ids)."""
    return int(prompt_id) if prompt_id.isdigit() else prompt_id


def answer_rows(records: Sequence[GenerationRecord], categories: dict[tuple[str, str], str], model_id: str,
                decode: Callable[[list[int]], str], tstamp: float) -> list[dict]:
    """One Spec-Bench answer row per question of one method's records, in question order; ``categories``
    maps (bench, prompt id) to the question's category (every question must have one)."""
    by_prompt: dict[tuple[str, str], list[GenerationRecord]] = {}
    for r in records:
        by_prompt.setdefault((r.bench, r.prompt_id), []).append(r)
    rows = []
    for key in sorted(by_prompt, key=lambda k: (k[0], not k[1].isdigit(), int(k[1]) if k[1].isdigit() else 0, k[1])):
        turns = sorted(by_prompt[key], key=lambda r: r.turn)
        baseline = turns[0].method == BASELINE
        accept = [1] * sum(r.num_new for r in turns) if baseline else \
            [a + 1 for r in turns for a in r.accept_lengths]
        choice = {"index": 0, "turns": [decode(r.new_tokens) for r in turns],
                  "decoding_steps": [r.num_new if baseline else r.n_verify for r in turns],
                  "new_tokens": [r.num_new for r in turns], "wall_time": [r.total_time for r in turns],
                  "accept_lengths": accept}
        pid = key[1]
        rows.append({"question_id": question_id(pid), "category": categories[key],
                     "answer_id": uuid.uuid5(uuid.NAMESPACE_URL, f"{model_id}/{pid}").hex[:22],
                     "model_id": model_id, "choices": [choice], "tstamp": tstamp})
    return rows


# ---- categories ---------------------------------------------------------------------------------
def _from_data(bench: str, data_dir: str | None) -> dict | None:
    """Older results files: the categories of the bench's data, or None when it cannot be read."""
    from specbench.data.benchmarks import load_benchmark

    try:
        return category_header(load_benchmark(bench, data_dir))[bench]
    except (SpecbenchError, KeyError):
        return None


def _one_category(value) -> str:
    """Spec-Bench's category is one string: a prompt in several categories is in the group of all of them."""
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def question_categories(meta: dict, records: Sequence[GenerationRecord], path: Path,
                        data_dir: str | None = None) -> dict[tuple[str, str], str]:
    """(bench, prompt id) -> category for every question of ``records``, from the header (else the bench's
    data, for files written before headers recorded it); one line naming what is unknown otherwise."""
    recorded = meta.get(HEADER_KEY)
    found: dict[tuple[str, str], str] = {}
    for bench in sorted({r.bench for r in records}):
        entry = recorded.get(bench) if isinstance(recorded, dict) else _from_data(bench, data_dir)
        where = "its results header" if isinstance(recorded, dict) else "the bench's data (the header predates them)"
        if entry is None:
            raise SpecbenchError(f"cannot tell the Spec-Bench category of {path}'s {bench} questions: neither the "
                                 "results header nor the bench's data names them; rerun with this specbench (its "
                                 "header records them) or pass --data-dir with the bench's files")
        if not entry.get("field"):
            raise SpecbenchError(f"bench {bench!r} of {path} has no categories ({where}), and Spec-Bench's speed.py "
                                 "groups answers by category; export runs of spec_bench or mt_bench, or of a prompt "
                                 "file whose rows carry meta.category")
        ids = sorted({r.prompt_id for r in records if r.bench == bench})
        missing = [i for i in ids if i not in entry["values"]]
        if missing:
            shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
            raise SpecbenchError(f"{len(missing)} {bench} question(s) of {path} have no {entry['field']} in {where}: "
                                 f"{shown}; give those prompts a {entry['field']} or leave them out of the run")
        found.update({(bench, i): _one_category(entry["values"][i]) for i in ids})
    return found


# ---- tokens ---------------------------------------------------------------------------------------
def load_tokenizer(spec: str):
    """The target's tokenizer (embedded name, folder, .gguf or hub id), to turn tokens back into text."""
    from transformers import AutoTokenizer

    from specbench.engine.target import DEFAULT_TARGET, embedded_gguf

    try:
        if spec == DEFAULT_TARGET or spec.endswith(".gguf"):
            gguf = embedded_gguf(spec) if spec == DEFAULT_TARGET else Path(spec)
            return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return AutoTokenizer.from_pretrained(spec)
    except SpecbenchError:
        raise
    except Exception as e:  # missing folder, offline hub, ...: one line
        raise SpecbenchError(f"cannot load the tokenizer of {spec!r} ({type(e).__name__}); pass --tokenizer") from None


def exact_text(tok) -> Callable[[list[int]], str]:
    """Tokens -> the text they decode to, unaltered (special tokens kept, no clean-up, no strip), so that
    re-tokenizing the text gives the tokens back wherever the tokenization is canonical."""
    return lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def added_tokens(tok) -> int:
    """How many special tokens the tokenizer adds around a text (speed.py assumes exactly one: a BOS)."""
    return len(tok("a").input_ids) - len(tok("a", add_special_tokens=False).input_ids)


def counting_tokenizer(tok):
    """``tok`` made to add exactly one BOS (its own, else its first special token), so that speed.py's
    ``len(tokenizer(text).input_ids) - 1`` is the text's token count; unchanged when it already does."""
    if added_tokens(tok) == 1:
        return tok
    from tokenizers.processors import TemplateProcessing

    bos = tok.bos_token or tok.eos_token or (tok.all_special_tokens or [None])[0]
    backend = getattr(tok, "backend_tokenizer", None)
    if bos is None or backend is None:
        raise SpecbenchError(f"the tokenizer adds {added_tokens(tok)} special tokens and has no BOS to make it add "
                             "one, so Spec-Bench's speed.py would miscount the baseline; pass --tokenizer with one")
    bos_id = tok.convert_tokens_to_ids(bos)
    backend.post_processor = TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1",
                                                special_tokens=[(bos, bos_id)])
    return tok


def speed_py_count(tok, text: str) -> int:
    """The token count Spec-Bench's speed.py gives one baseline turn: re-tokenized, minus one BOS."""
    return len(tok(text).input_ids) - 1


def check_recount(records: Sequence[GenerationRecord], tok, decode: Callable[[list[int]], str]) -> None:
    """Warn (one line) when speed.py's recount of some vanilla turns will differ from their true count."""
    base = [r for r in records if r.method == BASELINE]
    off = [(speed_py_count(tok, decode(r.new_tokens)) - r.num_new) for r in base]
    wrong = [d for d in off if d]
    if wrong:
        true = sum(r.num_new for r in base)
        warnings.warn(f"{len(wrong)} of {len(base)} vanilla turns do not re-tokenize to their token count (a "
                      f"non-canonical tokenization), so speed.py's baseline count will be {sum(off):+d} tokens off "
                      f"the true {true}; the exported new_tokens are the true counts", stacklevel=2)


# ---- the export -----------------------------------------------------------------------------------
def export_spec_bench(results: str | Path, out_dir: str | Path | None = None, tokenizer: str | None = None,
                      data_dir: str | None = None, overwrite: bool = False) -> list[Path]:
    """Write one Spec-Bench answer file per method label of RESULTS (and the counting tokenizer); returns
    the answer files' paths."""
    from specbench.analysis.report import read_result_file

    path = Path(results)
    if not path.is_file():
        raise SpecbenchError(f"results file {path} does not exist")
    result = read_result_file(path)
    if not result.records:
        raise SpecbenchError(f"{path} has no records; run `specbench run ...` first")
    categories = question_categories(result.meta, result.records, path, data_dir or result.meta.get("data_dir"))
    target = str(result.meta.get("target", ""))
    tok = counting_tokenizer(load_tokenizer(tokenizer or target))
    decode = exact_text(tok)
    model_id = Path(target.rstrip("/")).name.replace(".gguf", "") or "model"
    temperature = float(result.meta.get("temperature", result.records[0].temperature))
    out = Path(out_dir) if out_dir else path.parent / f"{path.stem}_spec-bench"
    labels = sorted({r.method for r in result.records})
    files = {label: out / f"{model_id}-{label.replace('/', '_')}-temperature-{temperature:g}.jsonl" for label in labels}
    check_output(out, what="export --out", folder_ok=True)
    for file in files.values():  # the results file itself, a device, a FIFO or a symlink is never written
        check_output(file, [("RESULTS", path)], what="answer file")
    existing = [str(f) for f in files.values() if f.exists()]
    if existing and not overwrite:
        raise SpecbenchError(f"{existing[0]} already exists; pass --overwrite to replace the answer files")
    check_recount(result.records, tok, decode)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out / TOKENIZER_DIR)
    stamp = path.stat().st_mtime
    for label, file in files.items():
        rows = answer_rows([r for r in result.records if r.method == label], categories, f"{model_id}-{label}",
                           decode, stamp)
        with atomic_text(file, "answer file") as fh:  # whole or not at all; an old file stays until then
            fh.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return list(files.values())
