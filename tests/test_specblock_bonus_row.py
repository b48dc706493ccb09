"""SpecBlock's two block-1 conventions (``bonus_row``, methods/specblock/model.py): ``once`` (each committed
pair's row group is block 1) and ``duplicate`` (the authors' inference code: a copy of the last pair one
position later). They draft differently; the duplicate copy drafted from the cache equals a from-scratch
forward over the same rows; training and inference agree in both; checkpoints record the convention and
drafters run it unless told otherwise, each record saying which ran."""

import json

import pytest
import torch

from methods.specblock.drafter import SpecBlockDrafter, SpecBlockOptions
from methods.specblock.checkpoint import load_specblock, save_specblock
from methods.specblock.model import SpecBlockConfig
from methods.specblock.objective import (LossSettings, SpecBlockLoss, block1_mask, block1_pass, cross_block_mask,
                                     duplicate_mask)
from specbench.engine.drafter import DecodeState
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.verify import SamplingParams
from specbench.errors import SpecbenchError
from test_eagle3 import LAYERS, PROMPTS, make_batch
from test_lossless import baseline, ready
from test_specblock import K, fresh
from tiny import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(0, layers=LAYERS, init=0.5)


@pytest.fixture(scope="module")
def model(target):
    """A random drafter whose layer-wise shift mixes slots (a new one starts as the identity)."""
    m = fresh(target, seed=3)
    with torch.no_grad():
        for proj in m.shift_proj:
            torch.nn.init.normal_(proj.weight, std=0.3)
    return m


def first_block(drafter, target, prompt, bonus) -> tuple[torch.Tensor, torch.Tensor]:
    """Block 1's logits and rank logits for ``prompt`` + ``bonus``, from the drafter's own cache path."""
    state = DecodeState(tokens=list(prompt) + [bonus], prompt_len=len(prompt), params=SamplingParams())
    drafter.begin(state, target.prefill(list(prompt), taps=drafter.taps))
    with torch.inference_mode():
        out, _, _ = drafter._encode(state)
    return out.logits[0, -K:], out.rank_logits[0, -K:]


def test_the_two_conventions_draft_differently(target, model):
    prompt = PROMPTS[2]
    once, _ = first_block(ready(SpecBlockDrafter(SpecBlockOptions(bonus_row="once"), model=model), target), target,
                          prompt, 5)
    dup, _ = first_block(ready(SpecBlockDrafter(SpecBlockOptions(bonus_row="duplicate"), model=model), target),
                         target, prompt, 5)
    assert float((once - dup).abs().max()) > 1e-2


def test_duplicate_copy_from_the_cache_equals_a_fresh_forward(target, model):
    """After a few verify steps, the drafter's cache plus its transient copy of the last pair give the
    block that one sequential forward over every committed pair's context row and the copy gives."""
    drafter = ready(SpecBlockDrafter(SpecBlockOptions(budget=24, beam_width=4, bonus_row="duplicate"), model=model),
                    target)
    seen = []
    encode = drafter._encode

    def spy(state):
        out, transient, rows = encode(state)
        seen.append((list(state.tokens), out.logits[0, -K:].clone(), out.hidden[0, -K:].clone(), rows))
        return out, transient, rows

    drafter._encode = spy
    record = generate(target, drafter, PROMPTS[0], GenerationConfig(max_new_tokens=16))
    assert record.n_verify > 2
    for tokens, logits, hidden, rows in seen[1:]:
        n = len(tokens) - 1  # committed pairs (taps j, token j+1), j < n
        assert rows == (n + 1) * K  # n context groups in the cache, then the copy
        feats = model.features(target.prefill(tokens[:n], taps=model.taps).taps)[None]  # [1, n, 3H]
        ids = torch.tensor([tokens[1:]])
        positions = (torch.arange(n + 1)[:, None] + 1 + torch.arange(K)).reshape(1, -1)  # the copy at n
        with torch.inference_mode():
            full = model(torch.cat([feats, feats[:, -1:]], 1), torch.cat([ids, ids[:, -1:]], 1), positions,
                         block1_mask(n + 1, K))
        torch.testing.assert_close(logits, full.logits[0, -K:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden, full.hidden[0, -K:], atol=1e-4, rtol=1e-4)


def test_cache_holds_only_the_committed_pairs_in_both_conventions(target, model):
    for bonus_row in ("once", "duplicate"):
        drafter = ready(SpecBlockDrafter(SpecBlockOptions(budget=24, beam_width=4, bonus_row=bonus_row), model=model),
                        target)
        generate(target, drafter, PROMPTS[1], GenerationConfig(max_new_tokens=12))
        assert drafter.cache[0][0].shape[2] == drafter.encoded * K, bonus_row


@pytest.mark.parametrize("bonus_row", ["once", "duplicate"])
def test_greedy_equals_baseline_in_both_conventions(target, model, bonus_row):
    drafter = ready(SpecBlockDrafter(SpecBlockOptions(budget=24, beam_width=4, blocks=3, bonus_row=bonus_row),
                                     model=model), target)
    config = GenerationConfig(max_new_tokens=24)
    for prompt in PROMPTS:
        record = generate(target, drafter, prompt, config)
        assert record.new_tokens == baseline(target, prompt, config)
        assert record.extra["bonus_row"] == bonus_row and record.extra["bonus_row_trained"] == "once"


@pytest.mark.parametrize("bonus_row", ["once", "duplicate"])
def test_training_matches_inference_in_both_conventions(target, bonus_row):
    """Block 1 at index j and a block-2 start (cut s) of the training pass equal what the drafter
    computes at inference over the same committed pairs."""
    model = fresh(target, seed=4, bonus_row=bonus_row)
    batch = make_batch(target, rows=1)
    feats, ids = model.features(batch.taps), batch.input_ids
    t, j, s = ids.shape[1], 9, 2
    tokens = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    with torch.no_grad():
        out1, past = block1_pass(model, feats, tokens, bonus_row)
        # inference: the drafter's cache over pairs 0..j, block 1 of pair j
        drafter = ready(SpecBlockDrafter(SpecBlockOptions(), model=model), target)
        drafter.cache, drafter.encoded, drafter.pending = None, 0, feats[0, : j + 1]
        state = DecodeState(tokens=ids[0, : j + 2].tolist(), prompt_len=j + 1, params=SamplingParams())
        with torch.inference_mode():
            block, transient, rows = drafter._encode(state)
        torch.testing.assert_close(block.logits[0, -K:], out1.logits[0, j * K: (j + 1) * K], atol=1e-5, rtol=1e-5)
        # block 2 from slot s-1 of that block, the training way and the inference way
        cond = out1.hidden.view(1, t, K, -1)[:, j, s - 1][:, None]
        start_token = ids[:, j + s: j + s + 1]
        offset = 1 if bonus_row == "duplicate" else 0
        positions = (j + 1 + offset + torch.arange(K))[None]
        vis = cross_block_mask(torch.tensor([[j]]), torch.tensor([[s]]), t, K, bonus_row)
        train2 = model(cond, start_token, positions, vis, past=past)
        visible = torch.ones(rows, dtype=torch.bool)
        visible[-K:] = False
        visible[rows - K: rows - K + s] = True
        vis_inf = torch.cat([visible.expand(K, -1), torch.ones(K, K, dtype=torch.bool).tril()], 1)
        cache = [(torch.cat([c[0], tr[0]], 2), torch.cat([c[1], tr[1]], 2)) for c, tr in zip(drafter.cache, transient)]
        infer2 = model(cond, start_token, positions, vis_inf, past=cache)
    torch.testing.assert_close(infer2.logits, train2.logits, atol=1e-5, rtol=1e-5)


def test_duplicate_mask_rows():
    mask = duplicate_mask(3, 2)
    context, copies = mask[:6], mask[6:]
    assert torch.equal(context[:, :6], block1_mask(3, 2)) and not context[:, 6:].any()
    assert copies[2, :4].all() and not copies[2, 4:6].any()  # copy of pair 1 sees context rows of pairs 0, 1
    assert copies[3, 8:10].tolist() == [True, True] and copies[2, 8:10].tolist() == [True, False]
    assert not copies[2, 6:8].any()  # no other copy


@pytest.mark.parametrize("bonus_row", ["once", "duplicate"])
def test_a_training_step_runs_and_learns_in_both_conventions(target, bonus_row):
    model = fresh(target, bonus_row=bonus_row).train()
    loss = SpecBlockLoss(model, LossSettings(rank_start=0, cross_fraction=0.5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = make_batch(target, seed=1)
    accuracy = []
    for _ in range(20):
        value, metrics = loss(batch)
        opt.zero_grad()
        value.backward()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        accuracy.append(metrics["acc_1"])
    assert "b2_acc_1" in metrics and "rank_loss" in metrics
    assert accuracy[-1] > accuracy[0] + 0.1


def test_the_two_conventions_train_differently(target):
    batch = make_batch(target, seed=1)
    values = {}
    for bonus_row in ("once", "duplicate"):
        model = fresh(target, seed=2, bonus_row=bonus_row)
        with torch.no_grad():
            values[bonus_row] = float(SpecBlockLoss(model, LossSettings(rank_start=10**9, cross_fraction=0))(batch)[0])
    assert abs(values["once"] - values["duplicate"]) > 1e-4


# ---- checkpoints: the trained convention travels, and is what runs unless told otherwise ----------------
def test_checkpoint_records_the_convention_and_the_drafter_runs_it(tmp_path, target):
    model = fresh(target, bonus_row="duplicate")
    save_specblock(tmp_path, model, target, {}, dtype=None)
    assert json.loads((tmp_path / "config.json").read_text())["architecture"]["bonus_row"] == "duplicate"
    assert load_specblock(tmp_path, target).config.bonus_row == "duplicate"
    drafter = ready(SpecBlockDrafter(SpecBlockOptions(path=str(tmp_path), budget=16)), target)
    record = generate(target, drafter, PROMPTS[0], GenerationConfig(max_new_tokens=6))
    assert record.extra["bonus_row"] == record.extra["bonus_row_trained"] == "duplicate"
    other = ready(SpecBlockDrafter(SpecBlockOptions(path=str(tmp_path), budget=16, bonus_row="once")), target)
    record = generate(target, other, PROMPTS[0], GenerationConfig(max_new_tokens=6))
    assert (record.extra["bonus_row"], record.extra["bonus_row_trained"]) == ("once", "duplicate")


def test_a_checkpoint_without_the_field_was_trained_once(tmp_path, target):
    save_specblock(tmp_path, fresh(target), target, {}, dtype=None)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["architecture"]["bonus_row"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_specblock(tmp_path, target).config.bonus_row == "once"
    drafter = ready(SpecBlockDrafter(SpecBlockOptions(path=str(tmp_path), budget=16)), target)
    assert drafter.bonus_row == "once"


def test_an_unknown_convention_is_one_clear_error(target):
    with pytest.raises(SpecbenchError, match="bonus_row must be one of once, duplicate"):
        SpecBlockConfig.from_target(target, 40, bonus_row="twice")
    with pytest.raises(SpecbenchError, match="bonus_row"):
        SpecBlockDrafter(SpecBlockOptions(bonus_row="twice"))
