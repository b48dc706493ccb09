"""EAGLE-3 beside SafeAILab/EAGLE's own decode loop (``EaModel.eagenerate``), imported from a snapshot of their
repository ($SPECBENCH_REF_EAGLE): on a tiny random Llama and a briefly trained tiny EAGLE-3 drafter of ours,
their loop gives our tokens and our per-step accept lengths; a perturbed drafter weight or another tree on
their side only must not (negative controls)."""

from __future__ import annotations

import os

import pytest
import torch

from methods.eagle3.drafter import Eagle3Drafter, Eagle3Model, Eagle3Options
from parity_refs import save_tiny_tokenizer
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.target import Target
from specbench.engine.verify import SamplingParams
from methods.taps import eagle3_taps
from specbench.training.batch import TrainBatch
from test_eagle3 import INIT, LAYERS, VOCAB, greedy, train, vocab_of
from tiny import tiny_llama

pytestmark = pytest.mark.parity

SNAPSHOT = os.environ.get("SPECBENCH_REF_EAGLE")
if not SNAPSHOT:
    pytest.skip("SPECBENCH_REF_EAGLE is unset: point it at a checkout of https://github.com/SafeAILab/EAGLE "
                "(git clone https://github.com/SafeAILab/EAGLE)", allow_module_level=True)

PROMPTS = [[3, 17, 5, 42, 8], [1, 2, 3, 4, 5, 6], [60, 7, 7, 7, 19, 33, 2, 9, 41]]
N = 32
SMALL = Eagle3Options(top_k=4, depth=3, total_tokens=20)
STEPS = 30  # fitting steps: accept lengths between 0 and the tree depth, not all at the top


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The 8-layer tiny Llama of test_eagle3 (taps 2, 4, 5: their hard-coded layers 2, L/2, L-3), with a word-level
    tokenizer (their EaModel loads one by path; its EOS t63 stops both sides)."""
    from transformers import AutoTokenizer

    folder = save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"), VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return Target(tiny_llama(0, layers=LAYERS, init=INIT, eos=tokenizer.eos_token_id), tokenizer, name="tiny-0")


def fitted_batch(target, prompts, new: int) -> TrainBatch:
    """The target's greedy continuations of ``prompts`` (right-padded), loss on the continuations."""
    seqs = [greedy(target.model, p, new) for p in prompts]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    attention, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, (prompt, seq) in enumerate(zip(prompts, seqs)):
        ids[row, :len(seq)] = torch.tensor(seq)
        attention[row, :len(seq)] = 1
        loss_mask[row, len(prompt):len(seq)] = 1
    with torch.no_grad():
        hidden = target.model(ids, attention_mask=attention, output_hidden_states=True).hidden_states
    taps = {i: hidden[i].float() for i in set(eagle3_taps(LAYERS)) | {-1}}
    return TrainBatch(ids, attention, loss_mask, taps, target.model.lm_head)


@pytest.fixture(scope="module", params=["draft-vocabulary", "full-vocabulary"])
def drafter_model(request, target):
    """A drafter briefly fitted to the target's continuations of the test prompts, so that steps accept 0 to
    depth + 1 drafts (a random one accepts almost none, and the comparison would say little): over a 48-token
    draft vocabulary (d2t in their tree) or the whole vocabulary (their constructor drops d2t/t2d)."""
    torch.manual_seed(1)
    batch = fitted_batch(target, PROMPTS, N + 8)
    vocab = vocab_of(batch, 48) if request.param == "draft-vocabulary" else None
    model = Eagle3Model.from_target(target, vocab)
    train(model, batch, steps=STEPS)
    return model.eval()


def pair(target, model, ours: Eagle3Options, theirs: Eagle3Options):
    from methods.parity.eagle3 import EagleEaGenerate

    drafter = Eagle3Drafter(ours, model=model)
    drafter.setup(target)
    reference = EagleEaGenerate()
    reference.source = SNAPSHOT
    reference.version()
    reference.load(target, drafter, theirs)
    return drafter, reference


def both(target, drafter, reference, ids):
    rec = generate(target, drafter, ids, GenerationConfig(N, SamplingParams(0.0), seed=0))
    return rec, reference.generate(ids, N)


@pytest.mark.parametrize("options", [Eagle3Options(), SMALL], ids=["their-defaults", "small-tree"])
def test_their_eagenerate_gives_our_tokens_and_per_step_accept_lengths(target, drafter_model, options):
    drafter, reference = pair(target, drafter_model, options, options)
    accepted = 0
    for ids in PROMPTS:
        rec, got = both(target, drafter, reference, ids)
        assert got.tokens == rec.new_tokens
        assert got.accept_lengths == rec.accept_lengths
        assert got.decode_seconds > 0
        accepted += sum(rec.accept_lengths)
    assert accepted >= 10  # enough accepted drafts for the per-step comparison to mean something


def test_adapter_declares_their_defaults_for_both_sides():
    from methods.parity.eagle3 import EagleEaGenerate
    from specbench.options import parse

    assert parse(Eagle3Options, EagleEaGenerate.options, "eagle3") == Eagle3Options(top_k=10, depth=7, total_tokens=60)


@pytest.mark.parametrize("change", ["perturbed-drafter-weight", "another-tree"])
def test_a_difference_on_their_side_only_is_told_apart(target, drafter_model, change):
    """Negative controls: one drafter weight changed in their model only, or their tree grown with another top_k,
    leaves the text lossless but must change the per-step accept lengths."""
    theirs = SMALL if change == "perturbed-drafter-weight" else Eagle3Options(top_k=3, depth=3, total_tokens=20)
    drafter, reference = pair(target, drafter_model, SMALL, theirs)
    if change == "perturbed-drafter-weight":
        with torch.no_grad():
            reference.model.ea_layer.midlayer.mlp.down_proj.weight.mul_(3.0)
    same = []
    for ids in PROMPTS:
        rec, got = both(target, drafter, reference, ids)
        assert got.tokens == rec.new_tokens  # greedy verification is lossless whatever the drafts
        same.append(got.accept_lengths == rec.accept_lengths)
    assert not all(same)
