"""Parity of our drafter forwards with the authors' own code (`pytest -m parity`).

For every reference package that installs (`pip install -e '.[parity]'`), a tiny random drafter is
built with the authors' classes, saved with their save code, loaded BY PATH through our loaders,
and both sides get identical inputs from one tiny random Llama target: logits must agree to
1e-4 (fp32) and the drafted tokens must be the same. Each comparison has a negative control (one
perturbed weight, or one wrong tap index) that must fail the same check, so a comparison that
compares nothing cannot pass. A package that is not installed skips its tests with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parity_refs import (assert_parity, perturb_saved_weight, require_reference, target_hidden_states,
                         tiny_parity_target)

pytestmark = pytest.mark.parity


# ---- DFlash: z-lab's own package (dflash.model) ---------------------------------------------------
BLOCK = 4
MASK_ID = 63  # the last id of the tiny target's 64-token vocabulary


def _zlab_dflash(target, layer_types=None, seed: int = 1, dflash2: bool = False):
    """z-lab's DFlashDraftModel (or DFlash2DraftModel) on a Qwen3Config as their published configs read."""
    require_reference("dflash")
    from transformers import Qwen3Config

    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    extra = {"target_layer_ids": [1, 2], "mask_token_id": MASK_ID}
    if dflash2:
        extra.update(conv_kernel_size=3, conv_group_size=8, selector_rank=4, selector_top_k=4)
    kwargs = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=512,
                  initializer_range=0.2, num_target_layers=target.num_layers, block_size=BLOCK,
                  dflash_config=extra, tie_word_embeddings=False)
    if layer_types is not None:
        kwargs.update(layer_types=layer_types, use_sliding_window=True, sliding_window=3, max_window_layers=0)
    config = Qwen3Config(**kwargs)
    config.architectures = ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"]
    torch.manual_seed(seed)
    model = (DFlash2DraftModel if dflash2 else DFlashDraftModel)(config).float().eval()
    with torch.no_grad():  # random norms too, so a norm read from the wrong key shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _zlab_block_logits(model, target, prompt: torch.Tensor, bonus: int) -> torch.Tensor:
    """One drafting step exactly as z-lab's dflash_generate runs it: context features of the prompt
    (extract_context_feature), the block [bonus, MASK...] embedded by the target, the draft model
    over a fresh cache, compute_logits with the target's output head -> [L-1, V]."""
    from dflash.model import _draft_value, _make_cache, _output_head, _raw_input_embeddings, extract_context_feature

    hidden = target_hidden_states(target, prompt)
    n = prompt.shape[1]
    context = extract_context_feature(hidden, model.target_layer_ids)
    block = torch.full((1, BLOCK), MASK_ID, dtype=torch.long)
    block[0, 0] = bonus
    scale = float(_draft_value(model.config, "input_embedding_scale", 1.0))
    with torch.inference_mode():
        draft_hidden = model(target_hidden=context, noise_embedding=_raw_input_embeddings(target.model, block, scale),
                             position_ids=torch.arange(n + BLOCK)[None], past_key_values=_make_cache(model.config),
                             use_cache=True)[:, 1 - BLOCK:, :]
        return model.compute_logits(draft_hidden, _output_head(target.model))[0].float()


def _our_block_logits(folder: Path, target, prompt: torch.Tensor, bonus: int, tap_shift: int = 0) -> torch.Tensor:
    """Our DFlashModel loaded by path, the same step through our cache path (context_kv + forward)."""
    from methods.dflash.drafter import DFlashModel

    model = DFlashModel.load(folder, target).float().eval()
    hidden = target_hidden_states(target, prompt)
    taps = {i: hidden[i - tap_shift][0] for i in model.taps}
    n = prompt.shape[1]
    block = torch.full((1, BLOCK), MASK_ID, dtype=torch.long)
    block[0, 0] = bonus
    with torch.inference_mode():
        kv = model.context_kv(model.context(model.features(taps)[None]), torch.arange(n)[None])
        out = model(block, torch.arange(n, n + BLOCK)[None], kv)
        return model.logits(out[0, 1:]).float()


@pytest.mark.parametrize("layer_types", [None, ["full_attention", "sliding_attention"]],
                         ids=["full", "sliding"])
def test_dflash_matches_zlab_draft_model(tmp_path, layer_types):
    target = tiny_parity_target()
    theirs = _zlab_dflash(target, layer_types)
    theirs.save_pretrained(tmp_path / "zlab")
    prompt = torch.randint(0, 60, (1, 11), generator=torch.Generator().manual_seed(3))
    ref = _zlab_block_logits(theirs, target, prompt, bonus=5)
    ours = _our_block_logits(tmp_path / "zlab", target, prompt, bonus=5)
    assert_parity(ours, ref)
    # Negative controls: one perturbed weight in their file, and one wrong tap index, must both fail.
    perturb_saved_weight(tmp_path / "zlab", "layers.0.self_attn.k_proj.weight")
    with pytest.raises(AssertionError):
        assert_parity(_our_block_logits(tmp_path / "zlab", target, prompt, bonus=5), ref)


def test_dflash_wrong_tap_fails_zlab_parity(tmp_path):
    target = tiny_parity_target()
    theirs = _zlab_dflash(target)
    theirs.save_pretrained(tmp_path / "zlab")
    prompt = torch.randint(0, 60, (1, 9), generator=torch.Generator().manual_seed(4))
    ref = _zlab_block_logits(theirs, target, prompt, bonus=7)
    assert_parity(_our_block_logits(tmp_path / "zlab", target, prompt, bonus=7), ref)
    with pytest.raises(AssertionError):  # hidden_states[l] instead of [l + 1]: the off-by-one a loader could make
        assert_parity(_our_block_logits(tmp_path / "zlab", target, prompt, bonus=7, tap_shift=1), ref)


def test_dflash2_from_zlab_is_refused_in_one_line(tmp_path):
    """DFlash-2 (z-lab's DFlash2DraftModel) is not run by specbench: its saved folder is refused in one
    line naming what is missing, never loaded as a plain DFlash drafter."""
    from methods.dflash.drafter import DFlashModel
    from specbench.errors import SpecbenchError

    target = tiny_parity_target()
    theirs = _zlab_dflash(target, dflash2=True)
    theirs.save_pretrained(tmp_path / "zlab2")
    with pytest.raises(SpecbenchError) as err:
        DFlashModel.load(tmp_path / "zlab2", target)
    line = str(err.value)
    assert "\n" not in line and "DFlash-2" in line and "selector" in line


# ---- Medusa: FasterDecoding's medusa-llm (medusa.model.medusa_model) ----------------------------
MEDUSA_TOPK = [3, 2, 2]  # medusa-llm's dense tree: top-3 of head 1, top-2 of heads 2 and 3


def _medusa_llm_heads(target, folder: Path, seed: int = 2):
    """medusa-llm's MedusaModel heads on our tiny target, random as if trained, saved as its train.py
    saves them: MedusaConfig.save_pretrained + torch.save(medusa_head.state_dict(), medusa_lm_head.pt)."""
    require_reference("medusa")
    from medusa.model.medusa_model import MedusaConfig, MedusaModel

    from parity_refs import save_tiny_tokenizer

    base = save_tiny_tokenizer(folder / "base")
    model = MedusaModel(target.model, medusa_num_heads=len(MEDUSA_TOPK), medusa_num_layers=1,
                        base_model_name_or_path=str(base))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.medusa_head.parameters():
            p.normal_(0, 0.3)
    heads = folder / "medusa"
    MedusaConfig(medusa_num_heads=len(MEDUSA_TOPK), medusa_num_layers=1,
                 base_model_name_or_path=str(base)).save_pretrained(heads)
    torch.save(model.medusa_head.state_dict(), heads / "medusa_lm_head.pt")
    return model, heads


def _dense_tree_paths(topk: list[int]) -> list[list[int]]:
    """medusa-llm's cartesian tree as rank paths: every (i_1..i_d) with i_j < topk[j-1]."""
    paths, level = [], [[]]
    for k in topk:
        level = [p + [i] for p in level for i in range(k)]
        paths += level
    return paths


def _our_medusa(folder: Path, target, prompt: torch.Tensor):
    """Our heads loaded by path: logits [K, n, V] on the target's final hidden states, and the draft
    tree (tokens in our topological order) that our drafter builds from the last row."""
    from methods.medusa.drafter import TreeSkeleton, load_medusa, resolve_choices

    heads = load_medusa(folder, target).float().eval()
    h = target_hidden_states(target, prompt)[-1][0]
    with torch.inference_mode():
        logits = heads(h).float()
        last = logits[:, -1]
        top = torch.topk(last, max(MEDUSA_TOPK), dim=-1)
        skeleton = TreeSkeleton.build(resolve_choices(_dense_tree_paths(MEDUSA_TOPK)), heads.num_heads,
                                      max(MEDUSA_TOPK))
        tree = skeleton.tree(top.indices, top.values - torch.logsumexp(last, -1, keepdim=True))
    return logits, tree.tokens


def test_medusa_matches_medusa_llm_heads(tmp_path):
    require_reference("medusa")
    from medusa.model.utils import generate_candidates, generate_medusa_buffers

    target = tiny_parity_target()
    theirs, folder = _medusa_llm_heads(target, tmp_path)
    prompt = torch.randint(0, 60, (1, 10), generator=torch.Generator().manual_seed(5))
    ref_logits, _, orig = theirs(prompt, output_orig=True)  # [K, 1, n, V]: their forward on the base model
    buffers = generate_medusa_buffers([1] + MEDUSA_TOPK, device="cpu")
    _, tree_candidates = generate_candidates(ref_logits[:, :, -1:], orig, MEDUSA_TOPK, buffers["tree_indices"], 0.0)
    ours, tokens = _our_medusa(folder, target, prompt)
    assert_parity(ours, ref_logits[:, 0].float())
    assert tokens.tolist() == tree_candidates[0, 1:].tolist()  # the same draft tree, node for node
    perturb_saved_weight(folder, "1.0.linear.weight", file="medusa_lm_head.pt")
    with pytest.raises(AssertionError):
        assert_parity(_our_medusa(folder, target, prompt)[0], ref_logits[:, 0].float())


# ---- EAGLE-3: vLLM's speculators (speculators.models.eagle3) ------------------------------------
TTT_STEPS = 3  # drafting steps compared: step 0 reads the target's taps, later steps the drafter's own output
AUX_IDS = [1, 2, 3]  # speculators' ids: HF hidden_states indices (vLLM collects the input of layer i)
DRAFT_VOCAB = 48


def _speculators_eagle3(target, folder: Path, fc_norm: bool = False):
    """speculators' Eagle3DraftModel built as its trainer builds it (from_training_args on the saved
    verifier: vocab mappings from a token distribution, the verifier's embedding and lm_head rows),
    random like a trained drafter, saved with save_pretrained."""
    require_reference("speculators")
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    verifier = folder / "verifier"
    target.model.save_pretrained(verifier)
    layer = target.model.config.__class__.from_dict(target.model.config.to_dict())
    layer.num_hidden_layers = 1
    freq = {t: int(c) for t, c in enumerate(torch.randint(1, 100, (64,), generator=torch.Generator().manual_seed(6)))}
    d2t, t2d = build_vocab_mappings_from_distribution(freq, DRAFT_VOCAB, 64)
    torch.manual_seed(7)
    model = Eagle3DraftModel.from_training_args(layer, t2d=t2d, d2t=d2t, verifier_name_or_path=str(verifier),
                                                draft_vocab_size=DRAFT_VOCAB, norm_before_residual=False,
                                                fc_norm=fc_norm, ttt_steps=TTT_STEPS, target_layer_ids=AUX_IDS,
                                                draft_attn_impl="sdpa").float().eval()
    with torch.no_grad():  # non-trivial norms, as after training
        for name, p in model.named_parameters():
            if "norm" in name and not name.startswith("verifier"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder / "speculators")
    return model, folder / "speculators"


def _speculators_logits(model, target, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Their forward (ttt_steps drafting steps): logits of every step, read from their lm_head, and
    their draft tokens. Their step 0 pairs the taps of position j with token j+1."""
    hidden = target_hidden_states(target, ids)
    taps = torch.cat([hidden[i] for i in AUX_IDS], -1)
    shifted = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], 1)
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out.detach()))
    try:
        with torch.no_grad():
            drafts = model(taps, shifted, torch.zeros_like(ids), position_ids=torch.arange(ids.shape[1])[None],
                           ttt_steps=TTT_STEPS)
    finally:
        hook.remove()
    return torch.stack([s[0] for s in seen]).float(), drafts


def _our_eagle3_logits(folder: Path, target, ids: torch.Tensor, tap_shift: int = 0):
    """Our Eagle3Model loaded by path, the same steps through its training-time-test unroll (the
    recurrence its tree decode runs): logits [steps, n, draft V] and the draft model itself."""
    from methods.eagle3.drafter import Eagle3Model

    model = Eagle3Model.load(folder, target).float().eval()
    hidden = target_hidden_states(target, ids)
    features = model.features({i: hidden[i - tap_shift] for i in model.taps})
    with torch.no_grad():
        steps = [model.logits(h) for h in model.unroll(ids, features, TTT_STEPS)]
    return torch.stack([s[0] for s in steps]).float(), model


@pytest.mark.parametrize("fc_norm", [False, True], ids=["plain", "fc_norm"])
def test_eagle3_matches_speculators_draft_model(tmp_path, fc_norm):
    target = tiny_parity_target()
    theirs, folder = _speculators_eagle3(target, tmp_path, fc_norm)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(8))
    ref, drafts = _speculators_logits(theirs, target, ids)
    ours, model = _our_eagle3_logits(folder, target, ids)
    assert model.taps == tuple(AUX_IDS)
    assert_parity(ours, ref)
    # Their draft tokens (draft vocabulary), and the same ids mapped to the target's vocabulary by both.
    assert torch.equal(ours.argmax(-1), torch.cat(drafts))
    assert torch.equal(model.to_target_ids(ours.argmax(-1)), ours.argmax(-1) + theirs.d2t[ours.argmax(-1)])
    with pytest.raises(AssertionError):  # taps read one layer late (SpecForge's convention for the same name)
        assert_parity(_our_eagle3_logits(folder, target, ids, tap_shift=-1)[0], ref)
    perturb_saved_weight(folder, "layers.0.self_attn.v_proj.weight")
    with pytest.raises(AssertionError):
        assert_parity(_our_eagle3_logits(folder, target, ids)[0], ref)


@pytest.mark.parametrize("flag", ["norm_before_residual", "norm_output"])
def test_speculators_eagle3_variants_we_do_not_run_are_refused(tmp_path, flag):
    from methods.eagle3.drafter import Eagle3Model
    from specbench.errors import SpecbenchError

    target = tiny_parity_target()
    _, folder = _speculators_eagle3(target, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config[flag] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecbenchError) as err:
        Eagle3Model.load(folder, target)
    assert flag in str(err.value) and "\n" not in str(err.value)


# ---- DFlash: vLLM's speculators (speculators.models.dflash) -------------------------------------
SPEC_AUX_IDS = [2, 3]  # HF hidden_states indices (z-lab's target_layer_ids [1, 2])


def _speculators_dflash(target, folder: Path, dflash2: bool = False):
    """speculators' DFlashDraftModel built as its trainer builds it (from_training_args on the saved
    verifier; the verifier's embedding and lm_head), random like a trained drafter, save_pretrained."""
    require_reference("speculators")
    from transformers import Qwen3Config

    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dflash2 import DFlash2DraftModel

    verifier = folder / "verifier"
    target.model.save_pretrained(verifier)
    layer = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=512,
                        initializer_range=0.2)
    torch.manual_seed(9)
    extra = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=4) if dflash2 else {}
    model = (DFlash2DraftModel if dflash2 else DFlashDraftModel).from_training_args(
        layer, verifier_name_or_path=str(verifier), draft_vocab_size=64, block_size=BLOCK,
        target_layer_ids=SPEC_AUX_IDS, mask_token_id=MASK_ID, draft_attn_impl="sdpa", **extra).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and not name.startswith("verifier"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder / "speculators")
    return model, folder / "speculators"


def _speculators_block_logits(model, target, prompt: torch.Tensor, bonus: int) -> torch.Tensor:
    """Their anchored-block forward with one anchor: the bonus at position n (the only loss_mask
    position), context = the taps of positions < n, block [bonus, MASK...] -> logits of slots 1..L-1."""
    n = prompt.shape[1]
    ids = torch.cat([prompt, torch.tensor([[bonus]]), torch.zeros(1, BLOCK, dtype=torch.long)], 1)
    hidden = target_hidden_states(target, ids)
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, n] = 1
    with torch.no_grad():
        _, logits, *_ = model._backbone_forward(torch.cat([hidden[i] for i in SPEC_AUX_IDS], -1), ids, loss_mask,
                                                hidden[-1], torch.zeros_like(ids),
                                                position_ids=torch.arange(ids.shape[1])[None], max_anchors=1)
    return logits[0, 1:BLOCK].float()


def test_dflash_matches_speculators_draft_model(tmp_path):
    target = tiny_parity_target()
    theirs, folder = _speculators_dflash(target, tmp_path)
    prompt = torch.randint(0, 60, (1, 10), generator=torch.Generator().manual_seed(10))
    ref = _speculators_block_logits(theirs, target, prompt, bonus=11)
    assert_parity(_our_block_logits(folder, target, prompt, bonus=11), ref)
    with pytest.raises(AssertionError):  # aux ids read as z-lab's (one layer late)
        assert_parity(_our_block_logits(folder, target, prompt, bonus=11, tap_shift=-1), ref)
    perturb_saved_weight(folder, "layers.1.mlp.up_proj.weight")
    with pytest.raises(AssertionError):
        assert_parity(_our_block_logits(folder, target, prompt, bonus=11), ref)


def test_dflash2_from_speculators_is_refused_in_one_line(tmp_path):
    from methods.dflash.drafter import DFlashModel
    from specbench.errors import SpecbenchError

    target = tiny_parity_target()
    _, folder = _speculators_dflash(target, tmp_path, dflash2=True)
    with pytest.raises(SpecbenchError) as err:
        DFlashModel.load(folder, target)
    line = str(err.value)
    assert "\n" not in line and "DFlash-2" in line and "selector" in line


def test_medusa_llm_generate_loop_matches_our_engine(tmp_path):
    """The medusa parity adapter: medusa-llm's own medusa_generate on its own Llama class (GQA heads
    repeated, RoPE rebuilt with the target's theta) gives our engine's tokens and per-step accept
    lengths, greedy, with our heads written into its layout. Heads made weak enough that some drafts
    are rejected and some accepted."""
    require_reference("medusa")
    from transformers import LlamaConfig, LlamaForCausalLM

    from methods.medusa.drafter import MedusaDrafter, MedusaHeads, MedusaOptions
    from methods.parity.medusa import MedusaLLM, dense_choices_json
    from parity_refs import save_tiny_tokenizer
    from specbench.engine.loop import GenerationConfig, generate
    from specbench.errors import SpecbenchError
    from specbench.engine.target import Target
    from specbench.engine.verify import SamplingParams
    from transformers import AutoTokenizer

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    target = Target(model, tokenizer=AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path / "tok")), name="tiny")
    heads = MedusaHeads(2, 32, 64, num_layers=1, shared_lm_head=True)
    with torch.no_grad():
        heads.res_weight.normal_(0, 0.1)
    heads.attach_lm_head(model.get_output_embeddings())
    sparse = MedusaDrafter(MedusaOptions(topk=3, max_nodes=6), heads=heads)  # mc_sim_7b_63's first 6 paths
    sparse.setup(target)
    with pytest.raises(SpecbenchError) as err:  # a tree medusa-llm cannot run: one line naming a dense one
        MedusaLLM().load(target, sparse, sparse.options)
    assert "dense" in str(err.value) and "\n" not in str(err.value)
    drafter = MedusaDrafter(MedusaOptions(choices=dense_choices_json([3, 2]), topk=3), heads=heads)
    drafter.setup(target)
    ref = MedusaLLM()
    ref.load(target, drafter, drafter.options)
    accepted = 0
    for seed in range(3):
        prompt = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
        ours = generate(target, drafter, prompt, GenerationConfig(24, SamplingParams(0.0), seed=0), method="medusa")
        theirs = ref.generate(prompt, 24)
        assert ours.new_tokens == theirs.tokens
        assert len(ours.accept_lengths) == len(theirs.accept_lengths)  # the same verify steps
        assert ours.accept_lengths[:-1] == theirs.accept_lengths[:-1]  # the last may be cut at the budget
        accepted += sum(theirs.accept_lengths)
    assert accepted > 0  # drafts were accepted, so the loop's tree path ran
