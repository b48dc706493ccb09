"""Fuzz the command line: random and adversarial values for every option of every command (read
from the Typer app, so new options are fuzzed too) and every registered method's ``--opt`` keys.
Every invocation must end with exit 0, or exit 2 and exactly one line on stderr, or reach the model
loader (validation passed; the loader is replaced by a sentinel, so no model is ever loaded).
Seeded (derandomize), so CI runs the same examples every time; failures it found live on as plain
tests in test_cli_regressions.py."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import typing
from collections import Counter
from pathlib import Path
from typing import Literal

import typer.main
from hypothesis import HealthCheck, given, settings, strategies as st

from specbench import options
from specbench.cli import app
from specbench.engine.registry import available_methods, method_class
from specbench.engine.target import Target
from test_cli import cli

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
