"""DFlash (methods/dflash/drafter.py) on tiny random targets: block-local training masks, training that
learns and matches inference, checkpoints (ours and the published layout), and greedy generation
through the engine equal to the vanilla baseline."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from methods.dflash.drafter import (DFlashDrafter, DFlashModel, DFlashOptions, block_labels, choose_mask_token,
                            default_layer_ids, sample_anchors, training_mask)
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine.drafter import DecodeState
from specbench.engine.registry import create_drafter, method_class
from specbench.engine.loop import GenerationConfig, generate
from specbench.errors import SpecbenchError
from specbench.engine.timing import PhaseTimer
from specbench.training.batch import TrainBatch
from specbench.engine.verify import SamplingParams
from tiny import tiny_target

LAYERS = 6  # taps [1, 3] for a 2-layer drafter
VOCAB = 64
INIT = 0.5  # peaked target distributions, so there is something to learn
BLOCK = 5
MASK = VOCAB - 1
PROMPTS = [[3, 17, 5, 42, 8], [1, 2, 3], [60, 7, 7, 7, 19, 33, 2, 9, 41]]


@pytest.fixture(scope="module")
def target():
    return tiny_target(0, layers=LAYERS, init=INIT)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


def make_batch(target, seed: int = 0, rows: int = 6, prompt_len: int = 4, new: int = 40) -> TrainBatch:
    """Target-regenerated sequences (greedy); the last row is right-padded by 5 tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([greedy(target.model, torch.randint(0, VOCAB - 1, (prompt_len,), generator=gen).tolist(), new)
                        for _ in range(rows)])
    attention = torch.ones_like(ids)
    attention[-1, -5:] = 0
    ids[-1, -5:] = 0
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, prompt_len:] = 1
    loss_mask *= attention
    with torch.no_grad():
        hidden = target.model(ids, attention_mask=attention, output_hidden_states=True).hidden_states
    taps = {i: hidden[i].float() for i in range(len(hidden))} | {-1: hidden[-1].float()}
    return TrainBatch(ids, attention, loss_mask, taps, target.model.lm_head)


def new_model(target, seed: int = 0, **kwargs) -> DFlashModel:
    torch.manual_seed(seed)
    return DFlashModel.from_target(target, layers=2, block_size=BLOCK, mask_token_id=MASK, **kwargs)


def train(model: DFlashModel, batch: TrainBatch, steps: int = 40, lr: float = 1e-2) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        loss, metrics = model.training_loss(batch, anchors=16)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(metrics["loss"])
    return losses


_HISTORY: dict[str, object] = {}


@pytest.fixture(scope="module")
def trained(target):
    """A drafter trained 40 steps; its held-in metrics before/after and its losses are kept."""
    model = new_model(target, 1)
    batch = make_batch(target)
    model.eval()
    _HISTORY["before"] = model.training_loss(batch)[1]
    _HISTORY["losses"] = train(model, batch)
    model.eval()
    _HISTORY["after"] = model.training_loss(batch)[1]
    return model


def ready(drafter, target):
    drafter.setup(target)
    return drafter


_BASELINES: dict[tuple, list[int]] = {}


def baseline(target, prompt, config):
    key = (id(target), tuple(prompt), config)
    if key not in _BASELINES:
        _BASELINES[key] = generate(target, ready(VanillaDrafter(), target), prompt, config).new_tokens
    return _BASELINES[key]


# ---- configuration -----------------------------------------------------------------------------
def test_default_taps_are_evenly_spaced_one_per_layer():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # docs/methods.md#dflash's example
    assert default_layer_ids(30, 1) == [15] and default_layer_ids(30, 3) == [1, 14, 27]


def test_mask_token_is_an_unused_added_token():
    # SmolLM2's added tokens are ids 0..16 (0-2 special: endoftext, im_start, im_end); it has no mask token.
    tok = SimpleNamespace(mask_token_id=None, all_special_ids=[0, 1, 2], added_tokens_decoder=dict.fromkeys(range(17)))
    assert choose_mask_token(tok, []) == 16  # <empty_output>
    assert choose_mask_token(tok, [{"prompt_ids": [1, 5], "response_ids": [16, 7]}]) == 15  # 16 is used here
    assert choose_mask_token(SimpleNamespace(mask_token_id=9), []) == 9
    with pytest.raises(SpecbenchError, match="MASK"):
        choose_mask_token(SimpleNamespace(mask_token_id=None, all_special_ids=[0], added_tokens_decoder={0: 0}), [])


# ---- training masks --------------------------------------------------------------------------
def test_anchors_are_assistant_tokens_with_a_full_block():
    loss = torch.zeros(3, 60, dtype=torch.long)
    attn = torch.ones_like(loss)
    loss[0, 10:] = 1
    loss[1, 10:50] = 1
    attn[1, 50:] = 0
    loss[2, 40:] = 1  # 20 assistant tokens < 32: dropped
    starts, valid = sample_anchors(loss, attn, BLOCK, 100)
    assert valid.sum(1).tolist() == [60 - BLOCK - 10 + 1, 50 - BLOCK - 10 + 1, 0]
    for row, end in ((0, 60), (1, 50)):
        a = starts[row][valid[row]]
        assert int(a.min()) == 10 and int(a.max()) == end - BLOCK
    capped, capped_valid = sample_anchors(loss, attn, BLOCK, 7, torch.Generator().manual_seed(0))
    assert capped_valid.sum(1).tolist() == [7, 7, 0] and bool((capped[:2].diff(dim=1) > 0).all())
    assert block_labels(torch.arange(60)[None], torch.tensor([[10]]), BLOCK).tolist() == [[[11, 12, 13, 14]]]


def test_training_mask_is_block_local():
    visible = training_mask(torch.tensor([[3, 6]]), 8, 2)[0]  # two blocks of 2 rows over 8 context positions
    context, blocks = visible[:, :8], visible[:, 8:]
    assert context.tolist() == [[j < 3 for j in range(8)]] * 2 + [[j < 6 for j in range(8)]] * 2
    assert blocks.tolist() == [[True, True, False, False]] * 2 + [[False, False, True, True]] * 2


def test_block_slots_do_not_see_their_targets_tokens(target):
    """Changing every token and feature at or after a block's anchor (except its own bonus x_a)
    and every other block's tokens leaves that block's outputs unchanged; the later block changes."""
    model = new_model(target).eval()
    batch = make_batch(target, rows=1)
    starts = torch.tensor([[10, 25]])
    with torch.no_grad():
        before = model.block_hidden(batch.input_ids, batch.taps, starts)
        ids = batch.input_ids.clone()
        ids[0, 11:] = (ids[0, 11:] + 7) % (VOCAB - 1)
        taps = {k: v.clone() for k, v in batch.taps.items()}
        for v in taps.values():
            v[0, 10:] += torch.randn_like(v[0, 10:])
        after = model.block_hidden(ids, taps, starts)
    torch.testing.assert_close(after[:, 0], before[:, 0], atol=0, rtol=0)
    assert not torch.allclose(after[:, 1], before[:, 1])


# ---- training ------------------------------------------------------------------------------------
def test_training_loss_falls_and_leaves_the_target_alone(target, trained):
    before, after, losses = _HISTORY["before"], _HISTORY["after"], _HISTORY["losses"]
    assert set(before) == {"loss", "chain_len"} | {f"acc_{k}" for k in range(1, BLOCK)}
    assert losses[-1] < 0.5 * losses[0] and after["acc_1"] > before["acc_1"] + 0.3
    assert after["chain_len"] > 1.3
    assert target.model.lm_head.weight.grad is None and target.model.get_input_embeddings().weight.grad is None
    assert not any(k.startswith(("embed", "lm_head")) for k in trained.state_dict())


def test_reduced_vocabulary_maps_ids_and_masks_labels_outside_it(target):
    vocab_ids = torch.arange(0, VOCAB, 2)  # even ids only
    model = new_model(target, vocab_ids=vocab_ids)
    loss, _ = model.training_loss(make_batch(target, rows=2))
    assert torch.isfinite(loss) and model.logits(torch.zeros(1, 32)).shape == (1, VOCAB // 2)
    assert model.to_target_ids(torch.tensor([0, 3])).tolist() == [0, 6]
    assert model.to_draft_ids(torch.tensor([6, 7])).tolist() == [3, -1]


def test_training_block_equals_the_inference_block(target, trained):
    """The drafter's incremental inference (cached context K/V, then one block) reproduces the
    training forward of the same anchor: same keys, positions and visibility."""
    batch = make_batch(target, rows=1)
    ids = batch.input_ids[0].tolist()
    a = 20
    with torch.no_grad():
        train_logits = trained.logits(trained.block_hidden(batch.input_ids, batch.taps, torch.tensor([[a]]))[0, 0, 1:])
    drafter = ready(DFlashDrafter(model=trained), target)
    state = DecodeState(tokens=ids[:8], prompt_len=7, params=SamplingParams(), timer=PhaseTimer())
    drafter.begin(state, type("Prefill", (), {"taps": {k: v[0, :7] for k, v in batch.taps.items()}})())
    drafter.block_log_probs(state)  # caches positions 0..6
    drafter.pending = trained.features({k: v[0, 7:a] for k, v in batch.taps.items()})
    state.tokens = ids[: a + 1]
    log_q = drafter.block_log_probs(state)
    torch.testing.assert_close(log_q, train_logits.float().log_softmax(-1), atol=1e-5, rtol=1e-5)


# ---- checkpoints ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_save_load_round_trips_exactly(tmp_path, target, trained, dtype):
    trained.save(tmp_path, target, recipe={"steps": 40}, dtype=dtype)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["method"] == "dflash"
    assert config["dflash_config"] == {"target_layer_ids": [1, 3], "mask_token_id": MASK}
    loaded = DFlashModel.load(tmp_path, target)
    expected = {k: v.to(dtype) if dtype and v.is_floating_point() else v for k, v in trained.state_dict().items()}
    got = loaded.state_dict()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_checkpoint_refused_for_another_target_or_when_corrupt(tmp_path, target, trained):
    trained.save(tmp_path, target, recipe={})
    with pytest.raises(SpecbenchError, match="hidden_size"):
        DFlashModel.load(tmp_path, tiny_target(0, layers=LAYERS, init=INIT, hidden=48))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecbenchError, match="corrupt"):
        DFlashModel.load(tmp_path, target)
    with pytest.raises(SpecbenchError, match="dflash"):
        ready(DFlashDrafter(DFlashOptions(path=str(tmp_path / "missing"))), target)


def published_checkpoint(folder, target, layers: int = 2, extra_key: str = "", drop: str = "",
                         num_target_layers: int = LAYERS) -> DFlashModel:
    """Write config.json + model.safetensors the way z-lab publishes DFlash drafters (random values);
    returns a model holding the same weights."""
    cfg = target.config
    reference = new_model(target, 7)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in reference.state_dict().items()}
    reference.load_state_dict(state)
    if extra_key:
        state[extra_key] = torch.zeros(2)
    state.pop(drop, None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
              "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
              "head_dim": cfg.hidden_size // cfg.num_attention_heads, "intermediate_size": cfg.intermediate_size,
              "num_hidden_layers": layers, "num_target_layers": num_target_layers, "rms_norm_eps": 1e-6,
              "vocab_size": VOCAB, "block_size": BLOCK, "rope_theta": 10000.0, "max_position_embeddings": 512,
              "dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": MASK}, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    return reference


def test_published_layout_loads_and_drafts_like_ours(tmp_path, target):
    reference = published_checkpoint(tmp_path, target)
    loaded = DFlashModel.load(tmp_path, target)
    assert loaded.taps == (2, 4) and loaded.block_size == BLOCK and loaded.config.mask_token_id == MASK
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    drafter = ready(DFlashDrafter(DFlashOptions(path=str(tmp_path))), target)
    config = GenerationConfig(max_new_tokens=20)
    assert generate(target, drafter, PROMPTS[0], config).new_tokens == baseline(target, PROMPTS[0], config)


@pytest.mark.parametrize("case,match", [
    ("extra", "does not map"), ("missing", "lacks keys"), ("layers", "30-layer target"), ("no_mask", "mask_token_id"),
])
def test_published_layout_errors_are_one_line(tmp_path, target, case, match):
    kwargs = {"extra": {"extra_key": "layers.0.attention_conv.base_kernel"}, "missing": {"drop": "fc.weight"},
              "layers": {"num_target_layers": 30}, "no_mask": {}}[case]
    published_checkpoint(tmp_path, target, **kwargs)
    if case == "no_mask":
        raw = json.loads((tmp_path / "config.json").read_text())
        del raw["dflash_config"]["mask_token_id"]
        (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(SpecbenchError, match=match) as err:
        DFlashModel.load(tmp_path, target)
    assert "\n" not in str(err.value)


# ---- generation through the engine -------------------------------------------------------------
@pytest.mark.parametrize("which", ["random", "trained"])
def test_greedy_equals_baseline(target, trained, which):
    model = trained if which == "trained" else new_model(target, 5).eval()
    drafter = ready(DFlashDrafter(model=model), target)
    config = GenerationConfig(max_new_tokens=40)
    accepted = 0
    for prompt in PROMPTS:
        record = generate(target, drafter, prompt, config)
        assert record.new_tokens == baseline(target, prompt, config)
        assert set(record.tree_sizes) == {BLOCK - 1} and record.forwards["drafter"] == record.n_verify
        accepted += sum(record.accept_lengths)
    if which == "trained":
        assert accepted > 0  # long accepted chains exercise the drafter's context bookkeeping


def test_registered_as_a_method():
    assert method_class("dflash") is DFlashDrafter
    assert isinstance(create_drafter("dflash", {"path": "x"}).options, DFlashOptions)
