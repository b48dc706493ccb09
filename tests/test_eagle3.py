"""EAGLE-3 on tiny random targets: the training-time test learns and matches tree inference,
checkpoints round-trip (ours and the official layout), trees are well formed, and generation
through the engine equals the vanilla baseline."""

import json

import pytest
import torch
from safetensors.torch import save_file

from methods.eagle3.drafter import Eagle3Config, Eagle3Drafter, Eagle3Model, Eagle3Options, eagle3_taps, select_nodes
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine.drafter import DecodeState
from specbench.engine.registry import create_drafter, method_class
from specbench.engine.loop import GenerationConfig, generate
from specbench.errors import SpecbenchError
from specbench.engine.timing import PhaseTimer
from specbench.training.batch import TrainBatch
from specbench.training.vocab import build_vocab_mapping
from specbench.engine.verify import SamplingParams
from specbench.engine.target import Target
from tiny import tiny_target

LAYERS = 8  # taps (2, 4, 5): three distinct layers
VOCAB = 64
INIT = 0.5  # peaked target distributions (entropy ~1.9 nats), so there is something to learn
PROMPTS = [[3, 17, 5, 42, 8], [1, 2, 3], [60, 7, 7, 7, 19, 33, 2, 9, 41]]
SMALL = Eagle3Options(top_k=4, depth=3, total_tokens=20)


@pytest.fixture(scope="module")
def target():
    return tiny_target(0, layers=LAYERS, init=INIT)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


def make_batch(target, seed: int = 0, rows: int = 6, prompt_len: int = 4, new: int = 20) -> TrainBatch:
    """Target-regenerated sequences (greedy); the last row is right-padded by 5 tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([greedy(target.model, torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist(), new)
                        for _ in range(rows)])
    attention = torch.ones_like(ids)
    attention[-1, -5:] = 0
    ids[-1, -5:] = 0
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, prompt_len:] = 1
    loss_mask *= attention
    with torch.no_grad():
        hidden = target.model(ids, attention_mask=attention, output_hidden_states=True).hidden_states
    taps = {i: hidden[i].float() for i in set(eagle3_taps(LAYERS)) | {-1}}
    return TrainBatch(ids, attention, loss_mask, taps, target.model.lm_head)


def train(model: Eagle3Model, batch: TrainBatch, steps: int = 30, lr: float = 1e-2) -> list[float]:
    params = [p for name, p in model.named_parameters() if name in model.trainable]
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    for _ in range(steps):
        loss, metrics = model.training_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(metrics["loss"])
    return losses


def vocab_of(batch: TrainBatch, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.bincount(batch.input_ids[batch.attention_mask > 0], minlength=VOCAB)
    d2t, t2d, _ = build_vocab_mapping(counts, size)
    return d2t, t2d


@pytest.fixture(scope="module")
def trained(target):
    """A briefly trained drafter over a reduced draft vocabulary (exercises d2t in the tree)."""
    torch.manual_seed(1)
    batch = make_batch(target)
    model = Eagle3Model.from_target(target, vocab_of(batch, 48))
    train(model, batch)
    return model.eval()


def ready(drafter, target):
    drafter.setup(target)
    return drafter


_BASELINES: dict[tuple, list[int]] = {}


def baseline(target, prompt, config):
    """Vanilla output, computed once per (target, prompt, config)."""
    key = (id(target), tuple(prompt), config)
    if key not in _BASELINES:
        _BASELINES[key] = generate(target, ready(VanillaDrafter(), target), prompt, config).new_tokens
    return _BASELINES[key]


# ---- vocabulary and taps -----------------------------------------------------------------------
def test_build_vocab_mapping_keeps_most_frequent_ties_by_id():
    counts = torch.tensor([5, 0, 7, 5, 1, 5])
    d2t, t2d, coverage = build_vocab_mapping(counts, 3)
    kept = torch.arange(3) + d2t
    assert kept.tolist() == [0, 2, 3]  # 7, then the tie 5/5/5 broken by lowest ids
    assert t2d.tolist() == [True, False, True, True, False, False]
    assert coverage == pytest.approx(17 / 23)


def test_taps_follow_the_target_depth():
    assert eagle3_taps(8) == (2, 4, 5) and eagle3_taps(30) == (2, 15, 27)
    with pytest.raises(SpecbenchError):
        eagle3_taps(3)


# ---- training ------------------------------------------------------------------------------------
def test_training_loss_falls_and_leaves_the_embedding_alone(target):
    torch.manual_seed(0)
    batch = make_batch(target)
    model = Eagle3Model.from_target(target)
    _, before = model.training_loss(batch)
    assert set(before) == {"loss"} | {f"acc_{s}" for s in range(1, 8)}
    losses = train(model, batch)
    _, after = model.training_loss(batch)
    # The soft-CE floor is the target's entropy (~1.9 nats x sum 0.8^s ~ 8), so -25% is most of the gap.
    assert losses[-1] < 0.75 * losses[0] and after["acc_1"] > before["acc_1"] + 0.2
    assert target.model.get_input_embeddings().weight.grad is None
    assert "embed_tokens.weight" not in model.state_dict() and len(model.trainable) == len(list(model.parameters()))


def test_reduced_vocab_masks_targets_outside_it(target):
    batch = make_batch(target)
    d2t, t2d = vocab_of(batch, 20)
    model = Eagle3Model.from_target(target, (d2t, t2d))
    loss, _ = model.training_loss(batch, steps=3)
    assert torch.isfinite(loss) and loss > 0 and model.lm_head.out_features == 20
    assert model.to_target_ids(torch.arange(20)).tolist() == t2d.nonzero().flatten().tolist()
    # A draft vocabulary holding none of the target's argmax tokens leaves nothing to train on.
    outside = torch.ones(VOCAB, dtype=torch.long)
    outside[batch.target_logits().argmax(-1).flatten()] = 0
    loss, metrics = Eagle3Model.from_target(target, build_vocab_mapping(outside, int(outside.sum()))[:2]) \
        .training_loss(batch, steps=3)
    assert metrics["loss"] == 0.0 and metrics["acc_1"] == 0.0


def test_unrolled_training_matches_tree_inference(target):
    """Step s at index j of the training-time test equals a depth-s tree node drafted after
    position j: same keys, positions and tokens (teacher-forced)."""
    torch.manual_seed(3)
    batch = make_batch(target, rows=1)
    model = Eagle3Model.from_target(target).eval()
    ids, feats = batch.input_ids, model.features(batch.taps)
    j = 10
    with torch.no_grad():
        unrolled = list(model.unroll(ids, feats, 3))
        out, kv = model(feats[:, : j + 1], ids[:, 1: j + 2], torch.arange(j + 1)[None])
        torch.testing.assert_close(out, unrolled[0][:, : j + 1], atol=1e-5, rtol=1e-5)
        hidden = out[:, -1:]
        for s in (1, 2):
            out, kv = model(hidden, ids[:, j + 1 + s: j + 2 + s], torch.tensor([[j + s]]), past=kv,
                            visible=torch.ones(1, kv[0].shape[2] + 1, dtype=torch.bool))
            torch.testing.assert_close(out[:, 0], unrolled[s][:, j], atol=1e-5, rtol=1e-5)
            hidden = out


# ---- checkpoints ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_save_load_round_trips_exactly(tmp_path, target, trained, dtype):
    trained.save(tmp_path, target, recipe={"steps": 30}, dtype=dtype)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["method"] == "eagle3" and config["taps"] == [2, 4, 5] and config["draft_vocab"] == 48
    loaded = Eagle3Model.load(tmp_path, target)
    expected = {k: v.to(dtype) if dtype and v.is_floating_point() else v for k, v in trained.state_dict().items()}
    got = loaded.state_dict()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_checkpoint_refused_for_another_target(tmp_path, target, trained):
    trained.save(tmp_path, target, recipe={})
    with pytest.raises(SpecbenchError, match="hidden_size"):
        Eagle3Model.load(tmp_path, tiny_target(0, layers=LAYERS, init=INIT, hidden=48))


# ---- tree ----------------------------------------------------------------------------------------
def test_select_nodes_is_ancestor_closed():
    parents = torch.tensor([-1, -1, 0, 2, 1])
    assert select_nodes(parents, torch.tensor([-1.0, -3.0, -1.0, -1.0, -3.5]), 3).tolist() == [0, 2, 3]
    # A child scored above its parent (impossible for log-probs) is dropped rather than orphaned.
    assert select_nodes(torch.tensor([-1, 0]), torch.tensor([-2.0, -1.0]), 1).tolist() == []


@pytest.mark.parametrize("options", [Eagle3Options(), SMALL, Eagle3Options(top_k=3, depth=2, total_tokens=100)],
                         ids=["default", "small", "budget-above-candidates"])
def test_tree_is_prefix_closed_and_within_budget(target, trained, options):
    drafter = ready(Eagle3Drafter(options, model=trained), target)
    prompt = PROMPTS[2]
    prefill = target.prefill(prompt, taps=drafter.taps)
    state = DecodeState(tokens=prompt + [int(prefill.logits[-1].argmax())], prompt_len=len(prompt),
                        params=SamplingParams(), timer=PhaseTimer())
    drafter.begin(state, prefill)
    tree = drafter.propose(state)
    candidates = options.top_k + options.depth * options.top_k ** 2
    assert 0 < len(tree) <= min(options.total_tokens - 1, candidates)
    assert int(tree.depths.max()) <= options.depth + 1
    for i, p in enumerate(tree.parent_list):
        assert p < i and (p < 0 or tree.scores[i] <= tree.scores[p])
    for parent in set(tree.parent_list):
        tokens = [tree.token_list[c] for c in range(len(tree)) if tree.parent_list[c] == parent]
        assert len(tokens) == len(set(tokens))
    assert all(int(trained.t2d[t]) for t in tree.token_list)  # draft ids mapped to target ids
    assert state.timer.forward_calls["drafter"] == options.depth + 1 and "tree_build" in state.timer.ns


def test_tree_scores_equal_a_sequential_redraft_of_each_path(target, trained):
    """Tree attention, positions and hidden feedback: every node's cumulative log-prob equals the
    one obtained by drafting its path alone, one causal forward per token."""
    drafter = ready(Eagle3Drafter(Eagle3Options(), model=trained), target)
    prompt = PROMPTS[0]
    prefill = target.prefill(prompt, taps=drafter.taps)
    tokens = prompt + [int(prefill.logits[-1].argmax())]
    state = DecodeState(tokens=list(tokens), prompt_len=len(prompt), params=SamplingParams())
    drafter.begin(state, prefill)
    tree = drafter.propose(state)
    draft_id = {int(t): d for d, t in enumerate(trained.to_target_ids(torch.arange(48)))}
    with torch.no_grad():
        feats = trained.features(prefill.taps)[None]
        out, stable = trained(feats, torch.tensor([tokens[1:]]), torch.arange(len(prompt))[None])
        for leaf in tree.leaves():
            hidden, kv, score = out[:, -1:], stable, 0.0
            for depth, node in enumerate(tree.path_to(leaf)):
                score += float(trained.logits(hidden[0, -1]).log_softmax(-1)[draft_id[tree.token_list[node]]])
                assert score == pytest.approx(float(tree.scores[node]), abs=1e-4)
                hidden, kv = trained(hidden, torch.tensor([[tree.token_list[node]]]),
                                     torch.tensor([[len(prompt) + depth]]), past=kv)


# ---- generation through the engine -------------------------------------------------------------
@pytest.mark.parametrize("which", ["random", "trained"])
@pytest.mark.parametrize("options", [Eagle3Options(), SMALL], ids=["default", "small"])
def test_greedy_equals_baseline(target, trained, which, options):
    torch.manual_seed(5)
    model = trained if which == "trained" else Eagle3Model.from_target(target).eval()
    drafter = ready(Eagle3Drafter(options, model=model), target)
    config = GenerationConfig(max_new_tokens=40)
    accepted = 0
    for prompt in PROMPTS:
        record = generate(target, drafter, prompt, config)
        assert record.new_tokens == baseline(target, prompt, config)
        accepted += sum(record.accept_lengths)
    if which == "trained":
        assert accepted > 0


def proposals(drafter, target, prompts, config) -> tuple[list, list]:
    """Every tree the drafter proposed (tokens, parents, scores) over ``prompts``, and the texts written."""
    trees, texts = [], []
    propose = drafter.propose

    def recording(state):
        tree = propose(state)
        trees.append((tree.token_list, tree.parent_list, tree.scores))
        return tree

    drafter.propose = recording
    for prompt in prompts:
        texts.append(generate(target, drafter, prompt, config).new_tokens)
    return trees, texts


@pytest.mark.parametrize("options", [SMALL, Eagle3Options(), Eagle3Options(top_k=20, depth=2, total_tokens=30)],
                         ids=["small", "default", "wide"])
def test_compiled_head_proposes_the_eager_heads_trees(target, trained, options):
    """Under the compiled engine the head runs over a static buffer through compiled graphs: every tree, step
    after step, has the eager head's tokens and parents and its scores within fp32 rounding, and the text is
    vanilla's."""
    fast = Target(target.model, target.tokenizer, target.name, engine="compiled")
    compiled_head = ready(Eagle3Drafter(options, model=trained), fast)
    eager_head = ready(Eagle3Drafter(options, model=trained), fast)
    eager_head.head = None
    assert compiled_head.head is not None
    config = GenerationConfig(max_new_tokens=40)
    trees, texts = proposals(compiled_head, fast, PROMPTS, config)
    expected, eager_texts = proposals(eager_head, fast, PROMPTS, config)
    assert texts == eager_texts == [baseline(target, p, config) for p in PROMPTS]
    assert len(trees) == len(expected) > len(PROMPTS)
    for (tokens, parents, scores), (want_tokens, want_parents, want_scores) in zip(trees, expected):
        assert (tokens, parents) == (want_tokens, want_parents)
        torch.testing.assert_close(scores, want_scores, atol=1e-4, rtol=0)
    assert compiled_head.head.built == {"one", "many", "level"}


def test_compiled_head_compiles_only_inside_its_builds(target, trained):
    """Every graph the head compiles is compiled inside ``_build`` (outside the clock), from the first request on:
    no real call recompiles (dynamo's unique-graph counter moves only inside builds); a second request builds
    nothing; a request past the buffer builds again, outside the clock."""
    fast = Target(target.model, target.tokenizer, target.name, engine="compiled")
    config = GenerationConfig(max_new_tokens=30)
    vanilla = VanillaDrafter()
    vanilla.setup(fast)
    generate(fast, vanilla, PROMPTS[0], config)  # the target's two graphs, built
    drafter = ready(Eagle3Drafter(SMALL, model=trained), fast)
    counter = torch._dynamo.utils.counters["stats"]
    builds, inside = [], [0]
    build = drafter.head._build

    def counted(key, timer):
        before = counter["unique_graphs"]
        builds.append(key)
        build(key, timer)
        inside[0] += counter["unique_graphs"] - before

    drafter.head._build = counted
    for prompt in PROMPTS:
        before, built = counter["unique_graphs"], len(builds)
        inside[0] = 0
        record = generate(fast, drafter, prompt, config)
        assert counter["unique_graphs"] - before == inside[0], prompt  # nothing compiled inside the clock
        assert record.new_tokens == baseline(target, prompt, config)
        assert (record.outside_clock == {}) == (len(builds) == built)
    assert sorted(builds) == ["level", "many", "one"]  # each graph built once, in the first request
    drafter.head.reserve(drafter.head.capacity + 1)  # a request past the buffer: a wider one, graphs again
    record = generate(fast, drafter, PROMPTS[1], config)
    assert set(builds[3:]) >= {"many", "level"} and record.outside_clock.get("graph_compile", 0) > 0
    assert record.new_tokens == baseline(target, PROMPTS[1], config)


def test_sampling_runs_and_is_reproducible(target, trained):
    drafter = ready(Eagle3Drafter(SMALL, model=trained), target)
    config = GenerationConfig(max_new_tokens=30, sampling=SamplingParams(temperature=1.0), seed=7)
    first = generate(target, drafter, PROMPTS[0], config).new_tokens
    assert len(first) == 30 and first == generate(target, drafter, PROMPTS[0], config).new_tokens


def test_registered_as_a_method():
    assert method_class("eagle3") is Eagle3Drafter
    assert create_drafter("eagle3", {"top_k": "4", "depth": "3"}).options.top_k == 4
    with pytest.raises(SpecbenchError):
        Eagle3Drafter(Eagle3Options(total_tokens=1))


# ---- official EAGLE-3 layout ---------------------------------------------------------------------
def published_weights(rand, cfg, h: int, fc_in: int, draft_vocab: int) -> dict[str, torch.Tensor]:
    """The EAGLE-3 layer, norms and head under their published key names (drawn in this order)."""
    heads, kv_heads, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    d = h // heads
    return {"fc.weight": rand(h, fc_in), "midlayer.self_attn.q_proj.weight": rand(heads * d, 2 * h),
            "midlayer.self_attn.k_proj.weight": rand(kv_heads * d, 2 * h),
            "midlayer.self_attn.v_proj.weight": rand(kv_heads * d, 2 * h),
            "midlayer.self_attn.o_proj.weight": rand(h, heads * d), "midlayer.mlp.gate_proj.weight": rand(inter, h),
            "midlayer.mlp.up_proj.weight": rand(inter, h), "midlayer.mlp.down_proj.weight": rand(h, inter),
            "midlayer.input_layernorm.weight": 1 + rand(h), "midlayer.hidden_norm.weight": 1 + rand(h),
            "midlayer.post_attention_layernorm.weight": 1 + rand(h), "norm.weight": 1 + rand(h),
            "lm_head.weight": rand(draft_vocab, h)}


def published_config(cfg, h: int, draft_vocab: int) -> dict:
    """config.json as the EAGLE-3 repository ships it."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "intermediate_size": cfg.intermediate_size, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "num_hidden_layers": 1, "vocab_size": VOCAB, "draft_vocab_size": draft_vocab,
            "max_position_embeddings": 512, "torch_dtype": "float32"}


def write_published(folder, config: dict, state: dict, fmt: str) -> dict[str, torch.Tensor]:
    """config.json plus the weights as pytorch_model.bin (fmt "bin") or model.safetensors."""
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(state, folder / "pytorch_model.bin")
    else:
        save_file(state, str(folder / "model.safetensors"))
    return state


def official_checkpoint(folder, target, fmt: str, draft_vocab: int = 48, drop: str = "", extra: str = "",
                        hidden: int | None = None) -> dict[str, torch.Tensor]:
    """Write config.json + weights the way the EAGLE-3 repository ships them (random values)."""
    h = hidden or target.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: 0.2 * torch.randn(*shape, generator=gen)  # noqa: E731
    d2t, t2d, _ = build_vocab_mapping(torch.randint(0, 100, (VOCAB,), generator=gen), draft_vocab)
    state = {**published_weights(rand, target.config, h, 3 * h, draft_vocab), "d2t": d2t, "t2d": t2d,
             "embed_tokens.weight": rand(VOCAB, h)}
    state.pop(drop, None)
    if extra:
        state[extra] = rand(2)
    config = published_config(target.config, h, draft_vocab)
    return write_published(folder, config, state, fmt)


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_official_checkpoint_loads_every_key_and_drafts(tmp_path, target, fmt):
    written = official_checkpoint(tmp_path, target, fmt)
    drafter = ready(Eagle3Drafter(Eagle3Options(path=str(tmp_path), top_k=4, depth=3, total_tokens=20)), target)
    loaded = drafter.model.state_dict()
    assert set(loaded) == set(written) - {"embed_tokens.weight"}
    for key, value in loaded.items():
        assert torch.equal(value, written[key].to(value.dtype)), key
    assert drafter.model.config == Eagle3Config.from_official(json.loads((tmp_path / "config.json").read_text()), "")
    config = GenerationConfig(max_new_tokens=20)
    record = generate(target, drafter, PROMPTS[0], config)
    assert record.new_tokens == baseline(target, PROMPTS[0], config) and max(record.tree_sizes) > 1


@pytest.mark.parametrize("change,message", [
    ({"drop": "midlayer.hidden_norm.weight"}, "lacks keys: midlayer.hidden_norm.weight"),
    ({"extra": "midlayer.self_attn.q_norm.weight"}, "does not map: midlayer.self_attn.q_norm.weight"),
    ({"hidden": 48}, "hidden size 48"),
], ids=["missing", "unmapped", "hidden-size"])
def test_official_checkpoint_errors_name_the_problem(tmp_path, target, change, message):
    official_checkpoint(tmp_path, target, "safetensors", **change)
    with pytest.raises(SpecbenchError, match=message):
        Eagle3Model.load(tmp_path, target)
