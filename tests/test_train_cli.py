"""`specbench train` end to end on a tiny target with the real SmolLM2 tokenizer: regenerate
data, train, save a drafter folder with a model card, and run it through the engine."""

import json
import math

import pytest

from methods.eagle3.drafter import Eagle3Drafter, Eagle3Options
from methods.sps.drafter import SpSDrafter, SpSOptions
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine.loop import GenerationConfig, generate
from specbench.data.results import hardware
from specbench.engine.target import Target
from test_cli import cli


def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "turns": [f"Tell me about topic number {i}."]} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def common(models, tmp_path, out, target="target"):
    return ["--target", models[target], "--prompts", prompt_file(tmp_path), "--limit", "6", "--max-new-tokens", "12",
            "--epochs", "1", "--batch-size", "2", "--max-length", "64", "--out", str(out)]


def assert_trained(out):
    folder = out / "drafter"
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    card = (folder / "README.md").read_text()
    assert "held-out top-1 accuracy" in card and "1 epoch," in card
    assert f"s on {hardware('cpu')} |" in card  # the card says what trained it
    assert json.loads((folder / "eval.json").read_text())["steps"] == 3
    assert len((out / "train_log.jsonl").read_text().splitlines()) >= 3
    return folder


def lossless(target, drafter):
    vanilla = VanillaDrafter()
    vanilla.setup(target)
    drafter.setup(target)
    config = GenerationConfig(max_new_tokens=16)
    prompt = target.tokenizer("Hello there")["input_ids"]
    assert generate(target, drafter, prompt, config).new_tokens == generate(target, vanilla, prompt, config).new_tokens


def test_train_sps_student_then_run_it(models, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    code, out, err = cli(["train", "sps-student", "--layers", "0,1", *common(models, tmp_path, tmp_path / "s")], capsys)
    assert code == 0, err
    folder = assert_trained(tmp_path / "s")
    target = Target.load(models["target"], "float32")
    lossless(target, SpSDrafter(SpSOptions(draft=str(folder), gamma=3)))


def test_train_eagle3_then_run_it(models, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    code, out, err = cli(["train", "eagle3", "--draft-vocab", "512", "--steps", "2",
                          *common(models, tmp_path, tmp_path / "e", "deep")], capsys)
    assert code == 0, err
    folder = assert_trained(tmp_path / "e")
    target = Target.load(models["deep"], "float32")
    lossless(target, Eagle3Drafter(Eagle3Options(path=str(folder), depth=2, top_k=3, total_tokens=8)))


def test_train_eagle3_in_bf16_taps_a_bf16_target_and_keeps_fp32_weights(models, tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    code, out, err = cli(["train", "eagle3", "--draft-vocab", "512", "--steps", "2", "--dtype", "bfloat16",
                          *common(models, tmp_path, tmp_path / "e", "deep")], capsys)
    assert code == 0, err
    folder = assert_trained(tmp_path / "e")
    recipe = json.loads((folder / "config.json").read_text())["recipe"]
    assert recipe["dtype"] == "bfloat16" and recipe["extra"]["target_dtype"] == "bfloat16"
    state = torch.load(tmp_path / "e" / "trainer_state.pt", weights_only=False)
    assert {v.dtype for k, v in state["module"].items() if v.is_floating_point()} == {torch.float32}
    target = Target.load(models["deep"], "float32")
    lossless(target, Eagle3Drafter(Eagle3Options(path=str(folder), depth=2, top_k=3, total_tokens=8)))


@pytest.mark.parametrize("command", [["sps-student", "--layers", "0,1"], ["medusa", "--heads", "2"],
                                     ["dflash", "--layers", "1", "--block-size", "4", "--draft-vocab", "64"]],
                         ids=lambda c: c[0])
def test_feature_trainers_train_on_a_bf16_target(command, models, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    code, out, err = cli(["train", *command, "--dtype", "bfloat16", *common(models, tmp_path, tmp_path / "o", "deep")],
                         capsys)
    assert code == 0, err
    folder = assert_trained(tmp_path / "o")
    assert json.loads((folder / "config.json").read_text())["recipe"]["extra"]["target_dtype"] == "bfloat16"
    assert math.isfinite(json.loads((folder / "eval.json").read_text())["loss"])


def test_train_medusa_then_run_it(models, tmp_path, capsys, monkeypatch):
    from methods.medusa.drafter import MedusaDrafter, MedusaOptions

    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    code, out, err = cli(["train", "medusa", "--heads", "3", "--eval-every", "2",
                          *common(models, tmp_path, tmp_path / "m")], capsys)
    assert code == 0, err
    folder = assert_trained(tmp_path / "m")
    log = [json.loads(line) for line in (tmp_path / "m" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "eval" in r] == [2, 3]  # every 2 steps, and at the end
    target = Target.load(models["target"], "float32")
    lossless(target, MedusaDrafter(MedusaOptions(path=str(folder), topk=4)))


def test_shipped_responses_seed_the_cache_without_generating(models, tmp_path, capsys, monkeypatch):
    """`train data --export` writes prompt-free responses; a later run finds them under
    specbench/training/responses/<target>/ and rebuilds the same cache rows by re-rendering the prompts only."""
    from specbench.training import data as data_mod

    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    prompts = prompt_file(tmp_path)
    shipped = tmp_path / "shipped" / "target" / "p.responses.jsonl.gz"
    args = ["train", "data", "--target", models["target"], "--prompts", prompts, "--max-new-tokens", "8"]
    code, out, err = cli([*args, "--export", str(shipped)], capsys)
    assert code == 0, err
    cached = next((tmp_path / "cache" / "data").rglob("*.jsonl"))
    before = data_mod.read_examples(cached)
    cached.unlink()

    def no_generation(*a, **k):
        raise AssertionError("answers were generated although shipped ones match")

    monkeypatch.setattr(data_mod, "SHIPPED_RESPONSES", tmp_path / "shipped")
    monkeypatch.setattr(data_mod, "_generate_batch", no_generation)
    code, out, err = cli(args, capsys)
    assert code == 0, err
    assert sorted(data_mod.read_examples(cached), key=lambda e: e["id"]) == sorted(before, key=lambda e: e["id"])


def test_train_pacer_on_the_shared_fit_then_run_it(models, tmp_path, capsys, monkeypatch):
    """The pre-verifier trains through the shared fit loop: replayed SD packed per response, binary
    CE, held-out AUC, its own card; a rerun resumes from the checkpoint instead of starting over."""
    from methods.pacer.drafter import PacerDrafter, PacerOptions

    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    args = ["train", "pacer", "--draft", models["draft"], "--window", "6", "--target", models["target"], "--prompts",
            prompt_file(tmp_path), "--limit", "6", "--max-new-tokens", "12", "--epochs", "1", "--batch-size", "2",
            "--eval-every", "1", "--out", str(tmp_path / "p")]
    code, out, err = cli(args, capsys)
    assert code == 0, err
    folder = tmp_path / "p" / "drafter"
    assert "pre-verification layer in" in out
    evaluation = json.loads((folder / "eval.json").read_text())
    assert evaluation["steps"] == 3 and {"bce", "accuracy", "auc", "auc_draft1"} <= set(evaluation)
    extra = json.loads((folder / "config.json").read_text())["recipe"]["extra"]
    assert extra["train_rows"] > 0 and extra["window"] == 6 and "train_response_tokens" not in extra
    assert extra["position_init_std"] > 0  # e_i drawn at the replayed states' scale
    assert extra["target_dtype"] == "float32"  # --dtype: the target's while it answers (the layer trains in autocast)
    card = (folder / "README.md").read_text()
    assert "replayed greedy SD" in card and "regenerated by the target in float32" in card
    code, _, err = cli(args, capsys)  # resumes at the last step: no step trained twice
    assert code == 0, err
    assert json.loads((folder / "eval.json").read_text())["steps"] == 3
    steps = [json.loads(line) for line in (tmp_path / "p" / "train_log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "eval" not in s] == [1, 2, 3]
    assert [s["step"] for s in steps if "eval" in s] == [1, 2, 3]  # --eval-every 1; the resumed run adds none
    target = Target.load(models["target"], "float32")
    lossless(target, PacerDrafter(PacerOptions(draft=models["draft"], pacer=str(folder), block=2)))


@pytest.mark.parametrize("steps", [2, 5])  # within the first epoch, and on into a second
def test_max_steps_sets_the_run_length_the_schedule_and_the_card_and_auto_dtype_resolves(steps, models, tmp_path, capsys, monkeypatch):
    from specbench.engine import devices

    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2"})  # --dtype auto: float32 on a CPU without bf16
    out = tmp_path / "b"
    args = ["train", "specblock", "--layers", "1", "--draft-vocab", "64", "--rank-hidden", "8", "--dtype", "auto",
            *common(models, tmp_path, out, "deep"), "--max-steps", str(steps)]
    code, _, err = cli(args, capsys)
    assert code == 0, err
    folder = out / "drafter"
    assert json.loads((folder / "eval.json").read_text())["steps"] == steps  # 3 steps make one epoch here
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if "lr" in r]
    assert len(lrs) == steps and lrs[-1] == pytest.approx(0.0, abs=1e-9)  # the cosine ends at step N, not at an epoch
    config = json.loads((folder / "config.json").read_text())
    assert config["recipe"]["max_steps"] == steps and config["recipe"]["dtype"] == "float32"
    assert config["recipe"]["extra"]["rank_start"] == steps // 4  # SpecBlock's rank loss starts a quarter in
    card = (folder / "README.md").read_text()
    assert f"max length 64, {steps} steps," in card and "epoch," not in card
