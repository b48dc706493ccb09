"""SpecBlock on tiny random targets: in-block causality, the Fig. 3 cross-block mask, the valid-prefix
mask, rank features, rank-guided branching, training/inference agreement, well-formed trees within
budget, lossless generation (greedy and T=1), and checkpoints (ours and the published layout)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from methods.eagle3.drafter import eagle3_taps
from methods.specblock.drafter import SpecBlockDrafter, SpecBlockOptions, SpecBlockUniformTree, _Block, _Trie
from methods.specblock.checkpoint import VOCAB_MAPPING, load_specblock, save_specblock
from methods.specblock.model import RANK_FEATURES, SpecBlockConfig, SpecBlockModel, rank_features, rank_to_bucket
from methods.specblock.objective import LossSettings, SpecBlockLoss, block1_mask, cross_block_mask, valid_prefix
from specbench.engine.drafter import DecodeState
from specbench.engine.registry import create_drafter, method_class
from specbench.engine.loop import GenerationConfig, generate
from specbench.errors import SpecbenchError
from specbench.engine.verify import SamplingParams
from stats import chi2_pvalue
from test_eagle3 import LAYERS, PROMPTS, VOCAB, make_batch, vocab_of
from test_lossless import baseline, ready
from tiny import tiny_target

K = 4
SMALL = SpecBlockOptions(budget=24, beam_width=4)


@pytest.fixture(scope="module")
def target():
    return tiny_target(0, layers=LAYERS, init=0.5)


def fresh(target, draft_vocab: int = 40, seed: int = 0, **overrides) -> SpecBlockModel:
    torch.manual_seed(seed)
    batch = make_batch(target)
    d2t, t2d = vocab_of(batch, draft_vocab)
    model = SpecBlockModel(SpecBlockConfig.from_target(target, draft_vocab, **overrides), eagle3_taps(LAYERS),
                           target.model.get_input_embeddings())
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    return model.eval()


@pytest.fixture(scope="module")
def trained(target):
    model = fresh(target).train()
    loss = SpecBlockLoss(model, LossSettings(rank_start=0, cross_fraction=0.5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = make_batch(target, seed=1)
    for _ in range(40):
        value, _ = loss(batch)
        opt.zero_grad()
        value.backward()
        opt.step()
    return model.eval()


def block_forward(model, target, queries=None):
    batch = make_batch(target, rows=1)
    feats = model.features(batch.taps)[:, 5:6]
    ids = batch.input_ids[:, 6:7]
    with torch.no_grad():
        if queries is not None:
            model.input_layer.position_queries.weight.copy_(queries)
        return model(feats, ids, torch.arange(1, K + 1)[None] + 5, block1_mask(1, K)).logits[0]


# ---- architecture -------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", [{}, {"layer_shift": False}, {"prefix_broadcast": False}],
                         ids=["full", "no-shift", "no-broadcast"])
def test_slot_k_depends_only_on_slots_up_to_k(target, variant):
    model = fresh(target, **variant)
    for proj in model.shift_proj:  # a trained shift mixes in slot k-1 (a new one is the identity)
        torch.nn.init.normal_(proj.weight, std=0.3)
    queries = model.input_layer.position_queries.weight.detach().clone()
    before = block_forward(model, target)
    for k in range(K - 1):
        changed = queries.clone()
        changed[k + 1] += 3.0  # perturb slot k+1's only private input
        after = block_forward(model, target, changed)
        torch.testing.assert_close(after[: k + 1], before[: k + 1], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(after[k + 1], before[k + 1])
    model.input_layer.position_queries.weight.data.copy_(queries)


def test_layer_shift_carries_the_previous_slot():
    hidden = 8
    cfg = SpecBlockConfig(hidden_size=hidden, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                          intermediate_size=16, rms_norm_eps=1e-6, vocab_size=32, draft_vocab_size=32)
    model = SpecBlockModel(cfg, (1, 2, 3))
    with torch.no_grad():
        model.shift_proj[0].weight.zero_()
        model.shift_proj[0].weight[:, hidden:] = torch.eye(hidden)  # W_shift [h_k; h_{k-1}] = h_{k-1}
    x = torch.randn(1, 2 * K, hidden)
    shifted = model._shift(x, 0).view(2, K, hidden)
    blocks = x.view(2, K, hidden)
    torch.testing.assert_close(shifted[:, 1:], blocks[:, :-1])
    torch.testing.assert_close(shifted[:, 0], blocks[:, 0])  # h_{-1} := h_0, and blocks never mix


def test_a_new_drafter_with_the_shift_computes_what_the_no_shift_one_does(target):
    """W_shift starts as [I, 0] and draws nothing from the RNG: same seed, same network until training."""
    full, ablated = fresh(target), fresh(target, layer_shift=False)
    assert len(full.shift_proj) == full.config.num_layers - 1 and not ablated.shift_proj
    h = target.hidden_size
    for proj in full.shift_proj:
        torch.testing.assert_close(proj.weight, torch.cat([torch.eye(h), torch.zeros(h, h)], 1))
    shared = {k: v for k, v in full.state_dict().items() if not k.startswith("shift_proj.")}
    torch.testing.assert_close(shared, ablated.state_dict())
    torch.testing.assert_close(block_forward(full, target), block_forward(ablated, target))


def test_prefix_broadcast_ablation_gives_later_slots_only_their_query(target):
    model = fresh(target, prefix_broadcast=False)
    cond, emb = torch.randn(1, 1, 3 * target.hidden_size), torch.randn(1, 1, target.hidden_size)
    other_cond, other_emb = torch.randn_like(cond), torch.randn_like(emb)
    with torch.no_grad():
        a, b = model.input_layer(cond, emb), model.input_layer(other_cond, other_emb)
    torch.testing.assert_close(a[0, 1:], b[0, 1:])
    assert not torch.allclose(a[0, 0], b[0, 0])


def test_rank_features_are_15_finite_dims():
    for logits in (torch.randn(3, 5, 50), torch.full((2, 50), -1e4).index_fill_(-1, torch.tensor([3]), 1e4)):
        psi = rank_features(logits)
        assert psi.shape[-1] == RANK_FEATURES == 15 and torch.isfinite(psi).all()
    psi = rank_features(torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.5] + [0.0] * 20]))[0]
    torch.testing.assert_close(psi[10:13], torch.tensor([1.0, 2.0, 3.5]))  # gaps to ranks 2, 3, 5
    assert 0 < psi[13] < 1 and psi[14] > 0


def test_rank_buckets_follow_the_paper():
    ranks = torch.tensor([1, 2, 4, 5, 10, 11, 500])
    assert rank_to_bucket(ranks).tolist() == [0, 1, 1, 2, 2, 3, 3]


# ---- masks --------------------------------------------------------------------------------------
def test_cross_block_mask_matches_figure_3():
    """Three committed positions, K = 4; block 2 branches from B_{1,1} of the last position (cut s = 2)."""
    mask = cross_block_mask(torch.tensor([[2]]), torch.tensor([[2]]), groups=3, k=K)[0]
    old, own = mask[:, :12], mask[:, 12:]
    assert old[:, :8].all()  # every slot of the verified prefix's positions
    assert old[:, 8:10].all()  # on-path B_{1,0}, B_{1,1}
    assert not old[:, 10:12].any()  # off-path B_{1,2}, B_{1,3}
    assert torch.equal(own, torch.ones(K, K, dtype=torch.bool).tril())  # block-causal


def test_inference_start_sees_the_figure_3_rows(target, trained):
    """The visibility a block-2 start is given at inference: earlier positions' slots, the
    producing block's slots 0..k, itself causally."""
    drafter = ready(SpecBlockDrafter(SpecBlockOptions(budget=40, beam_width=4), model=trained), target)
    seen = []
    forward = trained.forward

    def spy(condition, token_ids, positions, visible, past=None):
        seen.append((visible.clone(), condition.shape[-1]))
        return forward(condition, token_ids, positions, visible, past)

    trained.forward = spy
    try:
        generate(target, drafter, PROMPTS[0], GenerationConfig(max_new_tokens=2))
    finally:
        del trained.forward
    (block1, _), (block2, width) = seen[0], seen[1]
    n = len(PROMPTS[0])
    assert width == target.hidden_size and block1.shape == (n * K, n * K)
    for row in block2[::K]:  # first slot of each start
        cache = row[: n * K]
        assert cache[: (n - 1) * K].all()
        visible_slots = cache[(n - 1) * K:].tolist()
        s = visible_slots.count(True)
        assert s >= 1 and visible_slots == [True] * s + [False] * (K - s)  # slots 0..k of block 1 only


def test_valid_prefix_mask_zeroes_everything_after_the_first_miss():
    agree = torch.tensor([[True, False, True, True], [True, True, True, False], [False, True, True, True]])
    data_ok = torch.tensor([[True, True, True, True], [True, True, False, True], [True, True, True, True]])
    assert valid_prefix(agree, data_ok).tolist() == [[True, True, False, False], [True, True, False, True],
                                                     [True, False, False, False]]


def test_valid_prefix_changes_which_slots_are_supervised(target):
    batch = make_batch(target)
    losses = {}
    for valid in (True, False):
        model = fresh(target).train()
        value, metrics = SpecBlockLoss(model, LossSettings(valid_prefix=valid, rank_start=10**9))(batch)
        value.backward()
        losses[valid] = float(value.detach())
    assert losses[True] < losses[False]  # an untrained drafter misses early: later slots drop out


def test_training_matches_inference_blocks(target):
    """Block 1 at index j and a block-2 start of the training objective equal the same blocks
    computed the inference way (cache of earlier positions, then a start with its on-path rows)."""
    model = fresh(target, seed=4)
    batch = make_batch(target, rows=1)
    feats, ids = model.features(batch.taps), batch.input_ids
    t, j, s = ids.shape[1], 9, 2
    with torch.no_grad():
        tokens = torch.nn.functional.pad(ids[:, 1:], (0, 1))
        positions = (torch.arange(t)[:, None] + 1 + torch.arange(K)).reshape(1, -1)
        full = model(feats, tokens, positions, block1_mask(t, K))
        prefix = model(feats[:, : j + 1], tokens[:, : j + 1], positions[:, : (j + 1) * K], block1_mask(j + 1, K))
        torch.testing.assert_close(prefix.logits, full.logits[:, : (j + 1) * K], atol=1e-5, rtol=1e-5)
        # training-side block 2 at anchor j, cut s
        cond = full.hidden.view(1, t, K, -1)[:, j, s - 1][:, None]
        vis = cross_block_mask(torch.tensor([[j]]), torch.tensor([[s]]), t, K)
        train2 = model(cond, ids[:, j + s: j + s + 1], positions[:, j * K: (j + 1) * K], vis, past=full.kv)
        # inference-side: only the prefix cache exists
        rows = torch.zeros((j + 1) * K, dtype=torch.bool)
        rows[: j * K] = True
        rows[j * K: j * K + s] = True
        vis_inf = torch.cat([rows.expand(K, -1), torch.ones(K, K, dtype=torch.bool).tril()], 1)
        infer2 = model(cond, ids[:, j + s: j + s + 1], positions[:, j * K: (j + 1) * K], vis_inf, past=prefix.kv)
    torch.testing.assert_close(infer2.logits, train2.logits, atol=1e-5, rtol=1e-5)


def test_training_learns_and_reports_bucket_counts(target):
    model = fresh(target).train()
    loss = SpecBlockLoss(model, LossSettings(rank_start=5, cross_block_start=3, cross_fraction=0.5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = make_batch(target, seed=1)
    first = None
    for step in range(30):
        value, metrics = loss(batch)
        assert ("rank_loss" in metrics) == (step >= 5) and ("b2_acc_1" in metrics) == (step >= 3)
        assert ("b2_rank_loss" in metrics) == (step >= 5)
        opt.zero_grad()
        value.backward()
        opt.step()
        first = first if first is not None else metrics["acc_1"]
    with torch.no_grad():
        _, metrics = loss(batch)
    assert metrics["acc_1"] > first + 0.2
    assert sum(metrics[f"bucket{c}_true"] for c in range(4)) > 0


# ---- tree construction ---------------------------------------------------------------------------
def test_branching_follows_the_buckets():
    drafter = SpecBlockDrafter(SpecBlockOptions(beam_width=10, branching=[2, 4, 10, 0]))
    ids = torch.arange(100, 100 + 10 * K).view(K, 10)
    lp = -torch.arange(10).float().expand(K, -1) * 0.1
    trie = _Trie()
    starts = drafter._expand(trie, -1, 0.0, _Block(lp, ids, [0, 1, 3, 0]), first=True)
    children = {}
    for node in trie.nodes:
        children.setdefault(node.parent, []).append(node.token)
    assert len(children[-1]) == 10  # slot 0: beam width
    greedy = [trie.index[(-1, 100)]]
    assert len(children[greedy[0]]) == 4  # slot 1, bucket 1: b = 4 incl. greedy
    g1 = trie.index[(greedy[0], 110)]
    g2 = trie.index[(g1, 120)]
    assert children[g1] == [120] and children[g2] == [130]  # give-up at slot 2 stops alternatives onwards
    assert sorted(slot for _, slot in starts) == [1, 1, 1, 1, 3]  # slot 1's four tokens + the chain end
    give_up_first = drafter._expand(_Trie(), -1, 0.0, _Block(lp, ids, [0, 3, 0, 0]), first=True)
    assert give_up_first == []  # the chain's first unsure bucket gives up: no chain-end start


@pytest.mark.parametrize("bucket, width", [(0, 2), (2, 10), (3, 1)])
def test_paper_slot0_takes_its_width_from_the_rank_head(bucket, width):
    drafter = SpecBlockDrafter(SpecBlockOptions(slot0="rank", beam_width=10, branching=[2, 4, 10, 0]))
    ids = torch.arange(100, 100 + 10 * K).view(K, 10)
    lp = -torch.arange(10).float().expand(K, -1) * 0.1
    trie = _Trie()
    drafter._expand(trie, -1, 0.0, _Block(lp, ids, [bucket, 0, 0, 0]), first=True)
    assert sum(node.parent == -1 for node in trie.nodes) == width  # Alg. 2: top-b(bucket), give-up keeps the greedy


def test_unknown_slot0_mode_is_one_clear_error():
    with pytest.raises(SpecbenchError, match="option slot0 must be one of 'beam', 'rank'"):
        SpecBlockDrafter(SpecBlockOptions(slot0="wide"))


def test_trie_merges_duplicate_siblings():
    trie = _Trie()
    a = trie.add(-1, 5, -1.0)
    b = trie.add(a, 6, -2.0)
    assert trie.add(-1, 5, -0.5) == a and trie.nodes[a].score == -0.5
    assert trie.add(a, 6, -3.0) == b and len(trie) == 2


@pytest.mark.parametrize("options", [SpecBlockOptions(), SMALL, SpecBlockOptions(budget=8, blocks=3),
                                     SpecBlockOptions(branching=[2, 4, 6, 4], trim=0.5),
                                     SpecBlockOptions(budget=30, uniform_width=3)],
                         ids=["paper", "small", "three-blocks", "2464-trim", "uniform"])
def test_trees_are_prefix_closed_deduplicated_and_within_budget(target, trained, options):
    drafter = ready(SpecBlockDrafter(options, model=trained), target)
    record = generate(target, drafter, PROMPTS[2], GenerationConfig(max_new_tokens=12))
    assert max(record.tree_sizes) <= options.budget and max(record.tree_sizes) > K
    state = DecodeState(tokens=list(PROMPTS[1]) + [7], prompt_len=len(PROMPTS[1]), params=SamplingParams())
    drafter.begin(state, target.prefill(PROMPTS[1], taps=drafter.taps))
    tree = drafter.propose(state)
    parents = tree.parents.tolist()
    assert all(p < i for i, p in enumerate(parents))  # topological, so every ancestor is in the tree
    pairs = list(zip(parents, tree.tokens.tolist()))
    assert len(pairs) == len(set(pairs)) and len(tree) <= options.budget
    scores = tree.scores.tolist()
    assert all(p < 0 or scores[p] >= scores[i] - 1e-6 for i, p in enumerate(parents))


def test_drafter_cache_equals_a_fresh_encoding_after_each_call(target, trained):
    drafter = ready(SpecBlockDrafter(SMALL, model=trained), target)
    record = generate(target, drafter, PROMPTS[0], GenerationConfig(max_new_tokens=15))
    committed = drafter.encoded
    assert drafter.cache[0][0].shape[2] == committed * K and record.n_verify > 1
    # recompute from scratch over the same committed pairs (taps j, token j+1)
    fresh_drafter = ready(SpecBlockDrafter(SMALL, model=trained), target)
    ids = list(PROMPTS[0]) + record.new_tokens
    out = target.prefill(ids[:committed], taps=trained.taps)
    state = DecodeState(tokens=ids[: committed + 1], prompt_len=len(PROMPTS[0]), params=SamplingParams())
    fresh_drafter.begin(state, out)
    with torch.inference_mode():
        fresh_drafter._encode(state)
    for (k1, v1), (k2, v2) in zip(drafter.cache, fresh_drafter.cache):
        torch.testing.assert_close(k1, k2, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v1, v2, atol=1e-4, rtol=1e-4)


# ---- generation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["random", "trained"])
@pytest.mark.parametrize("options", [SpecBlockOptions(), SMALL, SpecBlockOptions(uniform_width=3, budget=20),
                                     SpecBlockOptions(slot0="rank", budget=20)],
                         ids=["default", "small", "uniform", "paper-slot0"])
def test_greedy_equals_baseline(target, trained, which, options):
    model = trained if which == "trained" else fresh(target, seed=9)
    drafter = ready(SpecBlockDrafter(options, model=model), target)
    config = GenerationConfig(max_new_tokens=40)
    accepted = 0
    for prompt in PROMPTS:
        record = generate(target, drafter, prompt, config)
        assert record.new_tokens == baseline(target, prompt, config)
        assert record.forwards.get("drafter", 0) <= 2 * record.n_verify  # M = 2 forwards per call
        accepted += sum(record.accept_lengths)
        stats = record.extra
        assert sum(stats["rank_predicted"]) == K * record.n_verify
    if which == "trained":
        assert accepted > 0


def test_sampling_matches_the_target_distribution():
    """T = 1 through the engine: the first two committed tokens follow the target's joint law."""
    vocab = 24
    target = tiny_target(4, vocab=vocab, layers=LAYERS, init=0.3)
    model = SpecBlockModel(SpecBlockConfig.from_target(target, vocab), eagle3_taps(LAYERS),
                           target.model.get_input_embeddings()).eval()
    drafter = ready(SpecBlockDrafter(SpecBlockOptions(budget=12, beam_width=3), model=model), target)
    prompt = [1, 4, 2]
    params = SamplingParams(temperature=1.0)
    samples = [tuple(generate(target, drafter, prompt, GenerationConfig(max_new_tokens=2, sampling=params,
                                                                         seed=seed)).new_tokens[:2])
               for seed in range(2500)]
    with torch.no_grad():
        p1 = target.model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        joint = {}
        for a in range(vocab):
            p2 = target.model(torch.tensor([prompt + [a]])).logits[0, -1].softmax(-1)
            for b in range(vocab):
                joint[(a, b)] = float(p1[a] * p2[b])
    stat, pvalue = chi2_pvalue(samples, joint)
    print(f"chi2={stat:.1f} p={pvalue:.3f}")
    assert pvalue > 1e-3


def test_registered_variants():
    assert method_class("specblock") is SpecBlockDrafter
    assert method_class("specblock-uniform-tree") is SpecBlockUniformTree
    assert create_drafter("specblock-uniform-tree", {}).options.uniform_width == 3
    for name in ("specblock-no-broadcast", "specblock-no-shift", "specblock-no-valid-prefix"):
        assert method_class(name).weights_name == name
    assert create_drafter("specblock", {"branching": "2,4,6,4", "budget": "90"}).options.branching == [2, 4, 6, 4]
    with pytest.raises(SpecbenchError, match="branching needs 4"):
        SpecBlockDrafter(SpecBlockOptions(branching=[2, 4]))


# ---- checkpoints ---------------------------------------------------------------------------------
def test_save_load_round_trips_exactly(tmp_path, target, trained):
    save_specblock(tmp_path, trained, target, {"lr": 1.0}, dtype=None)
    loaded = load_specblock(tmp_path, target)
    for key, value in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    other = tiny_target(1, layers=LAYERS, init=0.5, vocab=VOCAB + 8)
    with pytest.raises(SpecbenchError, match="another|vocabulary|trained for"):
        load_specblock(tmp_path, other)


def published_checkpoint(folder, target, model: SpecBlockModel, drop: str = "", mapping: bool = True) -> dict:
    """The published layout: Llama-style config, model.safetensors (with the embedding copy), vocab_mapping.pt."""
    cfg = model.config
    state = {k: v.clone() for k, v in model.state_dict().items() if k not in ("t2d", "d2t")}
    state["input_layer.embed_tokens.weight"] = torch.randn(VOCAB, cfg.hidden_size)
    state.pop(drop, None)
    save_file(state, str(folder / "model.safetensors"))
    if mapping:
        torch.save({"t2d": model.t2d.clone(), "d2t": model.d2t.clone()}, folder / VOCAB_MAPPING)
    config = {"architectures": ["LlamaForCausalLMSpecBlock"], "hidden_size": cfg.hidden_size,
              "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
              "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps, "vocab_size": VOCAB,
              "draft_vocab_size": cfg.draft_vocab_size, "diffspec_draft_token_num": K, "num_hidden_layers": 2,
              "rank_classes": 4, "max_position_embeddings": 512, "rope_theta": cfg.rope_theta}
    (folder / "config.json").write_text(json.dumps(config))
    return state


def test_published_checkpoint_loads_and_drafts(tmp_path, target, trained):
    published_checkpoint(tmp_path, target, trained)
    drafter = ready(SpecBlockDrafter(SpecBlockOptions(path=str(tmp_path), budget=24)), target)
    for key, value in trained.state_dict().items():
        assert torch.equal(drafter.model.state_dict()[key], value), key
    config = GenerationConfig(max_new_tokens=20)
    record = generate(target, drafter, PROMPTS[0], config)
    assert record.new_tokens == baseline(target, PROMPTS[0], config) and sum(record.accept_lengths) > 0


def test_rank_head_width_travels_with_the_checkpoint(tmp_path, target):
    model = fresh(target, rank_hidden=24)
    (tmp_path / "published").mkdir()
    published_checkpoint(tmp_path / "published", target, model)
    save_specblock(tmp_path / "ours", model, target, {}, dtype=None)
    for folder in ("published", "ours"):
        loaded = load_specblock(tmp_path / folder, target)
        assert loaded.config.rank_hidden == 24, folder
        for key, value in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], value), (folder, key)


@pytest.mark.parametrize("change,message", [({"drop": "shift_proj.0.weight"}, "lacks keys: shift_proj.0.weight"),
                                            ({"mapping": False}, "vocab_mapping.pt")],
                         ids=["missing-key", "no-mapping"])
def test_published_checkpoint_errors_name_the_problem(tmp_path, target, trained, change, message):
    published_checkpoint(tmp_path, target, trained, **change)
    with pytest.raises(SpecbenchError, match=message):
        load_specblock(tmp_path, target)


def test_missing_drafter_is_one_clear_error(target, tmp_path):
    with pytest.raises(SpecbenchError, match="train one with `specbench train specblock`"):
        SpecBlockDrafter(SpecBlockOptions(path=str(tmp_path / "nope"))).setup(target)
    with pytest.raises(SpecbenchError, match="train one with `specbench train specblock --variant no-shift`"):
        create_drafter("specblock-no-shift", {"path": str(tmp_path / "nope")}).setup(target)
