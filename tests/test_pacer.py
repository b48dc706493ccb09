"""PACER and the confidence-heuristic baseline: the packed training mask and labels, the threshold
schedule, inference rows equal to training rows, greedy equality and the T = 1 distribution."""

import random

import pytest
import torch

from methods.pacer.drafter import PacerDrafter, PacerNoGrowthDrafter, PacerOptions, keep_drafting
from methods.pacer.model import PreVerifier
from methods.pacer.packing import collate, pack_example, packed_visibility, replay_steps, step_labels
from methods.sps.confidence import SpSConfidenceDrafter, SpSConfidenceOptions, best_threshold, next_gamma
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine.loop import GenerationConfig, generate
from specbench.errors import SpecbenchError
from specbench.engine.verify import SamplingParams
from stats import chi2_pvalue
from tiny import tiny_llama, tiny_target

PROMPTS = [[3, 17, 5, 42, 8], [60, 7, 7, 7, 19, 33, 2, 9, 41]]


def ready(drafter, target):
    drafter.setup(target)
    return drafter


def baseline(target, prompt, config):
    return generate(target, ready(VanillaDrafter(), target), prompt, config).new_tokens


def noisy_copy(seed: int, noise: float, **kwargs):
    """The target's weights with a perturbed lm_head: a draft that agrees often but not always."""
    model = tiny_llama(seed, **kwargs)
    torch.manual_seed(100 + seed)
    with torch.no_grad():
        model.lm_head.weight.add_(noise * torch.randn_like(model.lm_head.weight))
    return model


class ScriptedPreVerifier(torch.nn.Module):
    """Stands in for M_B: returns the acceptance logits a script dictates, ignoring its inputs."""

    def __init__(self, alphas, hidden_size: int = 32) -> None:
        super().__init__()
        self.alphas, self.hidden_size, self.calls = alphas, hidden_size, 0

    def forward(self, rows, draft_pos, pos, attention_mask=None, cache=None):
        self.calls += 1
        alpha = torch.as_tensor(self.alphas(self.calls, draft_pos[0]), dtype=torch.float32).clamp(1e-6, 1 - 1e-6)
        return torch.logit(alpha).reshape(1, -1)


def pacer(target, draft, mb, **options):
    return ready(PacerDrafter(PacerOptions(**options), model=draft, preverifier=mb), target)


# ---- training data ------------------------------------------------------------------------------
def test_packed_mask_draft_sees_prefix_before_its_step_and_its_own_earlier_drafts():
    prefix_rows, steps = 9, [(4, 3), (6, 2), (9, 4)]  # (first draft position c, drafts m)
    mask = packed_visibility(prefix_rows, steps)
    assert torch.equal(mask[:prefix_rows, :prefix_rows], torch.ones(9, 9, dtype=torch.bool).tril())
    assert not mask[:prefix_rows, prefix_rows:].any()  # committed rows never see drafts
    row = prefix_rows
    for c, m in steps:
        for j in range(1, m + 1):
            seen = set(mask[row + j - 1].nonzero().flatten().tolist())
            prefix = set(range(c - 1))  # rows of the committed tokens at positions 1..c-1
            own = set(range(row, row + j))  # drafts 1..j of this step
            assert seen == prefix | own, (c, j)
        row += m


def test_step_labels_are_one_up_to_the_first_mismatch_then_zero():
    assert step_labels(0, 4) == [0, 0, 0, 0]
    assert step_labels(2, 5) == [1, 1, 0, 0, 0]
    assert step_labels(3, 3) == [1, 1, 1]


def test_replay_follows_greedy_speculative_decoding():
    tokens = [5, 1, 2, 3, 4, 5, 6, 7]
    greedy = [1, 9, 3, 4, 8, 6, 7, 0]  # greedy[j]: the draft's next token after tokens[:j+1]
    # start 2: drafts 9 != 2 -> a=0, bonus 2; start 3: 3, 4 match, 8 != 5 -> a=2, bonus 5; start 6: 7 matches, end.
    assert replay_steps(greedy, tokens, 2) == [(2, 0), (3, 2), (6, 2)]


def test_packed_example_labels_and_rows_match_brute_force_drafting():
    """Each step's labels and draft rows equal drafting from that step's prefix with plain forwards."""
    draft = noisy_copy(0, 0.6)
    target = tiny_llama(0)
    prompt = [3, 17, 5, 42]
    with torch.no_grad():
        seq = list(prompt)
        for _ in range(20):  # the "regenerated response": the target's greedy answer
            seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
    window = 5
    item = pack_example(draft, {"prompt_ids": prompt, "response_ids": seq[len(prompt):]}, window, 64, torch.float32)
    row = item["prefix_rows"]
    assert sum(item["accepted"]) > 0 and any(a < m for a, (_, m) in zip(item["accepted"], item["steps"]))
    for (c, m), a in zip(item["steps"], item["accepted"]):
        ids, states = seq[:c], []
        with torch.no_grad():
            for _ in range(m):
                out = draft(torch.tensor([ids]), output_hidden_states=True)
                states.append(out.hidden_states[-1][0, -1])
                ids.append(int(out.logits[0, -1].argmax()))
        drafts = ids[c:]
        matched = next((i for i, (d, t) in enumerate(zip(drafts, seq[c:])) if d != t), m)
        assert a == min(matched, m) and item["labels"][row: row + m].tolist() == step_labels(matched, m)
        torch.testing.assert_close(item["hidden"][row: row + m], torch.stack(states), atol=1e-5, rtol=1e-4)
        assert item["position_ids"][row: row + m].tolist() == list(range(c, c + m))
        assert item["draft_pos"][row: row + m].tolist() == list(range(1, m + 1))
        row += m


# ---- inference: threshold schedule, rows, losslessness ---------------------------------------------
def test_threshold_resets_each_step_and_grows_by_rho_within_a_step():
    """With every block scoring 0.8, t = 0.7 * 1.05^k passes blocks k = 0, 1, 2 and stops at k = 3
    (0.7 * 1.05^3 = 0.81): 4 blocks every step, which holds only if t restarts at 0.7 each step."""
    target = tiny_target(0)
    drafter = pacer(target, tiny_llama(1), ScriptedPreVerifier(lambda call, pos: [0.8] * len(pos[pos > 0])),
                    block=2, threshold=0.7, rho=1.05, max_gamma=48)
    record = generate(target, drafter, PROMPTS[0], GenerationConfig(max_new_tokens=30))
    assert record.tree_sizes and set(record.tree_sizes) == {8}
    # No growth: 0.8 > 0.7 forever, so only the cap stops drafting.
    flat = ready(PacerNoGrowthDrafter(PacerNoGrowthDrafter.Options(block=2, max_gamma=10), model=tiny_llama(1),
                                      preverifier=ScriptedPreVerifier(lambda c, p: [0.8] * len(p[p > 0]))), target)
    assert set(generate(target, flat, PROMPTS[0], GenerationConfig(max_new_tokens=30)).tree_sizes) == {10}
    assert keep_drafting([0.9, 0.5], 0.69) and not keep_drafting([0.9, 0.5], 0.7)  # stop when mean <= t


def test_inference_scores_equal_the_packed_training_forward():
    """M_B with its KV cache during decoding gives the same α̂ as the packed training sequence built
    from the generated answer: the row convention and the Fig. 5 mask agree with inference."""
    torch.manual_seed(0)
    target, draft = tiny_target(0), noisy_copy(0, 0.6)
    mb = PreVerifier(draft.config, window=8).float().eval()
    with torch.no_grad():
        mb.head.weight.normal_(0, 0.5)
    drafter = pacer(target, draft, mb, block=2, threshold=0.5, rho=1.0, max_gamma=8)
    prompt = PROMPTS[1]
    record = generate(target, drafter, prompt, GenerationConfig(max_new_tokens=40))
    item = pack_example(draft, {"prompt_ids": prompt, "response_ids": record.new_tokens}, 8, 64, torch.float32)
    assert item["accepted"][:-1] == record.accept_lengths[: len(item["accepted"]) - 1]
    batch = collate([item])
    mask = torch.zeros(batch.mask.shape).masked_fill_(~batch.mask, torch.finfo(torch.float32).min)
    with torch.no_grad():
        trained = torch.sigmoid(mb(batch.hidden, batch.draft_pos, batch.position_ids, attention_mask=mask))[0]
    row, checked = item["prefix_rows"], 0
    for (c, m), inferred in zip(item["steps"][:-1], drafter.step_alphas):
        k = min(m, len(inferred))
        torch.testing.assert_close(trained[row: row + k], torch.tensor(inferred[:k]), atol=2e-5, rtol=1e-4)
        row, checked = row + m, checked + k
    assert checked > 10 and len(set(record.tree_sizes)) > 1


@pytest.mark.parametrize("block,threshold", [(1, 0.5), (2, 0.45), (4, 0.7)])
def test_pacer_greedy_equals_baseline(block, threshold):
    target = tiny_target(0)
    draft = noisy_copy(0, 0.6)
    mb = PreVerifier(draft.config, window=8).float().eval()
    with torch.no_grad():
        mb.head.weight.normal_(0, 0.5)
    drafter = pacer(target, draft, mb, block=block, threshold=threshold, rho=1.05, max_gamma=12)
    config = GenerationConfig(max_new_tokens=40)
    for prompt in PROMPTS:
        record = generate(target, drafter, prompt, config)
        assert record.new_tokens == baseline(target, prompt, config)
        assert record.forwards["preverify"] >= record.n_verify and record.extra["mean_gamma"] >= block


from test_lossless import exact_first_two  # noqa: E402  (same V)

V = 8
SAMPLES = 1_000  # 20k-sample checks of the chain rule itself are in test_sampling_rules.py




def test_pacer_sampling_matches_target_distribution():
    """T = 1 with stop decisions that vary call to call (γ from 1 to 4): still the target's law."""
    target = tiny_target(4, vocab=V, init=0.3)
    rng = random.Random(0)
    scores = lambda call, pos: [rng.random() for _ in range(int((pos > 0).sum()))]  # noqa: E731
    drafter = pacer(target, tiny_llama(5, vocab=V, init=0.3), ScriptedPreVerifier(scores), block=1, threshold=0.5,
                    max_gamma=4)
    prompt, params, samples, sizes = [1, 4, 2], SamplingParams(temperature=1.0), [], set()
    for seed in range(SAMPLES):
        record = generate(target, drafter, prompt, GenerationConfig(max_new_tokens=2, sampling=params, seed=seed))
        samples.append(tuple(record.new_tokens[:2]))
        sizes.update(record.tree_sizes)
    stat, pvalue = chi2_pvalue(samples, exact_first_two(target, prompt))
    assert pvalue > 1e-3, f"chi2={stat:.1f} p={pvalue:.4f}"
    assert len(sizes) > 1


def test_bad_options_are_one_line_errors(tmp_path):
    with pytest.raises(SpecbenchError, match="block"):
        PacerDrafter(PacerOptions(block=0))
    with pytest.raises(SpecbenchError, match="rho"):
        PacerDrafter(PacerOptions(rho=0.9))
    with pytest.raises(SpecbenchError, match="no pre-verification layer"):
        ready(PacerDrafter(PacerOptions(pacer=str(tmp_path)), model=tiny_llama(1)), tiny_target(0))


def test_a_layer_trained_over_another_draft_is_refused(tmp_path):
    """The layer reads its draft's hidden states: loading it over a retrained draft is a one-line error."""
    from methods.pacer.checkpoint import draft_fingerprint, load_preverifier, save_preverifier

    target, draft, other = tiny_target(0), noisy_copy(0, 0.6), noisy_copy(0, 0.7)
    assert draft_fingerprint(draft) == draft_fingerprint(noisy_copy(0, 0.6).to(torch.bfloat16))
    assert draft_fingerprint(draft) != draft_fingerprint(other)
    save_preverifier(tmp_path / "mb", PreVerifier(draft.config, window=8), target, "drafts/a", {}, draft)
    assert load_preverifier(tmp_path / "mb", target, draft, torch.float32).window == 8
    with pytest.raises(SpecbenchError, match="trained over another draft model"):
        load_preverifier(tmp_path / "mb", target, other, torch.float32)


def test_position_embeddings_are_drawn_at_the_scale_of_the_states_they_join():
    """e_i is added to the draft's final states; at a 0.5B draft's scale (RMS ~6.5) a 0.02 embedding vanishes."""
    torch.manual_seed(0)
    mb = PreVerifier(tiny_llama(0).config, window=32)
    states = 5.0 * torch.randn(300, mb.hidden_size)
    std = mb.scale_positions_to(states)
    assert std == pytest.approx(5.0, rel=0.05)
    assert mb.pos.weight[0].abs().sum() == 0 and mb.pos.weight[1:].std().item() == pytest.approx(std, rel=0.1)
    plain = PreVerifier(tiny_llama(0).config, window=8, use_pos=False)
    assert plain.scale_positions_to(states) == pytest.approx(std) and plain.pos is None


def test_a_layer_saved_in_bf16_is_half_the_file_and_scores_as_its_rounded_weights(tmp_path):
    """`--bf16-weights` (the wide pair's layer): the file halves, and loading gives the bf16-rounded layer."""
    from safetensors.torch import load_file

    from methods.pacer.checkpoint import load_preverifier, save_preverifier

    target, draft = tiny_target(0), noisy_copy(0, 0.6)
    torch.manual_seed(0)
    mb = PreVerifier(draft.config, window=8)
    save_preverifier(tmp_path / "fp32", mb, target, "d", {}, draft)
    save_preverifier(tmp_path / "bf16", mb, target, "d", {}, draft, torch.bfloat16)
    sizes = {d: (tmp_path / d / "model.safetensors").stat().st_size for d in ("fp32", "bf16")}
    assert sizes["bf16"] < 0.6 * sizes["fp32"]
    assert all(v.dtype == torch.bfloat16 for v in load_file(tmp_path / "bf16" / "model.safetensors").values())
    loaded = load_preverifier(tmp_path / "bf16", target, draft, torch.float32)
    rounded = {k: v.to(torch.bfloat16).float() for k, v in mb.state_dict().items() if not k.startswith("body.embed")}
    for k, v in rounded.items():
        torch.testing.assert_close(loaded.state_dict()[k], v, atol=0, rtol=0)


# ---- the confidence heuristic (HF assisted generation) --------------------------------------------
def test_heuristic_schedule_and_threshold_fit():
    assert next_gamma(5, 5, 5) == 7 and next_gamma(5, 2, 5) == 4 and next_gamma(1, 0, 1) == 1
    assert best_threshold([0.9, 0.8], [1, 0]) is None  # too few samples
    probs = [0.95, 0.9, 0.85, 0.3, 0.2, 0.1, 0.6]
    matched = [1, 1, 1, 0, 0, 0, 1]
    assert best_threshold(probs, matched) == pytest.approx(0.6)  # separates the classes exactly


def test_confidence_heuristic_grows_when_all_accepted_and_stays_lossless():
    target = tiny_target(0)
    config = GenerationConfig(max_new_tokens=40)
    same = ready(SpSConfidenceDrafter(SpSConfidenceOptions(gamma=2, threshold=0.0, adapt_threshold=False),
                                      model=tiny_llama(0)), target)
    record = generate(target, same, PROMPTS[0], config)
    assert record.tree_sizes[:3] == [2, 4, 6]  # every draft accepted: +2 per call
    timid = ready(SpSConfidenceDrafter(SpSConfidenceOptions(threshold=1.0, adapt_threshold=False),
                                       model=tiny_llama(1)), target)
    assert set(generate(target, timid, PROMPTS[0], config).tree_sizes) == {1}  # every draft below 1.0
    adaptive = ready(SpSConfidenceDrafter(model=noisy_copy(0, 0.6)), target)
    for prompt in PROMPTS:
        assert generate(target, adaptive, prompt, config).new_tokens == baseline(target, prompt, config)
