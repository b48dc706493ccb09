"""DVI: updates touch only the LoRA head, and decoding stays lossless while the head learns
(greedy equality; T = 1 distribution of the first two tokens). The split-layer verify itself:
tests/test_split_verify.py."""

import json

import pytest
import torch

from methods.dvi import (DVIDrafter, DVIKLDrafter, DVIOptions, ReplayBuffer, kl_to, reinforce, reward_masked_ce,
                         schedule)
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine.loop import GenerationConfig, generate
from specbench.errors import SpecbenchError
from specbench.engine.verify import SamplingParams
from stats import chi2_pvalue
from tiny import tiny_target

PROMPTS = [[3, 17, 5, 42, 8], [1, 2, 3], [60, 7, 7, 7, 19, 33, 2, 9, 41]]


def ready(drafter, target):
    drafter.setup(target)
    return drafter


def causal(model, ids, hidden=False):
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=hidden)


def test_bad_options_are_one_line_errors():
    target = tiny_target(0, layers=4)
    with pytest.raises(SpecbenchError, match="split layer 4 is out of range; use 1..3"):
        ready(DVIDrafter(DVIOptions(layer=4)), target)
    with pytest.raises(SpecbenchError, match="option objective must be one of 'kl-rl', 'kl', 'pg', 'ce'"):
        DVIDrafter(DVIOptions(objective="rl"))
    with pytest.raises(SpecbenchError, match="k must be >= 1"):
        DVIDrafter(DVIOptions(k=0))


# ---- schedule and losses ------------------------------------------------------------------------
def test_kl_to_rl_schedule():
    o = DVIOptions()
    assert schedule(0, o) == schedule(39, o) and schedule(0, o).kl == 1 and schedule(0, o).rl == 0
    assert schedule(0, o).ce == 0.1 and schedule(0, o).beta == 0.5
    mid = schedule(40 + 39, o)
    assert mid.rl == pytest.approx(0.5) and mid.kl == pytest.approx(0.525)
    end = schedule(10_000, o)
    assert (end.kl, end.rl, end.ce) == (pytest.approx(0.05), 1.0, 0.1) and end.beta == pytest.approx(0.05)
    for objective, (kl, rl, ce) in {"kl": (1, 0, 0), "pg": (0, 1, 0), "ce": (0, 1, 0)}.items():
        w = schedule(0, DVIOptions(objective=objective))
        assert (w.kl, w.rl, w.ce, w.beta) == (kl, rl, ce, 0)


def test_losses():
    log_q = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))
    drafts, rewards = torch.tensor([0, 2]), torch.tensor([1.0, 0.0])
    # Only the accepted draft is credited; the rejected one does not enter the mean either.
    assert float(reward_masked_ce(log_q, drafts, rewards)) == pytest.approx(-torch.log(torch.tensor(0.5)))
    assert float(reward_masked_ce(log_q, drafts, torch.zeros(2))) == 0.0
    # REINFORCE pushes up accepted drafts (r > b) and down rejected ones (r < b).
    pg = reinforce(log_q, drafts, rewards, baseline=0.5)
    assert float(pg) == pytest.approx(-(0.5 * log_q[0, 0] - 0.5 * log_q[1, 2]) / 2)
    assert float(kl_to(log_q, log_q)) == pytest.approx(0.0, abs=1e-6)
    assert float(kl_to(torch.zeros(1, 3), log_q[:1])) > 0


def test_replay_buffer_grows_then_wraps():
    buf = ReplayBuffer(10)
    for i in range(6):
        buf.push({"x": torch.full((3, 2), float(i)), "reward": torch.full((3,), float(i))})
    assert len(buf) == 10 and buf.data["x"].shape[0] == 10
    assert buf.data["reward"].tolist() == [3, 3, 4, 4, 4, 5, 5, 5, 2, 3]  # the 10 newest rows
    batch = buf.sample(4, torch.Generator().manual_seed(0))
    assert batch["x"].shape == (4, 2) and set(batch) == {"x", "reward"}


# ---- learning ------------------------------------------------------------------------------------
def test_update_changes_only_the_lora_head_and_scale():
    target = tiny_target(2, layers=4)
    frozen = {k: v.clone() for k, v in target.model.state_dict().items()}
    drafter = ready(DVIDrafter(DVIOptions(layer=2, k=3, lr=1e-2, warmup=0, ramp=1)), target)
    before = {k: v.detach().clone() for k, v in drafter.head.trainable().items()}
    for prompt in PROMPTS:
        generate(target, drafter, prompt, GenerationConfig(max_new_tokens=16))
    assert drafter.steps > 5
    for k, v in target.model.state_dict().items():
        assert torch.equal(v, frozen[k]), f"{k} of the frozen target changed"
    after = drafter.head.trainable()
    assert all(not torch.equal(before[k], after[k].detach()) for k in ("lora_A", "lora_B", "scale"))
    assert {n for n, p in drafter.head.named_parameters()} == {"lora_A", "lora_B", "scale"}


def test_frozen_head_does_not_learn_or_buffer():
    target = tiny_target(2, layers=4)
    drafter = ready(DVIDrafter(DVIOptions(layer=2, learn=False)), target)
    record = generate(target, drafter, PROMPTS[0], GenerationConfig(max_new_tokens=16))
    assert drafter.steps == 0 and len(drafter.buffer) == 0 and not drafter.learns
    assert record.extra["update_steps"] == 0 and "adapt" not in record.times


@pytest.mark.parametrize("objective", ["kl-rl", "kl", "pg", "ce"])
def test_greedy_equals_baseline_while_learning(objective):
    target = tiny_target(0, layers=4)
    vanilla = ready(VanillaDrafter(), target)
    # A large learning rate and a short schedule make the head change a lot between iterations.
    drafter = ready(DVIDrafter(DVIOptions(layer=2, k=3, objective=objective, lr=5e-2, warmup=3, ramp=5)), target)
    config = GenerationConfig(max_new_tokens=24)
    steps = []
    for prompt in PROMPTS + PROMPTS[:1]:  # one drafter instance over a stream: its state carries across prompts
        record = generate(target, drafter, prompt, config)
        assert record.new_tokens == generate(target, vanilla, prompt, config).new_tokens
        steps.append(record.extra["update_steps"])
        assert record.times["adapt"] > 0 and record.extra["update_steps_turn"] == record.n_verify
    assert steps == sorted(steps) and steps[0] > 0


def test_kl_learning_raises_acceptance_on_a_stream():
    target = tiny_target(3, layers=4)
    drafter = ready(DVIKLDrafter(DVIKLDrafter.Options(layer=1, k=4, lr=2e-2)), target)
    taus = []
    for prompt in PROMPTS * 3:
        record = generate(target, drafter, prompt, GenerationConfig(max_new_tokens=32))
        taus.append(record.committed / record.n_verify)
    assert sum(taus[-3:]) > sum(taus[:3]) + 0.3, taus


def test_head_save_and_load_round_trip(tmp_path):
    target = tiny_target(2, layers=4)
    drafter = ready(DVIDrafter(DVIOptions(layer=2, lr=1e-2)), target)
    generate(target, drafter, PROMPTS[2], GenerationConfig(max_new_tokens=16))
    drafter.save_head(tmp_path)
    again = ready(DVIDrafter(DVIOptions(layer=2, head=str(tmp_path))), target)
    for k, v in drafter.head.trainable().items():
        assert torch.equal(v.detach(), again.head.trainable()[k].detach())
    with pytest.raises(SpecbenchError, match="trained at layer 2, not 1"):
        ready(DVIDrafter(DVIOptions(layer=1, head=str(tmp_path))), target)


# ---- T = 1 -------------------------------------------------------------------------------------
V = 8
SAMPLES = 1_500  # the 20k-sample checks of rule C itself are in test_sampling_rules.py


def exact_first_two(target, prompt):
    p1 = causal(target.model, prompt).logits[0, -1].float().softmax(-1)
    joint = {}
    for a in range(V):
        p2 = causal(target.model, prompt + [a]).logits[0, -1].float().softmax(-1)
        for b in range(V):
            joint[(a, b)] = float(p1[a] * p2[b])
    return joint


def test_sampling_matches_target_distribution_while_learning():
    target = tiny_target(4, vocab=V, init=0.3)
    prompt = [1, 4, 2]
    # Learning every call: the head (hence q) differs from one iteration to the next.
    drafter = ready(DVIDrafter(DVIOptions(layer=1, k=2, lr=1e-2, warmup=5, ramp=10, batch=8)), target)
    params = SamplingParams(temperature=1.0)
    samples = []
    for seed in range(SAMPLES):
        record = generate(target, drafter, prompt, GenerationConfig(max_new_tokens=2, sampling=params, seed=seed))
        samples.append(tuple(record.new_tokens[:2]))
    assert drafter.steps >= SAMPLES
    stat, pvalue = chi2_pvalue(samples, exact_first_two(target, prompt))
    print(f"chi2={stat:.1f} p={pvalue:.3f} n={SAMPLES}")
    assert pvalue > 1e-3


# ---- through the runner --------------------------------------------------------------------------
def test_run_streams_dvi_and_a_variant_with_state_carried(models, tmp_path, capsys):
    from test_cli import cli

    out = tmp_path / "dvi.jsonl"
    code, _, err = cli(["run", "--method", "dvi", "--also", "dvi-kl@layer=2", "--bench", "humaneval",
                        "--target", models["deep"], "--dtype", "float32", "--opt", "layer=2", "--opt", "buffer=64",
                        "--max-new-tokens", "10", "--limit", "3", "--out", str(out), "--no-warmup"], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    by = {}
    for r in records:
        by.setdefault(r["method"], []).append(r)
    assert set(by) == {"dvi", "dvi-kl@layer=2", "vanilla"}
    for method in ("dvi", "dvi-kl@layer=2"):
        rows = sorted(by[method], key=lambda r: r["query_index"])
        steps = [r["extra"]["update_steps"] for r in rows]
        assert steps == sorted(steps) and steps[-1] > steps[0], steps  # one learner across the stream
        assert rows[0]["extra"]["objective"] == ("kl-rl" if method == "dvi" else "kl")
    base = {r["prompt_id"]: r["new_tokens"] for r in by["vanilla"]}
    assert all(r["new_tokens"] == base[r["prompt_id"]] for r in by["dvi"] + by["dvi-kl@layer=2"])
