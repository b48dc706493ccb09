"""SpecBlock +adapt (cost-aware bandit) and +OSD on tiny targets: the bandit's choice, the KL
penalty, which parameters each action touches, rollback, and losslessness while learning."""

import copy
import random

import pytest
import torch

from methods.specblock.adapt import (AdaptOptions, OSDOptions, SpecBlockAdaptDrafter, SpecBlockOSDDrafter,
                                     choose_action, head_parameters, kl_to_reference)
from specbench.engine.registry import method_class
from specbench.engine.loop import GenerationConfig, generate
from test_eagle3 import PROMPTS
from test_lossless import baseline, ready
from test_specblock import target, trained  # noqa: F401  (module fixtures)

EAGER = dict(budget=20, beam_width=4, warmup_queries=0, buffer_queries=1, cooldown=0, cold_start_events=2,
             value_window=2)
QUERIES = [p + [i] for i in range(3) for p in PROMPTS]


@pytest.mark.parametrize("values,signal,expected", [({"head": 0.0, "full": 0.0}, 9.0, "skip"),
                                                    ({"head": -1.0, "full": -0.1}, 9.0, "skip"),
                                                    ({"head": 0.2, "full": 0.1}, 9.0, "head"),
                                                    ({"head": -0.2, "full": 0.1}, 9.0, "full")])
def test_bandit_skips_unless_some_value_is_positive(values, signal, expected):
    assert choose_action(values, signal, cold_start=False, epsilon=0.0, rng=random.Random(0)) == expected


def test_cold_start_never_skips_and_explores():
    rng = random.Random(0)
    picks = {choose_action({"head": 0.0, "full": 0.0}, 1.0, True, 0.5, rng) for _ in range(50)}
    assert picks == {"head", "full"}


def test_kl_penalty_is_zero_at_the_reference():
    logits = torch.randn(5, 40)
    assert float(kl_to_reference(logits, logits.clone())) == pytest.approx(0.0, abs=1e-6)
    assert float(kl_to_reference(logits, torch.randn(5, 40))) > 0


def learner(target, trained, cls=SpecBlockAdaptDrafter, **options):
    opts = (OSDOptions if cls is SpecBlockOSDDrafter else AdaptOptions)(**{**EAGER, **options})
    return ready(cls(opts, model=copy.deepcopy(trained)), target)


def collect_logs(drafter, target, n=3):
    logs = []
    for prompt in QUERIES[:n]:
        generate(target, drafter, prompt, GenerationConfig(max_new_tokens=20))
        logs.append(drafter.log)
    assert any(log.points for log in logs)
    return logs


@pytest.mark.parametrize("action", ["head", "full"])
def test_an_update_changes_only_what_its_action_names(target, trained, action):
    drafter = learner(target, trained, warmup_queries=1000)  # collect without updating
    logs = collect_logs(drafter, target)
    before = {k: v.clone() for k, v in drafter.train_model.state_dict().items()}
    drafter.update_step(action, logs)
    after = drafter.train_model.state_dict()
    heads = set(head_parameters(drafter.train_model))
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and changed <= ({k for k in before if k in heads} if action == "head" else set(before))
    if action == "head":
        assert all(torch.equal(before[k], after[k]) for k in before if k.startswith(("layers.", "shift_proj.")))
    else:
        assert any(k.startswith("layers.") for k in changed)


def test_rollback_restores_the_snapshot(target, trained):
    drafter = learner(target, trained, warmup_queries=1000)
    logs = collect_logs(drafter, target)
    snapshot = drafter._state()
    drafter.update_step("full", logs)
    drafter.values = {"head": 0.3, "full": 0.2}
    drafter.restore(snapshot)
    for k, v in drafter.train_model.state_dict().items():
        assert torch.equal(v, snapshot[k]), k
    serving = drafter.model.state_dict()
    assert all(torch.equal(serving[k], v.to(serving[k].dtype)) for k, v in snapshot.items() if k in serving)
    assert drafter.values == {"head": 0.0, "full": 0.0}


@pytest.mark.parametrize("cls", [SpecBlockAdaptDrafter, SpecBlockOSDDrafter], ids=["adapt", "osd"])
def test_greedy_stays_lossless_while_the_drafter_learns(target, trained, cls):
    drafter = learner(target, trained, cls=cls)
    config = GenerationConfig(max_new_tokens=24)
    updates = []
    for prompt in QUERIES:
        record = generate(target, drafter, prompt, config)
        assert record.new_tokens == baseline(target, prompt, config)
        updates.append(record.extra["adapt"]["update"])
        if record.extra["adapt"]["update"]:
            assert record.times["adapt"] > 0 and record.times["adapt"] <= record.times["draft"]
    assert drafter.events > 0 and any(updates)


def test_registered_and_learning():
    assert method_class("specblock-adapt") is SpecBlockAdaptDrafter and SpecBlockAdaptDrafter.learns
    assert method_class("specblock-osd") is SpecBlockOSDDrafter
