"""Fuzz the command line: random and adversarial values for every option of every command (read
from the Typer app, so new options are fuzzed too) and every registered method's ``--opt`` keys.
Every invocation must end with exit 0, or exit 2 and exactly one line on stderr, or reach the model
loader (validation passed; the loader is replaced by a sentinel, so no model is ever loaded).
Seeded (derandomize), so CI runs the same examples every time; failures it found live on as plain
tests in test_cli_regressions.py."""

from __future__ import annotations

import codecs
import dataclasses
import inspect
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import typing
from collections import Counter
from pathlib import Path
from typing import Literal

import pytest
import torch
import typer.main
from hypothesis import HealthCheck, given, settings, strategies as st

from bench_data import needs_data
from specbench import options
from specbench.cli import app
from specbench.engine.registry import available_methods, method_class
from specbench.engine.target import Target
from test_cli import REPO, base_args, cli, read

EXAMPLES = 600


class LoadReached(BaseException):
    """Raised instead of loading a model: every check before the load passed."""


def _leaf_commands():
    def walk(cmd, path):
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                yield from walk(sub, path + (name,))
        else:
            yield path, cmd

    return list(walk(typer.main.get_command(app), ()))


COMMANDS = _leaf_commands()
METHODS = sorted(available_methods())
OPTION_FIELDS = {m: {f.name: str(f.type) for f in dataclasses.fields(method_class(m).Options)} for m in METHODS}


def _declared_values(option) -> list[str]:
    """Values at and just past an option's declared range, and its Literal choices (and a near miss)."""
    element = option.element
    if typing.get_origin(element) is Literal:
        return [*map(str, typing.get_args(element)), str(typing.get_args(element)[0]).upper()]
    edges = [bound for bound in (option.ge, option.gt, option.le, option.lt) if bound is not None]
    if option.tokens:
        edges.append(options.LONGEST_CONTEXT)
    step = 1 if element is int else 1e-9
    return [str(v) for edge in edges for v in (edge - step, edge, edge + step)]


DECLARED = {m: {d.name: _declared_values(d) for d in options.declared(method_class(m).Options)} for m in METHODS}


def _kind(cmd, param) -> str:
    """int, float, bool, path, list or str, from the command function's annotation."""
    if getattr(param, "is_flag", False):
        return "bool"
    annotation = str(inspect.signature(cmd.callback).parameters[param.name].annotation)
    for kind in ("list", "int", "float", "Path"):
        if kind in annotation:
            return kind.lower()
    return "str"


def _text(max_size=12):
    # argv cannot carry NUL; bytes that are not UTF-8 arrive as lone surrogates (U+DC80..U+DCFF), only those
    undecodable = st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF)
    text = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
    return st.text(st.one_of(text, text, text, undecodable), max_size=max_size)


def _paths(tmp: Path) -> dict[str, str]:
    (tmp / "folder").mkdir(exist_ok=True)
    (tmp / "garbage.jsonl").write_bytes(b"\xff\xfe not json {\n[1,2\n")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "bad.yaml").write_text("gamma: [1, 2\n  : :\n")
    (tmp / "bad.json").write_text('{"gamma": 3,,}')
    (tmp / "list.yaml").write_text("- 1\n- 2\n")
    (tmp / "ok.yaml").write_text("gamma: 3\n")
    locked = tmp / "locked.jsonl"
    locked.write_text('{"id": "a", "turns": ["hi"]}\n')
    locked.chmod(0)
    (tmp / "prompts.jsonl").write_text('{"id": "p0", "turns": ["Tell me a story."]}\n')
    (tmp / "folder.jsonl").mkdir(exist_ok=True)  # a folder that looks like a prompt or results file
    (tmp / "r\udce9.jsonl").write_text("")  # a name whose bytes are not UTF-8 (b"r\xe9.jsonl")
    if not (tmp / "fifo.jsonl").exists():
        os.mkfifo(tmp / "fifo.jsonl")  # only ever given as --bench (DOMAIN): a reader that opened it would wait
    return {"prompts": str(tmp / "prompts.jsonl"), "missing": str(tmp / "no" / "such" / "file.jsonl"), "folder": str(tmp / "folder"),
            "garbage": str(tmp / "garbage.jsonl"), "empty": str(tmp / "empty.jsonl"), "bad_yaml": str(tmp / "bad.yaml"),
            "bad_json": str(tmp / "bad.json"), "list_yaml": str(tmp / "list.yaml"), "ok_yaml": str(tmp / "ok.yaml"),
            "locked": str(locked), "unreadable": "/proc/self/mem", "proc": "/proc/forbidden/out.jsonl",
            "folder_jsonl": str(tmp / "folder.jsonl"), "undecodable_name": str(tmp / "r\udce9.jsonl")}



ADVERSARIAL = ["", " ", "-1", "0", "-0", "1e309", "-1e309", "nan", "NaN", "inf", "-inf", "9" * 40, "-" + "9" * 40,
               "0x10", "1_000", "3.5", "[/]", "[bold]x", "a\nb", "💥", "ünïcødé", "--", "-", "a=b", "=", "key=", "=value", "~", "..", "a" * 300,
               "caf\udce9", "\udcff.jsonl", "sps=caf\udce9"]  # the last three: argv bytes that are not UTF-8
DOMAIN = {  # plausible values, so examples also get past the first check
    "method": METHODS + ["spss", "vanila", ""], "bench": ["humaneval", "mt_bench", "gsm8k", "mixed", "math500+alpaca",
                                                          "humanevl", "a+"],
    "device": ["cpu", "cuda", "cuda:1", "tpu", "mps", "meta", "cpu:0"], "dtype": ["float32", "bfloat16", "float16", "int8"],
    "attn": ["sdpa", "eager", "flash_attention_2"], "baseline": ["vanilla", "none", "sps"],
    "on_long_prompt": ["skip", "fail", "ignore"], "category": ["de-en", "coding", "nope"],
    "variant": ["full", "no-shift", "no-broadcast", "no-valid-prefix", "no"], "normalise": ["slot", "block", "x"],
    "layers": ["0,1", "0,29", "a,b", "99", "-1"], "target_layer_ids": ["1,2", "x", "-3"],
    "target": ["smollm2-135m", "/nonexistent/model", "x.gguf", "org/name/extra"],
    "sweep": ["budget=16,32", "gamma=", "=1,2", "budget", "gamma=1,x"],
    "drafter": ["nosuch=/x", "sps=/no/such/dir", "spss=/x", "=x", "sps", "sps=caf\udce9"],
    "preset": ["dvi-table2", "specblock-table1", "nosuch", ""], "all_methods": [],
}


@st.composite
def values(draw, kind: str, name: str, paths: dict[str, str]):
    choices = [st.sampled_from(ADVERSARIAL), _text(), st.sampled_from(list(paths.values()))]
    if name in DOMAIN:
        choices += [st.sampled_from(DOMAIN[name])] * 3
    if kind == "int":
        choices += [st.integers(-2**70, 2**70).map(str), st.integers(-3, 64).map(str)] * 2
    elif kind == "float":
        choices += [st.floats(allow_nan=True, allow_infinity=True).map(repr), st.floats(-2, 2).map(repr)] * 2
    elif kind == "path":
        choices += [st.sampled_from(list(paths.values()))] * 3
    return draw(st.one_of(choices))


@st.composite
def method_opt(draw, method: str, paths: dict[str, str]):
    fields = OPTION_FIELDS.get(method, {})
    key = draw(st.sampled_from(sorted(fields) + ["gama", "", "top-k"])) if fields else draw(_text(6))
    kind = fields.get(key, "str")
    kind = "float" if "float" in kind else "int" if "int" in kind and "list" not in kind else "str"
    edges = DECLARED.get(method, {}).get(key)
    value = draw(st.sampled_from(edges)) if edges and draw(st.booleans()) else draw(values(kind, key, paths))
    return f"{key}={value}"


def _param_args(draw, cmd, param, method, paths, tmp) -> list[str]:
    """argv for one option (or the positional arguments) with a drawn, often hostile, value."""
    kind = _kind(cmd, param)
    if param.param_type_name == "argument":  # report's result files
        return draw(st.lists(st.one_of(st.sampled_from(list(paths.values())), _text()), max_size=3))
    flag = param.opts[0]
    if kind == "bool":
        return [draw(st.sampled_from([flag, *param.secondary_opts]))] if param.secondary_opts else [flag]
    if param.name == "method":
        return [flag, draw(st.sampled_from(DOMAIN["method"]))]
    if param.name in ("out", "out_dir") and draw(st.booleans()):
        return [flag, str(tmp / f"out{draw(st.integers(0, 3))}" / "r.jsonl")]
    if param.name == "opt":
        args = []
        for _ in range(draw(st.integers(1, 3))):
            args += [flag, draw(method_opt(method or draw(st.sampled_from(METHODS)), paths))]
        return args
    if param.name == "bench" and draw(st.integers(0, 5)) == 0:  # a FIFO, a folder: say what it is, never wait on it
        return [flag, draw(st.sampled_from([str(tmp / "fifo.jsonl"), paths["folder"], paths["folder_jsonl"]]))]
    if param.name == "also":
        name = draw(st.sampled_from(METHODS + ["nope"]))
        return [flag, "@".join([name, *draw(st.lists(method_opt(name, paths), max_size=2))])]
    return [flag, draw(values(kind, param.name, paths))]


def _valid_base(path, method, paths, tmp) -> list[str]:
    """A command line that passes every check, to be spoiled by one or two drawn options."""
    if path == ("run",):
        return ["--method", method, "--bench", "humaneval", "--limit", "1", "--out", str(tmp / "base" / "r.jsonl")]
    if path[0] == "train":
        return ["--prompts", paths["prompts"]] + (["--out", str(tmp / "train")] if path[1] != "data" else [])
    return []


@st.composite
def invocation(draw, paths: dict[str, str], tmp: Path):
    path, cmd = draw(st.sampled_from(COMMANDS))
    argv = list(path)
    method = draw(st.sampled_from(METHODS))
    if cmd.params and draw(st.booleans()):  # one valid command line with one or two options spoiled
        argv += _valid_base(path, method, paths, tmp)
        for param in draw(st.lists(st.sampled_from(cmd.params), min_size=1, max_size=2, unique_by=lambda p: p.name)):
            argv += _param_args(draw, cmd, param, method, paths, tmp)
        return argv
    for param in cmd.params:  # anything goes
        required = param.required and draw(st.integers(0, 19)) > 0  # now and then leave a required one out
        if not required and draw(st.integers(0, 3)) > 0:
            continue
        argv += _param_args(draw, cmd, param, method, paths, tmp)
    return argv


STATS = {"examples": 0, "outcomes": Counter(), "messages": set(), "tracebacks": 0}


def _message_shape(line: str) -> str:
    """An error message with its quoted and numeric parts blanked, to count distinct messages."""
    line = re.sub(r"'[^']*'|\"[^\"]*\"|`[^`]*`|\S*/\S*", "_", line)
    return re.sub(r"-?\d[\d.e+-]*", "N", line)


def test_cli_fuzz(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    def refuse_load(*args, **kwargs):
        raise LoadReached()

    monkeypatch.setattr(Target, "load", classmethod(refuse_load))
    paths = _paths(tmp_path)
    failures = []

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(invocation(paths, tmp_path))
    def one(argv):
        STATS["examples"] += 1
        try:
            code, _, err = cli(argv, capsys)
        except LoadReached:
            capsys.readouterr()
            STATS["outcomes"]["validated, reached the model load"] += 1
            return
        except Exception as exc:  # noqa: BLE001 - the failure being hunted
            capsys.readouterr()
            STATS["tracebacks"] += 1
            failures.append((argv, f"{type(exc).__name__}: {exc}"[:300]))
            return
        lines = err.strip().splitlines()
        STATS["outcomes"][f"exit {code}"] += 1
        if code == 2 and len(lines) == 1 and "Traceback" not in err:
            STATS["messages"].add(_message_shape(lines[0]))
        elif code != 0 or "Traceback" in err:
            failures.append((argv, f"exit {code}, stderr: {err[-300:]!r}"))

    one()
    summary = {"examples": STATS["examples"], "outcomes": dict(STATS["outcomes"]),
               "distinct_error_messages": len(STATS["messages"]), "tracebacks": STATS["tracebacks"],
               "failures": len(failures)}
    with capsys.disabled():
        print(f"\nCLI fuzz summary: {json.dumps(summary)}")
    if os.environ.get("SPECBENCH_FUZZ_SUMMARY"):
        Path(os.environ["SPECBENCH_FUZZ_SUMMARY"]).write_text(json.dumps(summary, indent=2) + "\n")
    assert STATS["examples"] >= 500
    assert not failures, "\n".join(f"{argv}: {why}" for argv, why in failures[:20])


# ------------------------------------------------------------------------------------------------------
# File contents and paths: the same promise for what the files hold and where the output goes. Prompt,
# config and results files with drawn field types, encodings, nesting, lone surrogates and duplicate ids;
# outputs that alias an input (the very file, a hard link, a symlink), a device, a FIFO or a folder; and a
# second writer holding the results file. Each example must end as above AND leave every input file
# byte-identical, with no temporary, lock or .merging file behind.

FILE_EXAMPLES = int(os.environ.get("SPECBENCH_FILE_FUZZ", "300"))
FILE_STATS = {"examples": 0, "classes": Counter(), "kinds": Counter(), "outcomes": Counter(), "failures": 0}

JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                        st.text(max_size=8), st.sampled_from(["\ud800", "a\udfffb", "", " "]))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                               st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                           max_leaves=8)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@st.composite
def prompt_line(draw) -> str:
    """One prompt-file line: mostly well formed, with one field drawn from anything JSON can hold."""
    row = {"id": draw(st.one_of(st.sampled_from(["a", "b", 1, "1", 2]), JSON_LEAVES)),
           "turns": draw(st.one_of(st.lists(st.sampled_from(["Say hi.", "Count.", "x"]), min_size=1, max_size=2),
                                   JSON_VALUES))}
    for key in draw(st.lists(st.sampled_from(["reference", "meta", "category", "turns", "id"]), max_size=2)):
        row[key] = draw(JSON_VALUES)
    text = json.dumps(row, ensure_ascii=True)  # surrogates as \ud800 escapes, as a hostile file holds them
    if draw(st.integers(0, 9)) == 0:
        text = text[:-1] + f', "deep": {_nested(draw(st.sampled_from([40, 3000])))}}}'
    return text


@st.composite
def prompt_file_bytes(draw) -> tuple[bytes, str]:
    lines = draw(st.lists(prompt_line(), min_size=1, max_size=4))
    if draw(st.booleans()):  # a duplicate id, the classic silent loss
        lines.append(lines[0])
    text = "\n".join(lines) + "\n"
    encoding = draw(st.sampled_from(["utf-8"] * 6 + ["utf-16", "utf-8-sig", "latin-1", "cp1252"]))
    try:
        return text.encode(encoding), f"prompts/{encoding}"
    except UnicodeEncodeError:
        return text.encode("utf-8"), "prompts/utf-8"


@st.composite
def config_bytes(draw) -> tuple[bytes, str]:
    kind = draw(st.sampled_from(["json", "yaml", "deep"]))
    if kind == "deep":
        return _nested(draw(st.sampled_from([40, 5000]))).encode(), "config/deep"
    options = draw(st.dictionaries(st.sampled_from(["gamma", "draft", "x", ""]), JSON_VALUES, max_size=3))
    if kind == "json":
        return json.dumps(options).encode(), "config/json"
    import yaml

    return yaml.safe_dump(options, allow_unicode=False).encode("utf-8", "surrogatepass"), "config/yaml"


def _record(pid: str, method: str) -> dict:
    return {"type": "record", "method": method, "new_tokens": [1, 2, 3], "prompt_tokens": 5, "stop_reason": "length",
            "times": {"prefill": 0.1, "draft": 0.0, "verify": 0.2, "commit": 0.0}, "n_verify": 2,
            "accept_lengths": [0, 1], "tree_sizes": [1, 1], "depth_attempts": [2], "depth_accepts": [1],
            "bench": "p", "prompt_id": pid, "turn": 0, "seed": 0, "temperature": 0.0}


@st.composite
def results_bytes(draw) -> tuple[bytes, str]:
    """A small results file, then one damage: a field of a drawn type, a line twice, a second header,
    a cut tail."""
    header = {"type": "header", "meta": {"config_hash": "abc", "target": "smollm2-135m", "temperature": 0.0,
                                         "bench": "p", "stream": ["a", "b"], "stream_turns": [1, 1],
                                         "sides": ["sps", "vanilla"]}}
    lines = [header] + [_record(pid, m) for pid in ("a", "b") for m in ("sps", "vanilla")]
    damage = draw(st.sampled_from(["field", "field", "twice", "header twice", "cut", "none", "drop key"]))
    if damage == "drop key":  # a record without a field that names it (method, bench, prompt_id, turn)
        del lines[draw(st.integers(1, len(lines) - 1))][draw(st.sampled_from(["method", "bench", "prompt_id", "turn"]))]
    if damage == "field":
        line = draw(st.integers(0, len(lines) - 1))
        target = lines[line]["meta"] if line == 0 else lines[line]
        target[draw(st.sampled_from(sorted(target)))] = draw(JSON_VALUES)
    texts = [json.dumps(x, ensure_ascii=True) for x in lines]
    if damage == "twice":
        texts.append(texts[draw(st.integers(1, len(texts) - 1))])
    elif damage == "header twice":
        texts += texts
    data = ("\n".join(texts) + "\n").encode()
    if damage == "cut":
        data = data[: draw(st.integers(1, len(data) - 1))]
    return data, f"results/{damage}"


def _file_invocation(draw, tmp: Path, models_dir: str) -> tuple[list[str], list[Path], str]:
    """(argv, the input files that must stay byte-identical, the class of the example)."""
    case = draw(st.sampled_from(["prompts", "config", "results", "alias", "alias", "writer"]))
    prompts, config, results = tmp / "in" / "p.jsonl", tmp / "in" / "cfg.json", tmp / "in" / "r.jsonl"
    prompts.write_text('{"id": "a", "turns": ["Say hi."]}\n{"id": "b", "turns": ["Count."]}\n')
    config.write_text('{"gamma": 3}')
    results.write_bytes(draw(results_bytes())[0])
    out = tmp / "out" / "r.jsonl"
    label = case
    if case == "prompts":
        data, label = draw(prompt_file_bytes())
        prompts.write_bytes(data)
    elif case == "config":
        data, label = draw(config_bytes())
        config = config.with_suffix(".yaml" if label.endswith("yaml") else ".json")
        config.write_bytes(data)
    elif case == "results":
        data, label = draw(results_bytes())
        results.write_bytes(data)
        command = draw(st.sampled_from(["report", "merge", "export", "resume"]))
        label = f"{label} ({command})"
        if command == "report":
            return ["report", str(results), "--out-dir", str(tmp / "out" / "rep")], [results], label
        if command == "merge":
            return ["merge", str(results), "--out", str(out)], [results], label
        if command == "export":
            return ["export", str(results), "--out", str(tmp / "out" / "sb"), "--tokenizer", "/nonexistent"], \
                [results], label
        out = results
    elif case == "alias":
        kind = draw(st.sampled_from(["prompts", "config", "hard link", "symlink", "dangling symlink", "fifo",
                                     "/dev/null", "folder", "export over prompts", "merge into folder"]))
        label = f"alias/{kind}"
        out.parent.mkdir(exist_ok=True)
        if kind == "prompts":
            out = prompts
        elif kind == "config":
            out = config
        elif kind == "hard link":
            os.link(prompts, out)
        elif kind in ("symlink", "dangling symlink"):
            out.symlink_to(prompts if kind == "symlink" else tmp / "nowhere")
        elif kind == "fifo":
            os.mkfifo(out)
        elif kind == "/dev/null":
            out = Path("/dev/null")
        elif kind == "folder":
            out.mkdir()
        elif kind == "export over prompts":
            return ["train", "data", "--prompts", str(prompts), "--export", str(prompts)], [prompts, config], label
        else:
            out.mkdir()
            return ["merge", str(results), "--out", str(out)], [prompts, config, results], label
    argv = ["run", "--method", "sps", "--bench", str(prompts), "--target", models_dir, "--limit", "2",
            "--opt", "draft=truncated:1", "--config", str(config), "--out", str(out), "--no-warmup"]
    flags = ["--resume"] if case == "results" else draw(st.sampled_from([[], ["--overwrite"], ["--resume"],
                                                                         ["--resume", "--overwrite"]]))
    argv += flags
    if len(flags) == 2:
        label += " (--resume --overwrite)"
    if case == "writer":
        label = "concurrent writer"
    return argv, [prompts, config, results], label


def test_file_fuzz(tmp_path, capsys, monkeypatch, models):
    """Drawn file contents and output paths: one line + exit 2, or exit 0, or the model load reached;
    every input byte-identical afterwards; no strays; a held results file refused naming its holder."""
    import shutil

    from specbench.data.safe_files import WriterLock

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(Target, "load", classmethod(lambda cls, *a, **k: (_ for _ in ()).throw(LoadReached())))
    failures = []

    @settings(max_examples=FILE_EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one(data):
        work = tmp_path / "case"
        shutil.rmtree(work, ignore_errors=True)
        (work / "in").mkdir(parents=True)
        (work / "out").mkdir()
        argv, inputs, label = _file_invocation(data.draw, work, models["target"])
        before = {p: p.read_bytes() for p in inputs if p.is_file()}
        held = WriterLock(Path(argv[argv.index("--out") + 1])) if label == "concurrent writer" else None
        FILE_STATS["examples"] += 1
        FILE_STATS["classes"][label.split(" (")[0].split("/")[0]] += 1
        FILE_STATS["kinds"][label] += 1
        try:
            code, _, err = cli(argv, capsys)
        except LoadReached:
            capsys.readouterr()
            code, err = None, ""
        except Exception as exc:  # noqa: BLE001 - the failure being hunted
            capsys.readouterr()
            failures.append((label, argv, f"{type(exc).__name__}: {exc}"[:300]))
            return
        finally:
            if held is not None:
                held.release()
        lines = [x for x in err.strip().splitlines() if "it/s]" not in x]
        outcome = "reached the model load" if code is None else f"exit {code}"
        FILE_STATS["outcomes"][outcome] += 1
        if code not in (None, 0) and not (code == 2 and len(lines) == 1 and "Traceback" not in err):
            failures.append((label, argv, f"exit {code}, stderr: {err[-300:]!r}"))
        # These must be refused, and before any model loads: the output is an input, a device, a FIFO, a
        # symlink or a folder; the results file holds a line twice; another writer holds the file.
        must_refuse = label.startswith(("alias/", "results/twice", "results/header twice", "concurrent writer"))
        must_refuse |= label.endswith("(--resume --overwrite)")  # a declared conflict
        must_refuse |= label.startswith("results/drop key") and not label.endswith("(export)")  # schemas everywhere
        if must_refuse and code != 2:
            failures.append((label, argv, f"not refused ({outcome})"))
        changed = [str(p) for p, data in before.items() if not p.is_file() or p.read_bytes() != data]
        strays = [str(p) for p in work.rglob("*") if p.name.endswith((".tmp", ".lock", ".merging"))]
        if changed or strays:
            failures.append((label, argv, f"changed {changed}, strays {strays}"))

    one()
    FILE_STATS["failures"] = len(failures)
    summary = {"examples": FILE_STATS["examples"], "classes": dict(FILE_STATS["classes"]),
               "kinds": dict(sorted(FILE_STATS["kinds"].items())), "outcomes": dict(FILE_STATS["outcomes"]),
               "failures": len(failures)}
    with capsys.disabled():
        print(f"\nfile fuzz summary: {json.dumps(summary)}")
    if os.environ.get("SPECBENCH_FUZZ_SUMMARY"):
        path = Path(os.environ["SPECBENCH_FUZZ_SUMMARY"])
        path.with_name(path.stem + "_files" + path.suffix).write_text(json.dumps(summary, indent=2) + "\n")
    assert FILE_STATS["examples"] >= 0.8 * FILE_EXAMPLES
    assert not failures, "\n".join(f"{label}: {argv}: {why}" for label, argv, why in failures[:20])


# ------------------------------------------------------------------------------------------------------
# Issue 70, the run/recheck side: hostile inputs the drawn examples above do not reach (they need a valid file
# around them, an explicit default, a real run). Each ends in one line and exit 2 with nothing written, or is
# accepted where accepting is right.

@pytest.fixture
def no_loads(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(Target, "load", classmethod(refuse))


def one_error(args, capsys, *needles) -> str:
    """The command's one error line (exit 2; progress bars of a model load may stand above it)."""
    code, _, err = cli(args, capsys)
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def only_line(args, capsys, *needles) -> str:
    """As ``one_error``, refused before anything loads: the error line is all of stderr."""
    code, _, err = cli(args, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def prompt_file(path: Path, categories: list | None = None, n: int = 3) -> Path:
    rows = [{"id": f"q{i}", "turns": [f"Say {i}."], **({"meta": {"category": categories[i]}} if categories else {})}
            for i in range(len(categories) if categories else n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def no_run_files(folder: Path) -> list[str]:
    """What a refused run left in ``folder``: results files, temporaries, locks (none, or the test's inputs)."""
    return sorted(p.name for p in folder.rglob("*") if p.suffix in (".jsonl", ".tmp", ".lock") or "part-" in p.name)


def fp32_results(path: Path, flips: bool = False) -> Path:
    header = {"type": "header", "meta": {"config_hash": "abc", "target": "smollm2-135m", "temperature": 0.0,
                                         "dtype": "float32", "bench": "p", "stream": ["a"], "stream_turns": [1],
                                         "sides": ["sps", "vanilla"]}}
    method = _record("a", "sps")
    if flips:
        method["divergence"] = {"status": "unexplained", "position": 1, "method_token": 2, "vanilla_token": 3,
                                "method_margin": 1.0, "vanilla_margin": 1.0}
    path.write_text("\n".join(json.dumps(x) for x in [header, method, _record("a", "vanilla")]) + "\n")
    return path


# ---- 1: recheck checks --device and --data-dir as run does, before reading any file
@pytest.mark.parametrize("flags,needle", [
    (["--device", "bogus"], "unknown device 'bogus'; use auto, cpu, cuda or cuda:N"),
    (["--data-dir", "/nonexistent"], "--data-dir /nonexistent is not a folder"),
    pytest.param(["--device", "cuda"], "CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
])
def test_recheck_refuses_a_bad_device_or_data_dir_as_run_does(tmp_path, capsys, no_loads, flags, needle):
    results = fp32_results(tmp_path / "r.jsonl")  # no flip to re-score: recheck used to exit 0 past the flags
    before = results.read_bytes()
    line = only_line(["recheck", str(results), *flags], capsys, needle)
    assert line == only_line(["run", "--method", "sps", "--bench", "humaneval", *flags], capsys)  # run's own words
    assert results.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


# ---- 9: recheck words the case of no flips truthfully
def test_recheck_of_a_file_without_flips_says_there_are_none(tmp_path, capsys, no_loads):
    code, out, err = cli(["recheck", str(fp32_results(tmp_path / "none.jsonl"))], capsys)
    assert code == 0, err
    assert "float32: the bound stands (no flips to judge)" in out and "every flip" not in out
    code, out, err = cli(["recheck", str(fp32_results(tmp_path / "one.jsonl", flips=True))], capsys)
    assert code == 0 and "float32: the bound stands (every flip exceeds it)" in out, err


# ---- 13: a flag given explicitly reaches a preset, at its default value too
@needs_data
def test_an_explicit_flag_at_its_default_overrides_the_preset(tmp_path, capsys, no_loads):
    code, out, err = cli(["run", "--preset", "specblock-table1", "--target", "Qwen/Qwen3-8B", "--temperature", "0",
                          "--dry-run", "--out", str(tmp_path / "r")], capsys)
    assert code == 0, err
    assert "temperatures: 0  [--temperature, in place of the preset's 0, 1]" in out
    runs = [line for line in out.splitlines() if line.startswith("  ") and ".jsonl  (" in line]
    assert runs and all(", T=0" in line for line in runs)  # the preset's T = 1 runs are gone
    code, out, err = cli(["run", "--preset", "dvi-table2", "--target", "lmsys/vicuna-7b-v1.3", "--max-new-tokens",
                          "128", "--dry-run", "--out", str(tmp_path / "r")], capsys)
    assert code == 0 and "max new tokens: 128" in out, err  # run's default, given: not the preset's 1024
    only_line(["run", "--preset", "dvi-table2", "--target", "x", "--warmup"], capsys, "it does not take --warmup")
    assert not (tmp_path / "r").exists()


# ---- 2: a stream names each bench once
def test_a_stream_naming_a_bench_twice_is_refused(tmp_path, capsys, no_loads):
    only_line(["run", "--method", "sps", "--bench", "gsm8k+gsm8k", "--out", str(tmp_path / "r.jsonl")], capsys,
              "mixed stream 'gsm8k+gsm8k' names gsm8k twice; name each bench once")
    assert not any(tmp_path.iterdir())


# ---- 5: --sample no larger than the prompts there are (after --category)
@pytest.mark.parametrize("extra,needle", [
    (["--sample", "50"], "--sample 50 asks for more prompts than the 3 of bench 'p'; pass --sample 3 or fewer"),
    (["--sample", "100000"], "than the 3 of bench 'p'"),
    (["--sample", "3", "--category", "a"], "--sample 3 asks for more prompts than the 2 of bench 'p' in category 'a'"),
])
def test_a_sample_larger_than_the_prompts_is_refused(tmp_path, capsys, no_loads, extra, needle):
    prompts = prompt_file(tmp_path / "p.jsonl", ["a", ["a"], "b"])
    args = ["run", "--method", "sps", "--bench", str(prompts), "--out", str(tmp_path / "r.jsonl")]
    only_line(args + extra, capsys, needle)
    assert no_run_files(tmp_path) == ["p.jsonl"]
    with pytest.raises(AssertionError, match="a model was loaded"):  # all there are: accepted
        cli(args + ["--sample", "3"], capsys)


# ---- 15: --drafter names a method with weights, and a folder that exists, already at --dry-run
def test_a_drafter_without_weights_or_folder_is_refused_at_dry_run(tmp_path, capsys, no_loads):
    folder = tmp_path / "drafter"
    folder.mkdir()
    base = ["reproduce", "dvi-table2", "--target", "lmsys/vicuna-7b-v1.3", "--dry-run", "--out-dir", str(tmp_path / "r")]
    only_line(base + ["--drafter", f"vanilla={folder}"], capsys, f"--drafter vanilla={folder}: vanilla loads no drafter "
                                                                  "weights; drop it")
    only_line(base + ["--drafter", "sps=missing-folder"], capsys, "--drafter sps missing-folder does not exist")
    only_line(base + ["--drafter", f"sps={tmp_path / 'gone'}"], capsys, "gone does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


# ---- 16: --resume of nothing
def test_resume_of_a_file_that_does_not_exist_is_refused(tmp_path, capsys, no_loads):
    out = tmp_path / "r.jsonl"
    only_line(["run", "--method", "sps", "--bench", str(prompt_file(tmp_path / "p.jsonl")), "--out", str(out),
               "--resume"], capsys, f"nothing to resume: {out} does not exist; drop --resume")
    assert no_run_files(tmp_path) == ["p.jsonl"]


@needs_data
def test_a_preset_resumes_the_files_it_has_and_starts_the_others(tmp_path, capsys, no_loads):
    from specbench.run.preset import build_plan

    out_dir = tmp_path / "r"
    only_line(["reproduce", "specblock-table1", "--target", "Qwen/Qwen3-8B", "--limit", "1", "--dry-run", "--resume",
               "--out-dir", str(out_dir)], capsys, "nothing to resume: none of preset specblock-table1's results files "
                                                   "exists in")
    planned = build_plan("specblock-table1", "Qwen/Qwen3-8B", limit=1, out_dir=out_dir).runs
    out_dir.mkdir()
    Path(planned[0].cfg.out).write_text('{"type": "header", "meta": {}}\n')
    runs = build_plan("specblock-table1", "Qwen/Qwen3-8B", limit=1, out_dir=out_dir, resume=True).runs
    assert [run.cfg.resume for run in runs] == [True] + [False] * (len(runs) - 1)


# ---- 17: sampling filters at T = 0
@pytest.mark.parametrize("extra,needle", [
    (["--top-k", "5"], "--top-k applies only when sampling, and --temperature 0 is greedy; drop --top-k"),
    (["--top-p", "0.9", "--temperature", "0"], "--top-p applies only when sampling"),
    (["--top-k", "5", "--top-p", "0.9"], "--top-k and --top-p apply only when sampling"),
])
def test_top_k_and_top_p_at_temperature_0_are_refused(tmp_path, capsys, no_loads, extra, needle):
    args = ["run", "--method", "sps", "--bench", str(prompt_file(tmp_path / "p.jsonl")), "--out",
            str(tmp_path / "r.jsonl")]
    only_line(args + extra, capsys, needle)
    assert no_run_files(tmp_path) == ["p.jsonl"]
    with pytest.raises(AssertionError, match="a model was loaded"):  # when sampling they apply: accepted
        cli(args + extra + ["--temperature", "1"], capsys)


# ---- 12: a resume with other options names them, with both values
def test_a_resume_with_other_options_names_each_option_that_differs(models, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert cli(base_args(models, out), capsys)[0] == 0
    before = out.read_bytes()
    line = one_error(base_args(models, out, "--resume", "--temperature", "0.7", "--max-new-tokens", "7"), capsys,
                     f"{out} was written by a different configuration (--temperature 0.0 then, 0.7 now; "
                     "--max-new-tokens 12 then, 7 now); rerun with the same options")
    assert "config " not in line  # no hashes
    one_error(base_args(models, out, "--resume", "--also", "pld"), capsys,
              "the sides (--method, --opt, --also, --sweep, --label) sps@draft=", "@gamma=3, pld now")
    assert out.read_bytes() == before


# ---- 3: the command printed after a stop under --overwrite resumes
def test_the_resume_command_printed_after_an_overwrite_works(models, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert cli(base_args(models, out), capsys)[0] == 0  # a file that --overwrite replaces
    old = out.stat().st_ino
    args = base_args(models, out, "--overwrite")
    args[args.index("--limit") + 1] = "6"
    args[args.index("--max-new-tokens") + 1] = "32"

    def stop_after_the_first_record() -> None:  # a real Ctrl-C, once the new file has taken the old one's place
        for _ in range(6000):
            if out.exists() and out.stat().st_ino != old:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.005)

    stopper = threading.Thread(target=stop_after_the_first_record)
    stopper.start()
    code, _, err = cli(args, capsys)
    stopper.join()
    last = err.strip().splitlines()[-1]
    assert code == 130 and last.startswith("interrupted (SIGINT; finished records kept in"), err
    resume = shlex.split(last.split("resume with: ", 1)[1])
    assert resume[0] == "specbench" and "--overwrite" not in resume and resume[-1] == "--resume"
    kept = [(r["method"], r["prompt_id"]) for r in read(out)[1:]]
    code, _, err = cli(resume[1:], capsys)  # fed back as printed: it continues the file
    assert code == 0, err
    keys = [(r["method"], r["prompt_id"]) for r in read(out)[1:]]
    assert keys[: len(kept)] == kept and len(keys) == len(set(keys)) == 12


# ---- 4: --on-long-prompt says what fits, skips each prompt once by name, and refuses a run of skips only
def long_prompts(path: Path, words: dict[str, int]) -> Path:
    path.write_text("".join(json.dumps({"id": pid, "turns": [("word " * n).strip() or "Say hi."]}) + "\n"
                            for pid, n in words.items()))
    return path


def test_a_prompt_too_long_for_any_max_new_tokens_says_so(models, tmp_path, capsys):
    args = base_args(models, tmp_path / "r.jsonl", "--on-long-prompt", "fail")
    args[args.index("humaneval")] = str(long_prompts(tmp_path / "p.jsonl", {"long": 600}))
    line = one_error(args, capsys, "prompt p/long alone is", "tokens (+ 128 tree slack) and the target's context is "
                     "512: no --max-new-tokens fits it; pass --on-long-prompt skip or a target with a longer context")
    assert "lower --max-new-tokens" not in line
    args[args.index("--max-new-tokens") + 1] = "200"
    args[args.index(str(tmp_path / "p.jsonl"))] = str(long_prompts(tmp_path / "q.jsonl", {"mid": 250}))
    one_error(args, capsys, "prompt q/mid needs", "pass --on-long-prompt skip or --max-new-tokens", "or less")
    assert no_run_files(tmp_path) == ["p.jsonl", "q.jsonl"]


def test_skipped_prompts_are_named_and_counted_once(models, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    args = base_args(models, out)
    args[args.index("humaneval")] = str(long_prompts(tmp_path / "p.jsonl", {"short": 0, "long": 600}))
    code, stdout, err = cli(args, capsys)
    assert code == 0, err
    skips = [line for line in err.splitlines() if line.startswith("skipped")]
    assert len(skips) == 2 and skips[0].startswith("skipped: prompt p/long alone is"), err  # two sides, one line
    assert skips[1] == "skipped 1 prompt(s) past the context window"
    assert "runner.py" not in err and "UserWarning" not in err  # the bench and prompt, not a source line
    assert sorted({r["prompt_id"] for r in read(out)[1:]}) == ["short"]


def test_a_run_whose_every_prompt_is_skipped_is_refused(models, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    args = base_args(models, out)
    args[args.index("humaneval")] = str(long_prompts(tmp_path / "p.jsonl", {"long": 600, "longer": 700}))
    one_error(args, capsys, "every prompt of p is past the target's context of 512 tokens (the shortest is",
              "nothing would be recorded; pick a target with a longer context")
    args[args.index(str(tmp_path / "p.jsonl"))] = str(long_prompts(tmp_path / "q.jsonl", {"mid": 250}))
    args[args.index("--max-new-tokens") + 1] = "200"
    one_error(args, capsys, "every prompt of q is past", "; pass --max-new-tokens", "or less")
    assert no_run_files(tmp_path) == ["p.jsonl", "q.jsonl"]


# ---- 7: an output this user may not replace is refused before the model loads
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to drop to another user")
def test_overwrite_of_another_users_file_in_a_sticky_folder_is_refused_before_loading(models, tmp_path):
    import shutil
    import tempfile

    shared = Path(tempfile.mkdtemp(dir="/tmp"))
    shared.chmod(0o1777)  # like /tmp: anyone writes, only a file's owner replaces it
    out = shared / "r.jsonl"
    out.write_text('{"type": "header", "meta": {}}\n')  # root's
    args = base_args(models, out, "--overwrite")
    args[args.index(models["target"])] = "smollm2-135m"  # every user can read it; refused before it loads
    args[args.index(f"draft={models['draft']}")] = "draft=truncated:1"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    try:
        done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                               "specbench.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        left = sorted(p.name for p in shared.iterdir())
        content = out.read_text()
    finally:
        shutil.rmtree(shared)
    if "sticky bit" not in done.stderr and "Permission denied" in done.stderr:
        pytest.skip("the unprivileged user cannot read the checkout, the venv or the prompts")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert f"cannot write results to {out} (it is another user's file in a folder with the sticky bit" in lines[0]
    assert ".tmp" not in lines[0] and left == ["r.jsonl"] and content == '{"type": "header", "meta": {}}\n'


# ---- 6: a damaged GGUF names the file and the option; a file that is no model says so
def test_a_file_that_is_no_model_is_named_so(tmp_path, capsys, no_loads):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model\n")
    base = ["run", "--method", "sps", "--bench", str(prompt_file(tmp_path / "p.jsonl")), "--out",
            str(tmp_path / "r.jsonl")]
    only_line(base + ["--target", str(notes)], capsys, f"--target {notes} is a file but not a model file; pass a .gguf "
                                                       "file, a Hugging Face model folder")
    assert no_run_files(tmp_path) == ["p.jsonl"]


def test_a_draft_file_that_is_no_model_is_named_so(models, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model\n")
    args = base_args(models, tmp_path / "r.jsonl")
    args[args.index(f"draft={models['draft']}")] = f"draft={notes}"
    one_error(args, capsys, f"sps draft {notes} is a file but not a model file")  # when the draft loads
    assert no_run_files(tmp_path) == []


def test_a_truncated_draft_gguf_is_one_line_naming_it(models, tmp_path, capsys):
    from specbench.engine.target import embedded_gguf

    whole = embedded_gguf("smollm2-135m").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])
    args = base_args(models, tmp_path / "r.jsonl")
    args[args.index(f"draft={models['draft']}")] = f"draft={cut}"
    one_error(args, capsys, f"model file {cut} is damaged or truncated", "download or `specbench fetch` it again, or "
                                                                          "pass another --opt draft")
    assert no_run_files(tmp_path) == []


# ---- 8: a byte-order mark at the start of a prompt or config file is no part of its first line
def test_a_byte_order_mark_is_accepted(tmp_path, capsys, no_loads):
    from specbench.data.benchmarks import load_benchmark
    from specbench.data.preset_files import _read_yaml, preset_files

    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(codecs.BOM_UTF8 + b'{"id": "a", "turns": ["Hi."]}\n')
    assert [p.id for p in load_benchmark(str(prompts))] == ["a"]
    config = tmp_path / "opts.json"
    config.write_bytes(codecs.BOM_UTF8 + b'{"gamma": 3}')
    with pytest.raises(AssertionError, match="a model was loaded"):  # both read: validation passes
        cli(["run", "--method", "sps", "--bench", str(prompts), "--config", str(config), "--out",
             str(tmp_path / "r.jsonl")], capsys)
    preset = tmp_path / "preset.yaml"
    preset.write_bytes(codecs.BOM_UTF8 + preset_files()["dvi-table2"].read_bytes())
    assert _read_yaml(preset)["name"] == "dvi-table2"


# ---- 11: every option's help shows whole, its brackets and parentheses paired
def paired(text: str) -> bool:
    stack = []
    for char in text:
        if char in "([":
            stack.append(char)
        elif char in ")]":
            if not stack or stack.pop() != {")": "(", "]": "["}[char]:
                return False
    return not stack


def test_every_options_help_shows_whole_with_its_brackets_paired():
    from rich.text import Text

    bad = []
    for path, cmd in COMMANDS:
        for param in cmd.params:
            raw = getattr(param, "help", None) or ""
            shown = Text.from_markup(raw).plain  # what the help screen prints (Typer reads help as Rich markup)
            if not paired(shown) or any(shown.count(c) != raw.count(c) for c in "[]()"):
                bad.append((" ".join(path), param.name, shown))
    assert not bad, bad
    top_p = next(p for p in dict(COMMANDS)[("run",)].params if p.name == "top_p")
    assert Text.from_markup(top_p.help).plain == "Top-p filter at T > 0 (1 = off). (0 < value <= 1)"


# ---- 14: a category given as a list is stored as its value(s), in the header and in the export
def test_a_list_category_is_stored_as_its_values(models, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    args = base_args(models, out, "--category", "a")
    args[args.index("--limit") + 1] = "3"
    args[args.index("humaneval")] = str(prompt_file(tmp_path / "p.jsonl", [["a"], "a", ["a", "b"], "b"]))
    assert cli(args, capsys)[0] == 0
    assert read(out)[0]["meta"]["prompt_categories"] == {"p": {"field": "category",
                                                              "values": {"q0": "a", "q1": "a", "q2": ["a", "b"]}}}
    code, _, err = cli(["export", str(out), "--out", str(tmp_path / "sb")], capsys)
    assert code == 0, err
    answers = {f.name: sorted(json.loads(line)["category"] for line in f.read_text().splitlines())
               for f in (tmp_path / "sb").glob("*.jsonl")}
    assert len(answers) == 2 and all(found == ["a", "a", "a, b"] for found in answers.values()), answers


# ---- the compiled engine's refusals (issue: a fast engine): one line, before any model loads
@pytest.mark.parametrize("extra, needle", [
    (["--batch-size", "2"], "--engine compiled decodes one request at a time"),
    (["--attn", "flash", "--device", "cpu"], "--attn"),
    (["--device-map", "auto"], "--engine compiled runs a target on one device"),
])
def test_the_compiled_engine_refuses_what_it_cannot_run(tmp_path, capsys, no_loads, extra, needle):
    only_line(["run", "--method", "sps", "--bench", "humaneval", "--engine", "compiled", *extra,
               "--out", str(tmp_path / "r.jsonl")], capsys, needle)
    assert not any(tmp_path.iterdir())
