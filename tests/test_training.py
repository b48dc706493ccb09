"""Shared training machinery on tiny targets: batches, trainer (loss falls, resume), checkpoints
(round trip, refusal for another target, corrupt files) and the distilled SpS student."""

import json

import pytest
import torch

from methods.sps.drafter import SpSDrafter, SpSOptions
from methods.sps.student import build_student, distillation_loss, load_student, save_student
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine.loop import GenerationConfig, generate
from specbench.errors import SpecbenchError
from specbench.training.checkpoint import load_drafter, save_drafter, target_fingerprint
from specbench.training.features import FeatureCache, iterate_batches, pad_examples, token_counts
from specbench.training.trainer import Recipe, Trainer, acceptance_proxy, cosine_with_warmup, evaluate
from tiny import tiny_target


def examples(target, n=8, seed=0):
    """Greedy continuations of random prompts by the target: a miniature regenerated dataset."""
    gen = torch.Generator().manual_seed(seed)
    vanilla = VanillaDrafter()
    vanilla.setup(target)
    out = []
    for i in range(n):
        prompt = torch.randint(0, target.vocab_size, (6,), generator=gen).tolist()
        resp = generate(target, vanilla, prompt, GenerationConfig(max_new_tokens=16)).new_tokens
        out.append({"id": f"ex{i}", "prompt_ids": prompt, "response_ids": resp})
    return out


def test_pad_examples_masks_only_response_tokens():
    ids, attn, loss = pad_examples([{"prompt_ids": [1, 2], "response_ids": [3, 4, 5]},
                                    {"prompt_ids": [7], "response_ids": [8]}], max_length=4)
    assert ids.tolist() == [[1, 2, 3, 4], [7, 8, 0, 0]]
    assert attn.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert loss.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]


def test_schedule_and_proxy():
    assert cosine_with_warmup(0, 100, 10) == pytest.approx(0.1)
    assert cosine_with_warmup(10, 100, 10) == pytest.approx(1.0)
    assert cosine_with_warmup(100, 100, 10) == pytest.approx(0.0)
    assert acceptance_proxy([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


def test_feature_cache_returns_what_was_computed(tmp_path):
    target = tiny_target(0)
    data = examples(target, 4)
    cache = FeatureCache(tmp_path, [1], 64)
    first = list(iterate_batches(target, data, [1], 2, 64, shuffle=False, cache=cache))
    second = list(iterate_batches(target, data, [1], 2, 64, shuffle=False, cache=cache))
    for a, b in zip(first, second):
        for k in a.taps:
            mask = a.attention_mask.bool()
            torch.testing.assert_close(a.taps[k][mask], b.taps[k][mask], atol=2e-3, rtol=1e-2)  # fp16 storage
    assert int(token_counts(data, target.vocab_size).sum()) == sum(len(e["response_ids"]) for e in data)


def test_feature_cache_keys_the_target_dtype_and_keeps_fp32_keys(tmp_path):
    import hashlib

    fp32 = FeatureCache(tmp_path, [1], 64)
    bf16 = FeatureCache(tmp_path, [1], 64, torch.bfloat16)
    assert fp32._path("ex0") != bf16._path("ex0")
    # Caches filled before the dtype was part of the key stay valid for fp32 runs.
    assert fp32._path("ex0").stem == hashlib.sha256(b"ex0|[-1, 1]|64").hexdigest()[:20]


def test_draft_vocab_targets_match_the_full_logits():
    from specbench.training.batch import TrainBatch

    gen = torch.Generator().manual_seed(0)
    lm_head = torch.nn.Linear(16, 40, bias=False)
    taps = {-1: torch.randn(3, 5, 16, generator=gen)}
    batch = TrainBatch(torch.zeros(3, 5, dtype=torch.long), torch.ones(3, 5), torch.ones(3, 5), taps, lm_head)
    t2d = torch.rand(40, generator=gen) < 0.3
    in_vocab, restricted = batch.draft_vocab_targets(t2d)
    full = batch.target_logits()
    assert torch.equal(in_vocab, t2d[full.argmax(-1)])
    torch.testing.assert_close(restricted, full[..., t2d])


def test_student_distillation_loss_falls_and_resume_continues(tmp_path):
    target = tiny_target(0, layers=4)
    data = examples(target, 8)
    student = build_student(target, [0, 3])
    recipe = Recipe(lr=3e-3, epochs=6, batch_size=4, max_length=64, eval_every=1000, save_every=2)
    saved = []
    trainer = Trainer(student, lambda b: distillation_loss(student, b), recipe, tmp_path / "run",
                      save=lambda folder: saved.append(folder) or save_student(folder, student, target, [0, 3], {}))
    batches = lambda epoch: iterate_batches(target, data, [-1], 4, 64, seed=epoch)
    trainer.fit(batches, steps_per_epoch=2, eval_batches=lambda: iterate_batches(target, data, [-1], 4, 64, shuffle=False))
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in log if "loss" in e]
    assert losses[-1] < 0.7 * losses[0]
    # A new trainer on the same folder resumes at the saved step and does not redo it.
    more = Recipe(**{**recipe.__dict__, "epochs": 7})
    again = Trainer(student, lambda b: distillation_loss(student, b), more, tmp_path / "run", save=lambda f: None)
    again.fit(batches, steps_per_epoch=2)
    assert again.step == 14
    steps = [e["step"] for e in map(json.loads, (tmp_path / "run" / "train_log.jsonl").read_text().splitlines())
             if "loss" in e]
    assert steps == list(range(1, 15))
    # The longer schedule is recorded where it took over, and the wall time adds up across the two runs.
    assert more.extra["schedule_extended_at_step"] == [12]
    elapsed = [e["elapsed_s"] for e in map(json.loads, (tmp_path / "run" / "train_log.jsonl").read_text().splitlines())
               if "loss" in e]
    assert elapsed == sorted(elapsed)
    assert torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)["elapsed_s"] >= elapsed[-1]


def test_evaluate_weights_batches_by_their_tokens_and_skips_empty_ones():
    class Batch:
        def __init__(self, tokens: int, acc: float):
            self.loss_mask = torch.zeros(1, 8)
            self.loss_mask[0, :tokens] = 1
            self.acc = acc

    result = evaluate(lambda b: (torch.tensor(0.0), {"acc_1": b.acc}),
                      [Batch(3, 1.0), Batch(1, 0.0), Batch(0, float("nan"))])
    assert result["acc_1"] == pytest.approx(0.75) and result["tau_proxy"] == pytest.approx(1.75)


def test_a_batch_with_nothing_to_learn_is_skipped_not_trained_on(tmp_path):
    """Prompts longer than --max-length leave no response token: the trainer logs the step as skipped
    (no NaN loss, no update) and the held-out figures stay finite."""
    target = tiny_target(0, layers=4)
    data = examples(target, 4)
    gen = torch.Generator().manual_seed(1)
    data += [{"id": f"long{i}", "prompt_ids": torch.randint(0, target.vocab_size, (40,), generator=gen).tolist(),
              "response_ids": [1, 2, 3]} for i in range(4)]
    student = build_student(target, [0, 3])
    recipe = Recipe(lr=3e-3, epochs=1, batch_size=4, max_length=32, eval_every=1, save_every=100)
    trainer = Trainer(student, lambda b: distillation_loss(student, b), recipe, tmp_path / "run", save=lambda f: None)
    batches = lambda: iterate_batches(target, data, [-1], 4, 32, shuffle=False)
    final = trainer.fit(lambda epoch: batches(), steps_per_epoch=2, eval_batches=batches)
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    steps = [e for e in log if "eval" not in e]
    assert [e.get("skipped") for e in steps] == [None, "no loss-bearing tokens"] and trainer.step == 2
    assert all(torch.isfinite(torch.tensor(e["eval"]["loss"])) for e in log if "eval" in e)
    assert 0.0 <= final["acc_1"] <= 1.0


def test_student_checkpoint_round_trip_and_lossless_sps(tmp_path):
    target = tiny_target(0, layers=4)
    student = build_student(target, [0, 3])
    save_student(tmp_path / "s", student, target, [0, 3], {"lr": 1.0})
    loaded = load_student(tmp_path / "s", target, torch.float32)
    for k, v in student.state_dict().items():
        if k.startswith("model.layers."):
            assert torch.equal(v.to(torch.bfloat16).float(), loaded.state_dict()[k])
    drafter = SpSDrafter(SpSOptions(draft=str(tmp_path / "s"), gamma=3))
    drafter.setup(target)
    vanilla = VanillaDrafter()
    vanilla.setup(target)
    config = GenerationConfig(max_new_tokens=24)
    assert generate(target, drafter, [5, 9, 2], config).new_tokens == generate(target, vanilla, [5, 9, 2], config).new_tokens


def test_checkpoint_refuses_other_target_and_corrupt_files(tmp_path):
    target, other = tiny_target(0, hidden=32), tiny_target(1, hidden=48, heads=4)
    state = {"w": torch.randn(3, 3)}
    save_drafter(tmp_path / "d", state, {"method": "x", "target": target_fingerprint(target)}, dtype=None)
    config, loaded = load_drafter(tmp_path / "d", target)
    assert torch.equal(loaded["w"], state["w"])
    with pytest.raises(SpecbenchError, match="trained for target"):
        load_drafter(tmp_path / "d", other)
    (tmp_path / "d" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(SpecbenchError, match="corrupt"):
        load_drafter(tmp_path / "d", target)
    (tmp_path / "d" / "config.json").write_text("{not json")
    with pytest.raises(SpecbenchError, match="corrupt"):
        load_drafter(tmp_path / "d", target)


def test_target_check_compares_the_vocabulary_not_special_token_metadata(models, tmp_path):
    """Two transformers releases read one GGUF's eos/pad differently; the ids still mean the same
    tokens, so a drafter recorded with the vocabulary fingerprint loads under either, and a drafter
    for another vocabulary is refused."""
    from specbench.engine.target import Target

    target = Target.load(models["target"], "float32")
    fingerprint = target_fingerprint(target)
    save_drafter(tmp_path / "d", {"w": torch.zeros(1)}, {"method": "x", "target": {**fingerprint, "tokenizer": "other"}})
    load_drafter(tmp_path / "d", target)
    save_drafter(tmp_path / "e", {"w": torch.zeros(1)}, {"method": "x", "target": {**fingerprint, "vocab": "other"}})
    with pytest.raises(SpecbenchError, match="trained for target"):
        load_drafter(tmp_path / "e", target)
    legacy = {k: v for k, v in fingerprint.items() if k != "vocab"}
    save_drafter(tmp_path / "f", {"w": torch.zeros(1)}, {"method": "x", "target": {**legacy, "tokenizer": "other"}})
    with pytest.raises(SpecbenchError, match="trained for target"):
        load_drafter(tmp_path / "f", target)


def test_bf16_autocast_training_runs(tmp_path):
    target = tiny_target(0, layers=4)
    data = examples(target, 4)
    student = build_student(target, [0, 3])
    recipe = Recipe(lr=3e-3, epochs=2, batch_size=4, max_length=64, dtype="bfloat16", eval_every=1000)
    trainer = Trainer(student, lambda b: distillation_loss(student, b), recipe, tmp_path / "run", save=lambda f: None)
    final = trainer.fit(lambda epoch: iterate_batches(target, data, [-1], 4, 64, seed=epoch), steps_per_epoch=1,
                        eval_batches=lambda: iterate_batches(target, data, [-1], 4, 64, shuffle=False))
    assert final["steps"] == 2 and final["loss"] == final["loss"]  # finite, not NaN
