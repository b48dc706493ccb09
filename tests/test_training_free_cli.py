"""The training-free methods from the command line: bad options are one line, exit 2, before any
model loads; on the embedded default target each gives vanilla's text (slow)."""

from __future__ import annotations

import json

import pytest

from methods.suffix import arctic_available
from specbench.engine.target import Target
from test_cli import cli


def run_args(method: str, *opts: str) -> list[str]:
    args = ["run", "--method", method, "--bench", "humaneval", "--limit", "1"]
    for opt in opts:
        args += ["--opt", opt]
    return args


@pytest.fixture
def no_model_loads(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(Target, "load", classmethod(refuse))


@pytest.mark.parametrize("args,needle", [
    (run_args("pld", "ngram=0"), "pld: option ngram must be >= 1"),
    (run_args("lookahead", "ngram=0"), "lookahead: option ngram must be >= 3"),
    (run_args("lookahead", "window=7", "ngram=5", "budget=20"), "needs 27 nodes"),
    (run_args("lookahead") + ["--budget", "16"], "within budget=16"),
    (run_args("suffix", "memory=0"), "suffix: option memory must be >= 1"),
    (run_args("pld", "gamma=0"), "pld: option gamma must be >= 1"),
])
def test_bad_options_one_line_exit_2_before_any_model(args, needle, no_model_loads, capsys):
    code, _, err = cli(args, capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err, err


@pytest.mark.slow
@pytest.mark.parametrize("method", ["pld", "suffix", "lookahead"])
def test_humaneval_on_the_default_target_gives_vanillas_text(method, tmp_path, capsys):
    if method == "suffix" and not arctic_available():
        pytest.skip("suffix needs arctic-inference (extra 'suffix')")
    out = tmp_path / f"{method}.jsonl"
    code, _, err = cli(["run", "--method", method, "--bench", "humaneval", "--limit", "1", "--max-new-tokens", "16",
                        "--out", str(out)], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    tokens = {r["method"]: r["new_tokens"] for r in records if "new_tokens" in r}
    assert set(tokens) == {method, "vanilla"} and len(tokens["vanilla"]) == 16
    assert tokens[method] == tokens["vanilla"]
