"""Learning curves: the trainer counts the loss-bearing tokens it trained on (across a resume), and
the drafter folder gets every held-out evaluation against them as CSV, PNG and a model-card section."""

import json

from methods.sps.student import build_student, distillation_loss
from specbench.training.features import iterate_batches
from specbench.training.learning_curve import (curve_points, curve_section, plateau, read_curve, read_log,
                                               write_learning_curve)
from specbench.training.trainer import Recipe, Trainer
from test_training import examples
from tiny import tiny_target


def student_run(tmp_path):
    """A tiny distillation run in tmp_path/run: train(epochs) trains (resuming) up to that many epochs."""
    target = tiny_target(0, layers=2)
    data = examples(target, 4)
    student = build_student(target, [0])
    batches = lambda epoch: iterate_batches(target, data, [-1], 2, 64, seed=epoch)
    held_out = lambda: iterate_batches(target, data[:2], [-1], 2, 64, shuffle=False)

    def train(epochs):
        recipe = Recipe(lr=1e-3, epochs=epochs, batch_size=2, max_length=64, eval_every=1, save_every=1)
        Trainer(student, lambda b: distillation_loss(student, b), recipe, tmp_path / "run",
                save=lambda f: None).fit(batches, 2, held_out)

    return data, train


def test_tokens_are_counted_per_step_and_survive_a_resume(tmp_path):
    data, train = student_run(tmp_path)
    expected_per_epoch = sum(len(e["response_ids"]) for e in data)
    train(2)
    train(3)  # resumed: the count goes on from the checkpoint

    log = read_log(tmp_path / "run" / "train_log.jsonl")
    steps = [e for e in log if "loss" in e]
    assert [e["step"] for e in steps] == list(range(1, 7))
    assert steps[1]["tokens"] == expected_per_epoch and steps[-1]["tokens"] == 3 * expected_per_epoch
    points = curve_points(log)
    assert [p["step"] for p in points] == list(range(1, 7))
    assert [p["tokens"] for p in points] == [e["tokens"] for e in steps]
    assert not any(p["tokens_estimated"] for p in points) and all("tau_proxy" in p for p in points)


def test_a_run_resumed_from_a_checkpoint_without_a_token_count_logs_none(tmp_path):
    import torch

    _, train = student_run(tmp_path)
    train(1)
    state_path = tmp_path / "run" / "trainer_state.pt"
    state = torch.load(state_path, weights_only=False)
    del state["tokens"]  # as written by a trainer that did not count tokens yet
    torch.save(state, state_path)
    (tmp_path / "run" / "train_log.jsonl").write_text("")
    train(2)
    log = read_log(tmp_path / "run" / "train_log.jsonl")
    assert [e["step"] for e in log if "loss" in e] == [3, 4] and not any("tokens" in e for e in log)
    assert all(p["tokens_estimated"] for p in curve_points(log, tokens_per_step=10.0))


def test_old_logs_estimate_tokens_and_a_rerun_step_keeps_its_last_evaluation():
    log = [{"step": 100, "loss": 3.0}, {"step": 100, "eval": {"tau_proxy": 1.2, "acc_1": 0.2}},
           {"step": 200, "eval": {"tau_proxy": 1.4, "acc_1": 0.3}},
           {"step": 200, "eval": {"tau_proxy": 1.5, "acc_1": 0.3}}]  # resumed and evaluated again
    points = curve_points(log, tokens_per_step=250.0)
    assert [(p["step"], p["tokens"], p["tau_proxy"]) for p in points] == [(100, 25000, 1.2), (200, 50000, 1.5)]
    assert all(p["tokens_estimated"] for p in points)
    assert curve_points(log)[0]["tokens"] is None  # nothing to estimate from: no x value rather than a wrong one


def test_curve_files_and_card_section(tmp_path):
    rising = [{"step": s, "tokens": 1000 * s, "tokens_estimated": False, "tau_proxy": 1 + 0.1 * s, "acc_1": 0.1}
              for s in range(1, 10)]
    csv_path, png_path = write_learning_curve(tmp_path, rising)
    assert png_path.stat().st_size > 1000 and png_path.read_bytes()[:4] == b"\x89PNG"
    back = read_curve(tmp_path)
    assert [(p["step"], p["tokens"], p["tau_proxy"]) for p in back] == [(p["step"], p["tokens"], p["tau_proxy"])
                                                                          for p in rising]
    section = "\n".join(curve_section(tmp_path))
    assert "Held-out tau_proxy" in section and "still improving" in section and "| 9 | 9,000 | 1.900 |" in section
    flat = [{**p, "tau_proxy": 2.0} for p in rising]
    assert plateau(flat, "tau_proxy").startswith("plateaued")
    # Three evaluations (100, 200, 272): the last third starts at step 181, where the curve read ~0.800
    # (interpolated), not at step 200 (which would leave a single point) nor at step 100.
    three = [{"step": s, "auc": a} for s, a in ((100, 0.741), (200, 0.814), (272, 0.836))]
    assert plateau(three, "auc") == "still improving (4.5% over the last third of training)"
    late = [{"step": s, "auc": a} for s, a in ((700, 0.80), (800, 0.80), (914, 0.80))]  # all past step 609
    assert plateau(late, "auc").startswith("plateaued")
    # A pre-verifier's curve follows its AUC.
    auc = [{"step": s, "tokens": s, "tokens_estimated": False, "auc": 0.5 + 0.01 * s, "loss": 1.0} for s in (1, 2)]
    write_learning_curve(tmp_path, auc)
    assert "Held-out auc" in "\n".join(curve_section(tmp_path))
    assert curve_section(tmp_path / "missing") == []


def test_trained_drafter_folder_has_its_curve(models, tmp_path, capsys, monkeypatch):
    from test_cli import cli
    from test_train_cli import common

    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    code, _, err = cli(["train", "sps-student", "--layers", "0", *common(models, tmp_path, tmp_path / "s")], capsys)
    assert code == 0, err
    folder = tmp_path / "s" / "drafter"
    points = read_curve(folder)
    assert [p["step"] for p in points] == [3] and points[0]["tokens"] > 0
    assert json.loads((folder / "eval.json").read_text())["steps"] == 3
    assert "## Learning curve" in (folder / "README.md").read_text() and (folder / "learning_curve.png").is_file()


def test_model_card_lists_accuracy_by_depth_in_depth_order(tmp_path):
    """A 16-deep drafter's card reads acc_1, acc_2, ..., acc_16 (not acc_1, acc_10, acc_11, ...)."""
    from safetensors.torch import save_file
    import torch

    from specbench.training.model_card import write_model_card

    save_file({"w": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"method": "toy", "target": {"name": "t"}, "recipe": {}}))
    evaluation = {f"acc_{k}": 1 / k for k in range(1, 17)} | {"tau_proxy": 1.5}
    card = write_model_card(tmp_path, evaluation).read_text()
    row = next(line for line in card.splitlines() if "top-1 accuracy by depth" in line)
    assert [c.strip().split("=")[0] for c in row.split("|")[2].split(",")] == [f"acc_{k}" for k in range(1, 17)]
