"""The engine's compile phase and its one clock: every method's records time ``compile`` (the
DraftTree turned into ids, depth positions and mask on the target's device, by the same code for
every method), T_D% leaves it out of drafting, and drafters hand over plain trees."""

import functools

import pytest
import torch

import test_deep_sampling as deep

from drafters import random_tree
from specbench.engine.vanilla import VanillaDrafter
from specbench import metrics
from specbench.engine.loop import GenerationConfig, generate
from specbench.records import DECODE_PHASES
from specbench.engine.target import Target
from specbench.engine.timing import PhaseTimer
from specbench.engine.tree import DraftTree
from tiny import tiny_target

DERIVED = ("depths", "ancestor_mask", "children")


def own_structure(tree: DraftTree) -> list[str]:
    """Derived fields a tree holds that differ from what DraftTree itself derives (i.e. written
    from outside), plus a pre-built ancestor mask (nothing before compile needs one)."""
    fresh = DraftTree(tree.tokens, tree.parents)
    wrong = [k for k in DERIVED if k in vars(tree) and not _same(vars(tree)[k], getattr(fresh, k))]
    return wrong + (["ancestor_mask"] if "ancestor_mask" in vars(tree) else [])


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("name", list(deep.CASES))
def test_every_method_times_a_compile_phase_outside_drafting(name, monkeypatch):
    # Untrained SpecBlock drafters: this test times phases, it does not need deep acceptances.
    monkeypatch.setattr(deep, "trained_specblock", functools.partial(deep.trained_specblock.__wrapped__, steps=0))
    build, _ = deep.CASES[name]
    target, drafter = build()
    drafter.setup(target)
    written = []
    propose = drafter.propose

    def spy(state):
        tree = propose(state)
        written.extend(own_structure(tree))  # as handed over, before compile
        return tree
    monkeypatch.setattr(drafter, "propose", spy)
    config = GenerationConfig(max_new_tokens=6, sampling=deep.params_of(name), seed=0)
    record = generate(target, drafter, deep.PROMPT, config)
    assert record.n_verify > 0 and record.times["compile"] > 0
    assert "compile" in DECODE_PHASES and record.decode_time == pytest.approx(
        sum(record.times[p] for p in ("draft", "compile", "verify", "commit")))
    assert metrics.draft_share([record]) == pytest.approx(record.times["draft"] / record.decode_time)
    assert not written, (name, set(written))


def compile_reference(target: Target, root: int, tree: DraftTree):
    """Positions and the additive mask built on the host from the tree's own structure."""
    q = len(tree) + 1
    visible = torch.ones(q, target.length + q, dtype=torch.bool)
    visible[:, target.length:] = tree.verify_mask()
    mask = torch.zeros(q, target.length + q, dtype=target.dtype).masked_fill_(~visible, torch.finfo(target.dtype).min)
    return target.length + tree.position_offsets(), mask[None, None]


def test_compile_builds_ids_positions_and_mask_on_the_device():
    target = tiny_target(0)
    target.prefill([1, 2, 3, 4])
    gen = torch.Generator().manual_seed(0)
    for n in (2, 5, 17):
        tree = random_tree(n, target.vocab_size, gen)
        while tree.is_chain:
            tree = random_tree(n, target.vocab_size, gen)
        compiled = target.compile_tree(9, tree)
        positions, mask = compile_reference(target, 9, tree)
        assert compiled.ids[0].tolist() == [9] + tree.token_list and compiled.ids.device == target.device
        assert torch.equal(compiled.positions[0], positions) and torch.equal(compiled.mask, mask)
        assert "children" in vars(tree)  # the walk's child table is part of compile, not verify
    chain = target.compile_tree(9, DraftTree.chain([5, 6]))
    assert chain.mask is None and chain.positions[0].tolist() == [4, 5, 6]


def test_a_tree_compiled_against_another_cache_length_is_refused():
    target = tiny_target(0)
    target.prefill([1, 2, 3])
    compiled = target.compile_tree(4, DraftTree.chain([5]))
    target.verify(compiled)
    target.commit([0, 1])
    with pytest.raises(ValueError, match="compiled at cache length 3"):
        target.verify(compiled)


def test_the_clock_is_passed_not_attached():
    target = tiny_target(0)
    drafter = VanillaDrafter()
    drafter.setup(target)
    timer = PhaseTimer("cpu")
    record = generate(target, drafter, [1, 2, 3], GenerationConfig(max_new_tokens=5), timer=timer)
    assert not hasattr(target, "timer")
    # Decode forwards only: prefill's forward was never handed the clock, so nothing was cleared.
    assert timer.forward_calls["target"] == record.forwards["target"] == record.n_verify == 4
    assert list(timer.outer) == ["prefill", "draft", "compile", "verify", "commit"]


def test_nested_phases_count_once_in_elapsed():
    timer = PhaseTimer("cpu")
    with timer.phase("draft"):
        with timer.phase("adapt"):
            sum(range(10000))
    with timer.phase("verify"):
        pass
    assert list(timer.outer) == ["draft", "verify"]
    seconds = timer.seconds()
    assert timer.elapsed() == pytest.approx(seconds["draft"] + seconds["verify"])
    assert timer.elapsed(exclude=("draft",)) == pytest.approx(seconds["verify"])
