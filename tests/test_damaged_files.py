"""Damaged inputs end in one line (exit 2) that names the file and says what to do, and nothing is
written: drafter folders (truncated weights, config.json missing keys or for another target, a
corrupt vocab_mapping.pt), a malformed --config, a results file damaged in the middle or from
another run under --resume, a benchmark file with an empty prompt or no turns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from methods.eagle3.drafter import eagle3_taps
from methods.specblock.checkpoint import VOCAB_MAPPING, load_specblock, save_specblock
from methods.specblock.model import SpecBlockConfig, SpecBlockModel
from specbench.errors import SpecbenchError
from specbench.engine.target import Target
from test_cli import base_args, cli


@pytest.fixture(scope="module")
def specblock_folder(models, tmp_path_factory) -> Path:
    """A (random) SpecBlock drafter saved for the tiny 4-layer target."""
    target = Target.load(models["deep"], "float32")
    torch.manual_seed(0)
    model = SpecBlockModel(SpecBlockConfig.from_target(target, 64), eagle3_taps(target.num_layers),
                           target.model.get_input_embeddings())
    model.d2t.zero_()
    model.t2d[:64] = True
    folder = tmp_path_factory.mktemp("specblock") / "drafter"
    save_specblock(folder, model, target, {}, dtype=None)
    return folder


def run_specblock(models, folder: Path, out: Path, capsys):
    args = ["run", "--method", "specblock", "--bench", "humaneval", "--target", models["deep"], "--dtype", "float32",
            "--opt", f"path={folder}", "--opt", "budget=4", "--opt", "beam_width=2", "--max-new-tokens", "4",
            "--limit", "1", "--out", str(out), "--no-warmup", "--baseline", "none"]
    return cli(args, capsys)


def assert_one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and "it/s]" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err  # (transformers' loading bars aside)
    for needle in needles:
        assert needle in err, (needle, err)


def _truncate_weights(folder: Path) -> str:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return "model.safetensors is corrupt"


def _drop_config_key(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    del config["architecture"]
    (folder / "config.json").write_text(json.dumps(config))
    return "config.json lacks 'architecture'"


def _missing_architecture_field(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    del config["architecture"]["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    return "config.json has an architecture this version cannot build"


def _other_target(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    config["target"].update(name="Qwen/Qwen3-8B", hidden_size=4096)
    (folder / "config.json").write_text(json.dumps(config))
    return "was trained for target 'Qwen/Qwen3-8B'"


def _garbled_config(folder: Path) -> str:
    (folder / "config.json").write_text('{"method": "specblock", "architecture": {')
    return "config.json is corrupt"


@pytest.mark.parametrize("damage", [_truncate_weights, _drop_config_key, _missing_architecture_field, _other_target,
                                    _garbled_config], ids=lambda f: f.__name__.strip("_"))
def test_damaged_drafter_folder_is_one_line_and_writes_nothing(models, specblock_folder, tmp_path, capsys, damage):
    folder = tmp_path / "drafter"
    shutil.copytree(specblock_folder, folder)
    needle = damage(folder)
    out = tmp_path / "r.jsonl"
    code, _, err = run_specblock(models, folder, out, capsys)
    assert_one_line(code, err, needle, "re" if "target" not in needle else "train one for this target")
    assert not out.exists(), "a failed run must leave no results file behind"


def test_undamaged_drafter_folder_runs(models, specblock_folder, tmp_path, capsys):
    code, _, err = run_specblock(models, specblock_folder, tmp_path / "r.jsonl", capsys)
    assert code == 0, err


def test_corrupt_vocab_mapping_is_one_line(tmp_path):
    from test_specblock import fresh, published_checkpoint
    from tiny import tiny_target
    from test_eagle3 import LAYERS

    target = tiny_target(0, layers=LAYERS, init=0.5)
    published_checkpoint(tmp_path, target, fresh(target))
    assert load_specblock(tmp_path, target) is not None
    mapping = tmp_path / VOCAB_MAPPING
    mapping.write_bytes(mapping.read_bytes()[:50])
    with pytest.raises(SpecbenchError, match=f"{VOCAB_MAPPING} is not a readable vocab mapping .*re-download it"):
        load_specblock(tmp_path, target)


@pytest.mark.parametrize("name,text,needle", [
    ("opts.json", '{"gamma": 3,,}', "is not valid JSON"),
    ("opts.yaml", "gamma: [1, 2\n  : :\n", "is not valid YAML"),
    ("opts.yaml", "- 1\n- 2\n", "must hold a mapping"),
])
def test_malformed_config_is_one_line(models, tmp_path, capsys, name, text, needle):
    config = tmp_path / name
    config.write_text(text)
    out = tmp_path / "r.jsonl"
    code, _, err = cli(base_args(models, out, "--config", str(config)), capsys)
    assert_one_line(code, err, needle, str(config))
    assert not out.exists()


def _finished_run(models, tmp_path, capsys) -> Path:
    out = tmp_path / "r.jsonl"
    assert cli(base_args(models, out), capsys)[0] == 0
    assert len(out.read_text().splitlines()) == 5  # header + 2 prompts x (sps, vanilla)
    return out


def test_results_damaged_in_the_middle_is_refused_untouched(models, tmp_path, capsys):
    out = _finished_run(models, tmp_path, capsys)
    lines = out.read_text().splitlines(keepends=True)
    lines[2] = "#### garbage ####\n"
    out.write_text("".join(lines))
    before = out.read_bytes()
    code, _, err = cli(base_args(models, out, "--resume"), capsys)
    assert_one_line(code, err, str(out), "damaged at line 3", "move the file aside")
    assert out.read_bytes() == before


def test_results_of_another_run_is_refused_untouched(models, tmp_path, capsys):
    out = _finished_run(models, tmp_path, capsys)
    before = out.read_bytes()
    code, _, err = cli(base_args(models, out, "--resume", "--max-new-tokens", "7"), capsys)
    assert_one_line(code, err, str(out), "different configuration", "new --out")
    assert out.read_bytes() == before
    other = tmp_path / "not_results.jsonl"
    other.write_text('{"id": "x", "turns": ["hi"]}\n')
    code, _, err = cli(base_args(models, other, "--resume"), capsys)
    assert_one_line(code, err, str(other), "no header line")
    assert other.read_text() == '{"id": "x", "turns": ["hi"]}\n'


@pytest.mark.parametrize("record,needle", [
    ({"id": "a", "turns": [""]}, "turn 1 is an empty prompt"),
    ({"id": "a", "turns": ["fine", "   "]}, "turn 2 is an empty prompt"),
    ({"id": "a", "turns": []}, "with at least one turn"),
    ({"id": "a"}, "with at least one turn"),
    (None, "has no prompts"),
])
def test_damaged_benchmark_file_is_one_line(models, tmp_path, capsys, record, needle):
    bench = tmp_path / "prompts.jsonl"
    good = json.dumps({"id": "ok", "turns": ["Say hi."]}) + "\n"
    bench.write_text("" if record is None else good + json.dumps(record) + "\n")
    out = tmp_path / "r.jsonl"
    args = base_args(models, out)
    args[args.index("humaneval")] = str(bench)
    code, _, err = cli(args, capsys)
    assert_one_line(code, err, str(bench), needle)
    assert not out.exists()
