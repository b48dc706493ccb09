"""Medusa (methods/medusa/drafter.py): training loss, checkpoints (ours and the official layout), the static
tree from medusa_choices, and lossless generation through the engine with tiny random targets."""

import json

import pytest
import torch
from safetensors.torch import save_file

from methods.medusa.drafter import (MC_SIM_7B_63, MedusaDrafter, MedusaHeads, MedusaOptions, TreeSkeleton, load_medusa,
                            official_key_map, resolve_choices, save_medusa)
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine.registry import create_drafter
from specbench.engine.loop import GenerationConfig, generate
from specbench.errors import SpecbenchError
from specbench.training.batch import TrainBatch
from specbench.training.features import pad_examples, target_taps
from specbench.engine.tree import SiblingKind
from specbench.engine.verify import SamplingParams
from tiny import tiny_target

PROMPTS = [[3, 17, 5, 42, 8], [1, 2, 3], [60, 7, 7, 7, 19, 33, 2, 9, 41]]
K = 4  # heads: mc_sim_7b_63 is 4 deep


def ready(drafter, target):
    drafter.setup(target)
    return drafter


def greedy_continuation(target, prompt, n):
    return generate(target, ready(VanillaDrafter(), target), prompt, GenerationConfig(max_new_tokens=n)).new_tokens


def make_batch(target, n_examples=6, response=24, seed=0) -> TrainBatch:
    """Target-regenerated examples (random prompts, greedy responses) with their final-norm taps."""
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n_examples):
        prompt = torch.randint(0, target.vocab_size, (3 + i % 4,), generator=gen).tolist()
        examples.append({"prompt_ids": prompt, "response_ids": greedy_continuation(target, prompt, response)})
    ids, attn, loss = pad_examples(examples, max_length=64)
    return TrainBatch(ids, attn, loss, target_taps(target, ids, attn, [-1]), target.model.get_output_embeddings())


def train(heads, batch, steps=30, lr=1e-2):
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=lr)
    history = []
    for _ in range(steps):
        loss, metrics = heads.training_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(metrics)
    return history


def random_heads(target, seed=0, shared=False, scale=0.3) -> MedusaHeads:
    """Untrained heads with random ResBlocks (and random output layers when not shared)."""
    torch.manual_seed(seed)
    heads = MedusaHeads.for_target(target, K, num_layers=1, shared_lm_head=shared)
    with torch.no_grad():
        heads.res_weight.normal_(0, scale)
        if not shared:
            heads.lm_weight.normal_(0, 1.0)
    return heads


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def batch(target):
    return make_batch(target)


@pytest.fixture(scope="module")
def trained(target, batch):
    heads = MedusaHeads.for_target(target, K, num_layers=1, shared_lm_head=True)
    train(heads, batch, steps=60)
    return heads


# ---- training ----------------------------------------------------------------------------------
def test_final_norm_tap_is_what_lm_head_reads(target, batch):
    with torch.no_grad():
        logits = target.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert torch.allclose(batch.target_logits(), logits, atol=1e-5)


@pytest.mark.parametrize("shared", [True, False])
def test_loss_falls(target, batch, shared):
    torch.manual_seed(0)
    heads = MedusaHeads.for_target(target, K, num_layers=1, shared_lm_head=shared)
    history = train(heads, batch, steps=30)
    assert set(history[0]) >= {"loss"} | {f"acc_{k}" for k in range(1, K + 1)}
    assert history[-1]["loss"] < 0.7 * history[0]["loss"]
    assert history[-1]["acc_1"] > history[0]["acc_1"]


def test_loss_targets_are_shifted_by_two_plus_k(target, batch):
    """Recompute head k's CE by hand: head k on h_j against x_{j+2+k}, response tokens only."""
    heads = random_heads(target, seed=3).requires_grad_(False)
    _, metrics = heads.training_loss(batch)
    h, ids = batch.taps[-1], batch.input_ids
    for k in range(K):
        s = 2 + k
        losses = []
        for b in range(ids.shape[0]):
            for j in range(ids.shape[1] - s):
                if batch.attention_mask[b, j + s] and batch.loss_mask[b, j + s]:
                    logits = heads(h[b, j:j + 1])[k, 0]
                    losses.append(torch.nn.functional.cross_entropy(logits[None], ids[b, j + s][None]))
        assert metrics[f"loss_{k + 1}"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-4)
    weighted = sum(0.8 ** k * metrics[f"loss_{k + 1}"] for k in range(K))
    assert metrics["loss"] == pytest.approx(weighted, rel=1e-5)


def test_unshared_heads_start_from_the_target_lm_head(target):
    heads = MedusaHeads.for_target(target, 3, shared_lm_head=False)
    for k in range(3):
        assert torch.equal(heads.lm_weight[k], target.model.lm_head.weight)
    shared = MedusaHeads.for_target(target, 3, shared_lm_head=True)
    assert set(shared.state_dict()) == {"res_weight", "res_bias"}  # the target's lm_head is not saved
    assert not torch.any(heads.res_weight)  # ResBlock W starts at zero


def test_batched_forward_equals_per_head_path(target, batch):
    heads = random_heads(target, seed=1).requires_grad_(False)
    h = batch.taps[-1][0, :5]
    feats = heads.features(h)
    logits = heads(h)
    for k in range(K):
        x = h + torch.nn.functional.silu(h @ heads.res_weight[k, 0].T + heads.res_bias[k, 0])
        assert torch.allclose(feats[k], x, atol=1e-6)
        assert torch.allclose(logits[k], x @ heads.lm_weight[k].T, atol=1e-5)


# ---- checkpoints -------------------------------------------------------------------------------
@pytest.mark.parametrize("shared", [True, False])
def test_save_load_round_trip_is_bit_exact(target, tmp_path, shared):
    heads = random_heads(target, seed=2, shared=shared)
    save_medusa(tmp_path / "m", heads, target, recipe={"lr": 1e-3})
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["method"] == "medusa" and config["taps"] == [-1]
    assert config["architecture"] == {"heads": K, "layers": 1, "hidden": 32, "vocab": 64, "shared_lm_head": shared}
    loaded = load_medusa(tmp_path / "m", target)
    assert set(loaded.state_dict()) == set(heads.state_dict())
    for key, value in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    h = torch.randn(2, 32)
    assert torch.equal(loaded(h), heads(h))


def test_checkpoint_for_another_target_is_refused(target, tmp_path):
    save_medusa(tmp_path / "m", random_heads(target), target)
    other = tiny_target(1, hidden=48)
    with pytest.raises(SpecbenchError, match="hidden_size"):
        load_medusa(tmp_path / "m", other)
    with pytest.raises(SpecbenchError, match="hidden_size"):
        ready(MedusaDrafter(MedusaOptions(path=str(tmp_path / "m"))), other)


def test_missing_folder_is_a_one_line_error(target, tmp_path):
    with pytest.raises(SpecbenchError, match="does not exist"):
        ready(MedusaDrafter(MedusaOptions(path=str(tmp_path / "nope"))), target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecbenchError, match="config.json"):
        ready(MedusaDrafter(MedusaOptions(path=str(tmp_path / "empty"))), target)


def official_state(heads=3, layers=1, hidden=32, vocab=64, seed=0) -> dict[str, torch.Tensor]:
    """Random tensors in the key layout of ModuleList([Sequential(ResBlock × layers, Linear)])."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for k in range(heads):
        for j in range(layers):
            state[f"{k}.{j}.linear.weight"] = torch.randn(hidden, hidden, generator=gen)
            state[f"{k}.{j}.linear.bias"] = torch.randn(hidden, generator=gen)
        state[f"{k}.{layers}.weight"] = torch.randn(vocab, hidden, generator=gen)
    return state


def write_official(folder, state, heads=3, layers=1, fmt="pt", hidden=32):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny",
        "hidden_size": hidden}))
    if fmt == "pt":
        torch.save(state, folder / "medusa_lm_head.pt")
    else:
        save_file(state, str(folder / "medusa_lm_head.safetensors"))
    return folder


@pytest.mark.parametrize("fmt,layers", [("pt", 1), ("safetensors", 1), ("safetensors", 2)])
def test_official_format_maps_every_key(target, tmp_path, fmt, layers):
    state = official_state(layers=layers)
    heads = load_medusa(write_official(tmp_path / "off", state, layers=layers, fmt=fmt), target)
    assert (heads.num_heads, heads.num_layers, heads.shared_lm_head) == (3, layers, False)
    mapped = official_key_map(3, layers)
    assert set(mapped) == set(state)
    params = dict(heads.named_parameters())
    for key, (name, k, j) in mapped.items():
        assert torch.equal(params[name][k] if j < 0 else params[name][k, j], state[key]), key
    # The module computes head k as Sequential(ResBlock..., Linear) on the official weights.
    h = torch.randn(1, 32)
    x = h
    for j in range(layers):
        x = x + torch.nn.functional.silu(x @ state[f"1.{j}.linear.weight"].T + state[f"1.{j}.linear.bias"])
    assert torch.allclose(heads(h)[1], x @ state[f"1.{layers}.weight"].T, atol=1e-4)


def test_official_format_errors_name_the_key(target, tmp_path):
    state = official_state()
    del state["2.0.linear.bias"]
    with pytest.raises(SpecbenchError, match=r"missing 2\.0\.linear\.bias"):
        load_medusa(write_official(tmp_path / "a", state), target)
    extra = official_state()
    extra["medusa_norm.weight"] = torch.zeros(32)
    with pytest.raises(SpecbenchError, match=r"map to nothing: medusa_norm\.weight"):
        load_medusa(write_official(tmp_path / "b", extra), target)
    partial = official_state()  # a fourth head without its bias and output layer
    partial["3.0.linear.weight"] = torch.zeros(32, 32)
    with pytest.raises(SpecbenchError, match=r"missing 3\.0\.linear\.bias, 3\.1\.weight"):
        load_medusa(write_official(tmp_path / "d", partial), target)
    with pytest.raises(SpecbenchError, match="hidden size 48"):
        load_medusa(write_official(tmp_path / "c", official_state(hidden=48), hidden=48), target)


def test_official_heads_generate_losslessly(target, tmp_path):
    folder = write_official(tmp_path / "off", official_state(heads=4), heads=4, fmt="safetensors")
    drafter = ready(create_drafter("medusa", {"path": str(folder), "heads": "2", "topk": "4"}), target)
    assert drafter.heads.num_heads == 2 and drafter.skeleton.num_heads == 2
    config = GenerationConfig(max_new_tokens=25)
    for prompt in PROMPTS:
        assert generate(target, drafter, prompt, config).new_tokens == greedy_continuation(target, prompt, 25)


# ---- the static tree ---------------------------------------------------------------------------
def test_mc_sim_7b_63_tree():
    sk = TreeSkeleton.build(resolve_choices("mc_sim_7b_63"), num_heads=5, topk=10)
    assert len(sk) == 63 and len(MC_SIM_7B_63) == 63 and int(sk.depths.max()) == 4 and sk.num_heads == 4
    paths = set(sk.paths)
    assert all(p[:-1] in paths for p in sk.paths if len(p) > 1)  # prefix-closed
    for i, p in enumerate(sk.paths):  # topological, parents and ancestors consistent with the paths
        parent = int(sk.parents[i])
        assert parent < i and (sk.paths[parent] == p[:-1] if parent >= 0 else len(p) == 1)
        assert int(sk.ancestors[i].sum()) == len(p)
    ids = torch.arange(40).reshape(4, 10) + 100  # head d, rank r -> token 100 + 10 d + r
    tree = sk.tree(ids, torch.zeros(4, 10))
    assert len(tree) == 63 and tree.kind == SiblingKind.DETERMINISTIC
    for i, p in enumerate(sk.paths):
        assert tree.token_list[i] == 100 + 10 * (len(p) - 1) + p[-1]
    assert torch.equal(tree.depths, sk.depths)


def test_small_choices_node_by_node():
    sk = TreeSkeleton.build(resolve_choices("[[0],[1],[0,0],[0,1],[1,0]]"), num_heads=3, topk=3)
    ids = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.9, 0.05, 0.05]]))
    tree = sk.tree(ids, logp)
    assert sk.paths == [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    assert tree.token_list == [10, 11, 20, 21, 20]
    assert tree.parent_list == [-1, -1, 0, 0, 1]
    assert tree.depths.tolist() == [1, 1, 2, 2, 2]
    expected = torch.log(torch.tensor([0.5, 0.3, 0.5 * 0.6, 0.5 * 0.3, 0.3 * 0.6]))
    assert torch.allclose(tree.scores, expected)
    assert "ancestor_mask" not in vars(tree)  # the engine's compile phase derives the mask, not the drafter
    assert torch.equal(tree.ancestor_mask, sk.ancestors)  # the skeleton's path sums follow the same ancestry


def test_tree_trimmed_to_available_heads_and_topk():
    choices = resolve_choices("mc_sim_7b_63")
    two = TreeSkeleton.build(choices, num_heads=2, topk=10)
    assert len(two) == sum(len(p) <= 2 for p in MC_SIM_7B_63) and two.num_heads == 2
    small = TreeSkeleton.build(choices, num_heads=5, topk=3)
    assert all(max(p) < 3 for p in small.paths) and len(small) == sum(max(p) < 3 for p in MC_SIM_7B_63)


def test_bad_choices_are_refused():
    with pytest.raises(SpecbenchError, match="prefix-closed"):
        TreeSkeleton.build(resolve_choices("[[0],[1,0]]"), num_heads=3, topk=10)
    with pytest.raises(SpecbenchError, match="unknown choices"):
        resolve_choices("mc_sim_7b_64")
    with pytest.raises(SpecbenchError, match="ranks"):
        resolve_choices("[[0],[-1]]")


def test_duplicate_sibling_tokens_are_deduplicated():
    sk = TreeSkeleton.build(resolve_choices("[[0],[1],[0,0]]"), num_heads=2, topk=2)
    tree = sk.tree(torch.tensor([[7, 7], [3, 4]]), torch.log(torch.tensor([[0.6, 0.4], [0.5, 0.5]])))
    assert tree.token_list == [7, 3] and tree.parent_list == [-1, 0]


# ---- through the engine ------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["random-unshared", "random-shared", "trained"])
def test_greedy_equals_baseline(target, trained, which):
    heads = {"random-unshared": lambda: random_heads(target, 4),
             "random-shared": lambda: random_heads(target, 5, shared=True),
             "trained": lambda: trained}[which]()
    drafter = ready(MedusaDrafter(heads=heads), target)
    config = GenerationConfig(max_new_tokens=40)
    accepted = 0
    for prompt in PROMPTS:
        record = generate(target, drafter, prompt, config)
        assert record.new_tokens == greedy_continuation(target, prompt, 40)
        assert set(record.tree_sizes) == {63}
        assert record.forwards["drafter"] == record.n_verify
        assert record.times["tree_build"] > 0
        accepted += sum(record.accept_lengths)
    if which == "trained":
        assert accepted > 0  # trained heads predict the target's continuation at least sometimes


def test_trained_heads_accept_on_their_training_data(target, trained, batch):
    """Heads trained on the target's greedy responses get multi-token acceptances on those prompts."""
    drafter = ready(MedusaDrafter(heads=trained), target)
    ids, lens = batch.input_ids, batch.attention_mask.sum(1) - batch.loss_mask.sum(1)
    record = generate(target, drafter, ids[0, : lens[0]].tolist(), GenerationConfig(max_new_tokens=24))
    assert record.n_verify < 24 - 1  # fewer verify calls than tokens: some drafts were accepted


def test_sampled_generation_is_seed_reproducible(target, trained):
    drafter = ready(MedusaDrafter(heads=trained), target)

    def run(seed):
        config = GenerationConfig(max_new_tokens=30, sampling=SamplingParams(temperature=1.0), seed=seed)
        return generate(target, drafter, PROMPTS[0], config).new_tokens

    first = run(11)
    assert len(first) == 30 and run(11) == first
    assert any(run(seed) != first for seed in (12, 13, 14))


def test_max_nodes_keeps_a_prefix_closed_head_of_the_list():
    drafter = MedusaDrafter(MedusaOptions(max_nodes=15))
    assert drafter.choices == [tuple(c) for c in MC_SIM_7B_63[:15]]
    skeleton = TreeSkeleton.build(drafter.choices, num_heads=5, topk=10, device="cpu")
    assert len(skeleton.parents) == 15
