"""DFlash layouts beyond the first z-lab release (methods/dflash/drafter.py, methods/checkpoints.py): per-layer
attention types (sliding layers run causal and windowed, never silently bidirectional), target_layer_ids at
the config's top level, sharded weights, and DFlash-2 refused in one line. Tiny random configs and weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from methods.checkpoints import read_published_weights
from methods.dflash.drafter import DFlashDrafter, DFlashModel, DFlashOptions
from specbench.engine.loop import GenerationConfig, generate
from specbench.errors import SpecbenchError
from test_dflash import BLOCK, LAYERS, MASK, PROMPTS, baseline, published_checkpoint, ready
from tiny import tiny_target

CONTEXT = 10  # committed positions before the block in the forward tests
WINDOW = 3


@pytest.fixture(scope="module")
def target():
    return tiny_target(0, layers=LAYERS, init=0.5)


def edit_config(folder, **changes) -> dict:
    raw = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw))
    return raw


def sliding_checkpoint(folder, target, **changes) -> DFlashModel:
    """The published layout with both drafter layers sliding (window WINDOW), as newer z-lab configs declare."""
    published_checkpoint(folder, target)
    edit_config(folder, **{"layer_types": ["sliding_attention"] * 2, "use_sliding_window": True,
                           "sliding_window": WINDOW, **changes})
    return DFlashModel.load(folder, target).eval()


def block_forward(model: DFlashModel, features: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One inference-shaped forward: context rows at 0..CONTEXT-1, the block right after them."""
    with torch.no_grad():
        kv = model.context_kv(model.context(features), torch.arange(CONTEXT)[None])
        return model(ids, torch.arange(CONTEXT, CONTEXT + BLOCK)[None], kv)[0]


def inputs(model: DFlashModel, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = model.fc.weight.shape[1]
    return torch.randn(1, CONTEXT, width, generator=gen), torch.randint(0, MASK, (1, BLOCK), generator=gen)


def changed_rows(model: DFlashModel, *, block_slot: int | None = None, context_pos: int | None = None) -> list[int]:
    """Block rows whose output moves when one block token or one context row changes."""
    features, ids = inputs(model)
    before = block_forward(model, features, ids)
    features2, ids2 = features.clone(), ids.clone()
    if block_slot is not None:
        ids2[0, block_slot] = (ids2[0, block_slot] + 1) % MASK
    if context_pos is not None:
        features2[0, context_pos] += 1.0
    after = block_forward(model, features2, ids2)
    return [i for i in range(BLOCK) if not torch.allclose(before[i], after[i], atol=1e-6)]


# ---- per-layer attention types ---------------------------------------------------------------------
def test_sliding_layers_are_causal_inside_the_block(tmp_path, target):
    model = sliding_checkpoint(tmp_path, target)
    assert [model.config.layer_attention(i) for i in range(2)] == [(True, WINDOW)] * 2
    assert changed_rows(model, block_slot=2) == [2, 3, 4]  # a token moves itself and the rows after it only
    edit_config(tmp_path, layer_types=None, use_sliding_window=None, sliding_window=None)
    full = DFlashModel.load(tmp_path, target).eval()  # negative control: the same weights, full attention
    assert changed_rows(full, block_slot=2) == [0, 1, 2, 3, 4]


def test_sliding_layers_see_only_the_window(tmp_path, target):
    model = sliding_checkpoint(tmp_path, target)
    # Block rows sit at 10..14; with window 3 row 10 sees 8..10, so context position 2 is out of every window.
    assert changed_rows(model, context_pos=2) == []
    # Position 9 reaches rows 10, 11 in layer 1; layer 2 carries it to rows 12, 13 but not to row 14 (sees 12..14).
    assert changed_rows(model, context_pos=9) == [0, 1, 2, 3]
    edit_config(tmp_path, layer_types=None, use_sliding_window=None, sliding_window=None)
    assert changed_rows(DFlashModel.load(tmp_path, target).eval(), context_pos=2) == [0, 1, 2, 3, 4]


def test_is_causal_false_keeps_sliding_layers_bidirectional_within_the_window(tmp_path, target):
    """z-lab reads the config's is_causal first: False makes a sliding layer see |query - key| < window both ways."""
    model = sliding_checkpoint(tmp_path, target, layer_types=["sliding_attention", "full_attention"], is_causal=False)
    assert [model.config.layer_attention(i) for i in range(2)] == [(False, WINDOW), (False, 0)]
    assert changed_rows(model, block_slot=4)[:1] == [0]  # the full layer after it reads the whole block
    both = sliding_checkpoint(tmp_path, target, sliding_window=2, is_causal=False)
    # Window 2 = the next row both ways, per layer: position 14 reaches 13 in layer 1, then 12 in layer 2.
    assert changed_rows(both, block_slot=4) == [2, 3, 4]
    assert changed_rows(both, block_slot=0) == [0, 1, 2]


def test_sliding_window_needs_use_sliding_window_as_qwen3_config_reads_it(tmp_path, target):
    """transformers' Qwen3Config drops sliding_window unless use_sliding_window: z-lab then runs the layer causal
    over all keys; without layer_types, layers from max_window_layers on slide."""
    model = sliding_checkpoint(tmp_path, target, use_sliding_window=False)
    assert [model.config.layer_attention(i) for i in range(2)] == [(True, 0)] * 2
    derived = sliding_checkpoint(tmp_path, target, layer_types=None, max_window_layers=1)
    assert [derived.config.layer_attention(i) for i in range(2)] == [(False, 0), (True, WINDOW)]


def test_sliding_drafter_is_lossless_through_the_engine(tmp_path, target):
    sliding_checkpoint(tmp_path, target)
    drafter = ready(DFlashDrafter(DFlashOptions(path=str(tmp_path))), target)
    assert drafter.model.config.layer_types == ["sliding_attention"] * 2
    config = GenerationConfig(max_new_tokens=24)
    for prompt in PROMPTS:
        record = generate(target, drafter, prompt, config)
        assert record.new_tokens == baseline(target, prompt, config)
        assert set(record.tree_sizes) == {BLOCK - 1}


def test_training_forward_uses_the_layer_masks(tmp_path, target):
    """The training block (several blocks in one forward) equals the inference block for sliding layers too."""
    model = sliding_checkpoint(tmp_path, target)
    gen = torch.Generator().manual_seed(3)
    t = 16
    ids = torch.randint(0, MASK, (1, t), generator=gen)
    taps = {i: torch.randn(1, t, target.hidden_size, generator=gen) for i in model.taps}
    starts = torch.tensor([[4, 9]])
    with torch.no_grad():
        both = model.block_hidden(ids, taps, starts)[0]
        context = model.context(model.features(taps))
        for n, a in enumerate(starts[0].tolist()):
            kv = model.context_kv(context[:, :a], torch.arange(a)[None])
            block = torch.full((1, BLOCK), MASK)
            block[0, 0] = ids[0, a]
            one = model(block, torch.arange(a, a + BLOCK)[None], kv)[0]
            torch.testing.assert_close(both[n], one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("changes,match", [
    ({"layer_types": ["chunked_attention", "full_attention"]}, "chunked_attention"),
    ({"layer_types": ["sliding_attention"]}, "layer_types for 1 layers but num_hidden_layers=2"),
    ({"layer_types": ["sliding_attention"] * 2, "use_sliding_window": True, "sliding_window": 0}, "sliding_window=0"),
])
def test_bad_layer_types_are_one_line(tmp_path, target, changes, match):
    published_checkpoint(tmp_path, target)
    edit_config(tmp_path, **changes)
    with pytest.raises(SpecbenchError, match=match) as err:
        DFlashModel.load(tmp_path, target)
    assert "\n" not in str(err.value)


# ---- where the config keeps its settings -----------------------------------------------------------
def test_target_layer_ids_and_mask_id_at_the_top_level(tmp_path, target):
    published_checkpoint(tmp_path, target)
    edit_config(tmp_path, dflash_config=None, target_layer_ids=[0, 2], mask_token_id=MASK - 1)
    model = DFlashModel.load(tmp_path, target)
    assert model.taps == (1, 3) and model.config.mask_token_id == MASK - 1
    edit_config(tmp_path, dflash_config={"target_layer_ids": [1, 3]})  # dflash_config wins, as z-lab reads it
    assert DFlashModel.load(tmp_path, target).taps == (2, 4)
    edit_config(tmp_path, num_target_layers=None)  # z-lab's config need not name the target's depth
    assert DFlashModel.load(tmp_path, target).taps == (2, 4)


# ---- DFlash-2 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes", [
    {"architectures": ["DFlash2DraftModel"]},
    {"dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": MASK, "selector_rank": 8, "selector_top_k": 4}},
    {"speculators_model_type": "dflash2"},
])
def test_dflash2_is_refused_in_one_line_naming_what_is_missing(tmp_path, target, changes):
    published_checkpoint(tmp_path, target)
    edit_config(tmp_path, **changes)
    with pytest.raises(SpecbenchError) as err:
        DFlashModel.load(tmp_path, target)
    text = str(err.value)
    assert "\n" not in text and "DFlash-2" in text and "convolutions" in text and "candidate selector" in text


# ---- sharded weights -----------------------------------------------------------------------------------
def shard(folder, state: dict, suffix: str = ".safetensors") -> None:
    """HF's sharded layout: two weight files and <name>.index.json's weight_map."""
    keys = sorted(state)
    halves = {f"model-0000{i + 1}-of-00002{suffix}": keys[i::2] for i in range(2)}
    weight_map = {}
    for name, part in halves.items():
        tensors = {k: state[k].contiguous() for k in part}
        if suffix == ".safetensors":
            save_file(tensors, str(folder / name))
        else:
            torch.save(tensors, folder / name)
        weight_map.update({k: name for k in part})
    index = "model.safetensors.index.json" if suffix == ".safetensors" else "pytorch_model.bin.index.json"
    (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_weights_load_like_one_file(tmp_path, target):
    reference = published_checkpoint(tmp_path, target)
    (tmp_path / "model.safetensors").unlink()
    shard(tmp_path, reference.state_dict())
    loaded = DFlashModel.load(tmp_path, target)
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    config = GenerationConfig(max_new_tokens=16)
    drafter = ready(DFlashDrafter(DFlashOptions(path=str(tmp_path))), target)
    assert generate(target, drafter, PROMPTS[1], config).new_tokens == baseline(target, PROMPTS[1], config)


def test_sharded_torch_pickles_load(tmp_path):
    state = {"a.weight": torch.randn(3, 2), "b.weight": torch.randn(2), "c.bias": torch.randn(4)}
    shard(tmp_path, state, suffix=".bin")
    got = read_published_weights(tmp_path, ("model.safetensors", "pytorch_model.bin"), "EAGLE-3")
    assert set(got) == set(state) and all(torch.equal(got[k], v) for k, v in state.items())


@pytest.mark.parametrize("damage,match", [("shard", "lacks"), ("index", "not a shard index"), ("key", "maps keys")])
def test_damaged_shards_are_one_line(tmp_path, damage, match):
    state = {"a.weight": torch.randn(3, 2), "b.weight": torch.randn(2)}
    shard(tmp_path, state)
    index = tmp_path / "model.safetensors.index.json"
    if damage == "shard":
        (tmp_path / "model-00002-of-00002.safetensors").unlink()
    elif damage == "index":
        index.write_text("{}")
    else:
        raw = json.loads(index.read_text())
        raw["weight_map"]["z.weight"] = "model-00001-of-00002.safetensors"
        index.write_text(json.dumps(raw))
    with pytest.raises(SpecbenchError, match=match) as err:
        read_published_weights(tmp_path, ("model.safetensors",), "DFlash")
    assert "\n" not in str(err.value)


# ---- parity with z-lab's own classes (when the reference package is installed) -----------------------
@pytest.mark.parametrize("layout", [
    {"layer_types": ["sliding_attention", "full_attention"]},
    {"layer_types": ["sliding_attention"] * 2, "is_causal": False},
    {"layer_types": ["full_attention"] * 2, "is_causal": True},
])
def test_layer_types_match_zlab_dflash(tmp_path, target, layout):
    """Our forward of a drafter saved by z-lab's own DFlashDraftModel equals theirs; the negative control (the
    same weights read as all-full bidirectional layers, the old behaviour) does not."""
    zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash package is not installed (pip install dflash)")
    from transformers import Qwen3Config

    cfg = target.config
    draft_cfg = Qwen3Config(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                            num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads,
                            intermediate_size=cfg.intermediate_size, num_hidden_layers=2, vocab_size=cfg.vocab_size,
                            rms_norm_eps=1e-6, max_position_embeddings=512, use_sliding_window=True,
                            sliding_window=WINDOW, tie_word_embeddings=False, num_target_layers=LAYERS,
                            block_size=BLOCK, dflash_config={"target_layer_ids": [1, 3], "mask_token_id": MASK},
                            **layout)
    torch.manual_seed(0)
    reference = zlab.DFlashDraftModel(draft_cfg).float().eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reference.save_pretrained(tmp_path)
    ours = DFlashModel.load(tmp_path, target).eval()
    features, ids = inputs(ours, seed=1)
    positions = torch.arange(CONTEXT + BLOCK)[None]
    with torch.no_grad():
        noise = target.model.get_input_embeddings()(ids)
        theirs = reference(target_hidden=features, noise_embedding=noise, position_ids=positions)[0]
        mine = ours.norm(block_forward(ours, features, ids))
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
        ours.config.layer_types, ours.config.is_causal = [], None  # negative control
        assert (ours.norm(block_forward(ours, features, ids)) - theirs).abs().max() > 1e-3


def test_sharded_eagle3_checkpoint_loads_through_its_loader(tmp_path):
    """The same shard reader serves the other published-layout loaders (EAGLE-3 here, as its repository ships
    large drafters)."""
    import test_eagle3 as e3
    from methods.eagle3.drafter import Eagle3Drafter, Eagle3Options

    target = tiny_target(0, layers=e3.LAYERS, init=e3.INIT)
    written = e3.official_checkpoint(tmp_path, target, "safetensors")
    (tmp_path / "model.safetensors").unlink()
    shard(tmp_path, written)
    drafter = ready(Eagle3Drafter(Eagle3Options(path=str(tmp_path), top_k=4, depth=3, total_tokens=20)), target)
    for key, value in drafter.model.state_dict().items():
        assert torch.equal(value, written[key].to(value.dtype)), key
