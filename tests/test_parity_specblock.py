"""SpecBlock beside the authors' draft model (``SpecBlockInferenceModel``, imported from a checkout of
their repository named by $SPECBENCH_REF_SPECBLOCK): on a tiny random drafter, every block their model
computes inside our loop (block 1 and the batched block-2 starts, logits and rank logits) equals ours
within 1e-4 in fp32, in their convention (bonus_row=duplicate) and in ours; drafts, accept lengths and
text are then identical. Negative controls: one perturbed weight on their side, or our side in the other
convention, must fail the comparison."""

from __future__ import annotations

import os

import pytest
import torch

from methods.parity.specblock import (REPOSITORY, AuthorsForwardSpecBlock, SpecBlockAuthorsDrafter,
                                      authors_draft_model, load_authors_module)
from methods.specblock.drafter import SpecBlockDrafter, SpecBlockOptions
from parity_refs import TOL, assert_parity
from specbench.engine.loop import GenerationConfig, generate
from specbench.run.snapshots import locate_snapshot
from test_eagle3 import LAYERS, PROMPTS
from test_lossless import ready
from test_specblock import fresh
from tiny import tiny_target

pytestmark = pytest.mark.parity

OPTIONS = dict(budget=60, beam_width=4, blocks=3)


@pytest.fixture(scope="module")
def snapshot():
    if not os.environ.get(REPOSITORY.env):
        pytest.skip(f"no snapshot of {REPOSITORY.url}: clone it and set ${REPOSITORY.env} to the checkout")
    return locate_snapshot(REPOSITORY)


@pytest.fixture(scope="module")
def authors(snapshot):
    return load_authors_module(snapshot)


@pytest.fixture(scope="module")
def target():
    return tiny_target(0, layers=LAYERS, init=0.5)


@pytest.fixture(scope="module")
def model(target):
    """A random drafter with a narrower rank head than theirs (zero-padded) and a shift that mixes slots."""
    m = fresh(target, seed=3, rank_hidden=24)
    with torch.no_grad():
        for proj in m.shift_proj:
            torch.nn.init.normal_(proj.weight, std=0.3)
        for layer in m.rank_head:
            if isinstance(layer, torch.nn.Linear):
                torch.nn.init.normal_(layer.weight, std=0.5)
    return m


def recording(drafter):
    """Collect every block the drafter scores: (logits, rank logits) per ``_block`` call, in order."""
    blocks = []
    score = drafter._block

    def spy(logits, rank_logits):
        blocks.append((logits.detach().float().clone(), rank_logits.detach().float().clone()))
        return score(logits, rank_logits)

    drafter._block = spy
    return blocks


def sides(authors, target, model, bonus_row: str, perturb=None):
    their, package = authors
    options = SpecBlockOptions(**OPTIONS, bonus_row=bonus_row)
    ours = ready(SpecBlockDrafter(options, model=model), target)
    ref_model = authors_draft_model(their, model, "specblock")
    if perturb is not None:
        perturb(ref_model)
    ref = ready(AuthorsForwardSpecBlock(options, model=model), target)
    ref.attach_reference(ref_model, package)
    return ours, ref


def run_both(target, ours, ref, prompt, tokens=20):
    config = GenerationConfig(max_new_tokens=tokens)
    got = {}
    for name, drafter in (("ours", ours), ("ref", ref)):
        blocks = recording(drafter)
        got[name] = (generate(target, drafter, prompt, config), blocks)
    return got


@pytest.mark.parametrize("bonus_row", ["duplicate", "once"])
def test_their_blocks_equal_ours(authors, target, model, bonus_row):
    for prompt in PROMPTS:
        got = run_both(target, *sides(authors, target, model, bonus_row), prompt)
        (rec_ours, blocks_ours), (rec_ref, blocks_ref) = got["ours"], got["ref"]
        assert len(blocks_ours) == len(blocks_ref) > rec_ours.n_verify  # block 2 ran too
        for (lo, ro), (lr, rr) in zip(blocks_ours, blocks_ref):
            assert_parity(lo, lr)
            assert_parity(ro, rr)
        assert rec_ours.new_tokens == rec_ref.new_tokens
        assert rec_ours.accept_lengths == rec_ref.accept_lengths
        assert rec_ours.tree_sizes == rec_ref.tree_sizes


def test_their_base_class_holds_a_drafter_without_the_shift(authors, target):
    """A no-shift drafter goes into their base class (no shift_proj), which computes the same blocks."""
    model = fresh(target, seed=5, layer_shift=False)
    got = run_both(target, *sides(authors, target, model, "duplicate"), PROMPTS[2], tokens=12)
    for (lo, ro), (lr, rr) in zip(got["ours"][1], got["ref"][1]):
        assert_parity(lo, lr)
        assert_parity(ro, rr)
    assert got["ours"][0].new_tokens == got["ref"][0].new_tokens


def test_negative_control_a_perturbed_weight_on_their_side_fails(authors, target, model):
    def nudge(ref_model):
        with torch.no_grad():
            ref_model.layers[0].mlp.down_proj.weight.view(-1)[0] += 0.5

    got = run_both(target, *sides(authors, target, model, "duplicate", perturb=nudge), PROMPTS[0], tokens=4)
    (lo, _), (lr, _) = got["ours"][1][0], got["ref"][1][0]
    with pytest.raises(AssertionError, match="max"):
        assert_parity(lo, lr)


def test_negative_control_our_convention_against_theirs_fails(authors, target, model):
    """Their model fed their convention against ours in our convention: the difference the parity row's
    shared convention removes (block-1 logits, first call)."""
    ours, _ = sides(authors, target, model, "once")
    _, ref = sides(authors, target, model, "duplicate")
    got = run_both(target, ours, ref, PROMPTS[2], tokens=4)
    (lo, _), (lr, _) = got["ours"][1][0], got["ref"][1][0]
    delta = float((lo - lr).abs().max())
    assert delta > 100 * TOL


def test_the_adapter_refuses_without_a_snapshot(monkeypatch):
    from specbench.errors import SpecbenchError

    monkeypatch.delenv(REPOSITORY.env, raising=False)
    with pytest.raises(SpecbenchError, match="git clone https://github.com/shiweijiezero/SpecBlock"):
        SpecBlockAuthorsDrafter().version()


def test_a_drafter_their_model_cannot_hold_is_refused(authors, target):
    from specbench.errors import SpecbenchError

    their, _ = authors
    with pytest.raises(SpecbenchError, match="always broadcasts the prefix"):
        authors_draft_model(their, fresh(target, prefix_broadcast=False), "specblock-no-broadcast")
