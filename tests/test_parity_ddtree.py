"""DDTree against its authors' own loop (methods/parity/ddtree.py): on tiny random targets and tiny DFlash
drafters of ours, their ``ddtree_generate`` with their copy of the draft model gives our tokens and our
per-step accept lengths; one perturbed drafter weight on their side must change the accept lengths
(negative control). The adapter's own pieces (the crop shim, the clock interval, reading their output)
are checked on their own.

The authors' code is imported from a snapshot of https://github.com/liranringel/ddtree that
``$SPECBENCH_REF_DDTREE`` points at; without it the tests that run their code are skipped."""

from __future__ import annotations

import os
import time

import pytest
import torch

from methods.ddtree import DDTreeDrafter, DDTreeOptions
from methods.parity.ddtree import (DDTreeAuthorsLoop, RecordingClock, decode_seconds, kept_steps,
                                   legacy_crop_cache_class, new_tokens, refuse_unheld)
from specbench.errors import SpecbenchError
from test_dflash import BLOCK, PROMPTS, target, trained  # noqa: F401 (module fixtures: tiny target, trained drafter)
from test_parity_cli import ours, prompts, tiny_dflash
from tiny import tiny_target

pytestmark = pytest.mark.parity

ENV = "SPECBENCH_REF_DDTREE"
BUDGET = 8
# The trained fixture's target generates its drafter's mask id (63) after PROMPTS[0] and their output drops
# it (see test_a_generated_mask_id_is_lost_in_their_output); these prompts' 40 tokens do not hold it.
CLEAN_PROMPTS = [list(p) for p in PROMPTS[1:]] + [[53, 45, 56, 51, 43], [51, 34, 10, 46, 54, 44]]


@pytest.fixture(scope="module")
def snapshot_src() -> str:
    src = os.environ.get(ENV)
    if not src:
        pytest.skip(f"${ENV} is unset: point it at a checkout of https://github.com/liranringel/ddtree to run the "
                    "DDTree authors' loop")
    return src


def authors_loop(src: str, target, drafter) -> DDTreeAuthorsLoop:
    reference = DDTreeAuthorsLoop()
    reference.source = src
    reference.cpp_compact = False  # their Python compaction: the C++ one builds a torch extension (~30 s) first
    reference.version()
    reference.load(target, drafter, drafter.options)
    return reference


class RawRounds:
    """Keeps their loop's own acceptance lengths (every round, before the adapter drops rounds past the budget)."""

    def __init__(self, reference: DDTreeAuthorsLoop) -> None:
        self.rounds: list[list[int]] = []
        run = reference.ddtree.ddtree_generate

        def logged(*args, **kwargs):
            out = run(*args, **kwargs)
            self.rounds.append(list(out.acceptance_lengths))
            return out

        reference.ddtree.ddtree_generate = logged  # their module object, which only the adapter holds


def full_vocabulary(target, trained):  # noqa: F811 - the trained fixture's drafter: many accepted drafts
    drafter = DDTreeDrafter(DDTreeOptions(budget=BUDGET), model=trained)
    drafter.setup(target)
    return target, drafter, CLEAN_PROMPTS, 40


def draft_vocabulary():  # a random drafter scoring every other row of the lm_head; prompt 3 holds its mask id
    target = tiny_target(0, layers=3)
    drafter = DDTreeDrafter(DDTreeOptions(budget=BUDGET), model=tiny_dflash(target, reduced=True))
    drafter.setup(target)
    return target, drafter, prompts(3), 24


@pytest.mark.parametrize("case", ["full-vocabulary", "draft-vocabulary"])
def test_authors_loop_gives_our_tokens_and_per_step_accept_lengths(snapshot_src, target, trained, case):  # noqa: F811
    tgt, drafter, cases, n = full_vocabulary(target, trained) if case == "full-vocabulary" else draft_vocabulary()
    reference = authors_loop(snapshot_src, tgt, drafter)
    raw = RawRounds(reference)
    accepted, extra = 0, []
    for ids in cases:
        tokens, accept = ours(tgt, drafter, ids, n)
        assert drafter.model.config.mask_token_id not in tokens  # their output filter drops generated mask ids
        got = reference.generate(ids, n)
        assert got.tokens == tokens
        assert got.accept_lengths == accept  # every step, the last included
        assert got.decode_seconds > 0
        accepted += sum(accept)
        # their loop runs one more round when a round ends exactly at the budget, and only then
        extra.append(len(raw.rounds[-1]) - len(accept))
        assert extra[-1] == (1 + sum(a + 1 for a in accept) == n)
    assert accepted >= 3  # drafts get accepted: the per-step comparison means something
    assert any(extra)  # the round the adapter leaves out did happen here


def test_a_perturbed_drafter_weight_on_their_side_changes_the_accept_lengths(snapshot_src, target,  # noqa: F811
                                                                              trained):  # noqa: F811
    """Negative control: the same comparison with one of their draft model's weights scaled must fail."""
    tgt, drafter, cases, n = full_vocabulary(target, trained)
    reference = authors_loop(snapshot_src, tgt, drafter)
    with torch.no_grad():
        reference.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    same = []
    for ids in cases:
        tokens, accept = ours(tgt, drafter, ids, n)
        got = reference.generate(ids, n)
        assert got.tokens == tokens  # lossless whatever the drafts
        same.append(got.accept_lengths == accept)
    assert not all(same)


def test_their_decode_time_covers_the_first_draft_and_not_the_prefill(snapshot_src, target, trained):  # noqa: F811
    """Our interval: after the prompt's prefill to the last kept round, the first draft forward included
    (their own decode clock starts after it). A 0.3 s pause in the prefill and one in the first draft."""
    tgt, drafter, cases, n = full_vocabulary(target, trained)
    reference = authors_loop(snapshot_src, tgt, drafter)
    pause, calls = 0.3, {"target": 0, "draft": 0}

    def slow_first(kind):
        def hook(module, args, kwargs):
            calls[kind] += 1
            if calls[kind] == 1:
                time.sleep(pause)
        return hook

    handles = [tgt.model.register_forward_pre_hook(slow_first("target"), with_kwargs=True),
               reference.model.register_forward_pre_hook(slow_first("draft"), with_kwargs=True)]
    try:
        start = time.perf_counter()
        got = reference.generate(cases[0], n)
        total = time.perf_counter() - start
    finally:
        for h in handles:
            h.remove()
    assert pause <= got.decode_seconds <= total - pause


def test_a_generated_mask_id_is_lost_in_their_output(snapshot_src, target, trained):  # noqa: F811
    """By design (the notes say so): their loop returns its token buffer without every mask-id entry (the
    unused slots), so a mask-id token the target generates is dropped from their text."""
    tgt, drafter, _, n = full_vocabulary(target, trained)
    reference = authors_loop(snapshot_src, tgt, drafter)
    tokens, _ = ours(tgt, drafter, list(PROMPTS[0]), n)
    mask = drafter.model.config.mask_token_id
    assert mask in tokens
    assert reference.generate(list(PROMPTS[0]), n).tokens == [t for t in tokens if t != mask]


# ---- the adapter's pieces ----------------------------------------------------------------------
def test_the_crop_shim_keeps_the_first_n_positions():
    cache = legacy_crop_cache_class()()
    keys = torch.arange(10.0).view(1, 1, 10, 1)
    cache.update(keys, keys.clone(), 0)
    cache.crop(7)  # their call: keep 7 (transformers 5 refuses a positive crop)
    assert cache.get_seq_length() == 7 and cache.layers[0].keys.flatten().tolist() == list(range(7))
    cache.crop(9)  # longer than the cache: nothing to remove
    cache.crop(-2)  # the new convention still works
    assert cache.layers[0].keys.flatten().tolist() == list(range(5))


def test_rounds_past_the_budget_are_not_counted():
    # 1 + 1 + 3 = 5 tokens after two rounds: with 5 kept, a third round only made tokens their cut drops
    assert kept_steps([1, 3, 2], 5) == 2
    assert kept_steps([1, 3, 2], 6) == 3 and kept_steps([1, 3], 64) == 2 and kept_steps([2], 1) == 0


def test_new_tokens_are_read_after_the_prompts_non_mask_tokens():
    mask, eos = 9, {7}
    prompt = [4, 9, 5]  # their filter dropped the prompt's mask id, so their prompt slice is one token short
    assert new_tokens([4, 5, 1, 2, 3], prompt, mask, eos, 64) == [1, 2, 3]
    assert new_tokens([4, 5, 1, 7, 3], prompt, mask, eos, 64) == [1, 7]  # cut at EOS, inclusive
    assert new_tokens([4, 5, 1, 2, 3], prompt, mask, eos, 2) == [1, 2]  # and at the budget


def test_decode_time_runs_from_their_prefill_end_to_the_last_kept_round():
    readings = [10.0, 10.5, 10.5, 10.5, 11.0, 12.0]  # prefill start/end, decode start, round clock start, ...
    assert decode_seconds(readings, 0.5, [1.0, 2.0, 3.0], 2) == pytest.approx(2.0)
    with pytest.raises(SpecbenchError, match="clock in another order"):
        decode_seconds(readings, 0.4, [1.0], 1)


def test_the_clock_shim_needs_no_cuda_on_a_cpu():
    def theirs():  # their cuda_time: a CPU build of torch has no CUDA to synchronize
        raise AssertionError("synchronized CUDA on a CPU")

    clock = RecordingClock(torch.device("cpu"), theirs)
    a, b = clock(), clock()
    assert clock.readings == [a, b] and b >= a


def test_a_drafter_their_copy_cannot_hold_is_refused_in_one_line():
    target = tiny_target(0, layers=3)
    cfg = tiny_dflash(target, reduced=False).config
    refuse_unheld(cfg, "tiny")  # the plain layout passes
    cfg.output_multiplier = 2.0
    with pytest.raises(SpecbenchError, match="output_multiplier") as err:
        refuse_unheld(cfg, "tiny")
    assert "\n" not in str(err.value)


def test_without_a_snapshot_the_reference_says_what_to_fetch(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(SpecbenchError, match="git clone https://github.com/liranringel/ddtree"):
        DDTreeAuthorsLoop().version()
