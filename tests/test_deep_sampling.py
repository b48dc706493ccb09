"""T = 1 through the engine, deep: for every registered method, the first DEPTH committed tokens
follow the target's exact law, position by position: each token is compared with the target's
conditional given the sampled prefix (stats.sequential_chi2, per-prefix buckets, plus
stats.loglik_z, which catches corrupted contexts whose errors point a different way for every
prefix; Bonferroni over the two). Drafts are accepted at depth >= 3 in every run, so tree walks,
residuals and cache compaction after deep acceptances are really exercised. Each method also has
a negative control: the same run with one deliberately broken step must fail the same test.

A 4-token vocabulary keeps prefixes few enough for exact per-prefix buckets and trees wide enough
(a sampled token is usually among the drafted children) to be accepted deep even with untrained
drafters; SpecBlock, which needs 20 tokens, gets top-4 sampling and a briefly trained drafter."""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
import zlib

import numpy as np
import pytest
import torch

from methods.ddtree import DDTreeDrafter
from methods.dflash.drafter import DFlashDrafter, DFlashModel
from methods.dvi import DVIDrafter, DVIOptions
from methods.eagle3.drafter import Eagle3Drafter, Eagle3Model, Eagle3Options, eagle3_taps
from methods.lookahead import LookaheadDrafter, LookaheadOptions
from methods.medusa.drafter import MedusaDrafter, MedusaHeads, MedusaOptions
from methods.pacer.drafter import PacerDrafter, PacerNoGrowthDrafter, PacerNoPosDrafter, PacerOptions
from methods.pacer.model import PreVerifier
from methods.pld import PLDDrafter, PLDOptions
from methods.specblock.drafter import SpecBlockDrafter, SpecBlockOptions
from methods.specblock.adapt import AdaptOptions, OSDOptions, SpecBlockAdaptDrafter, SpecBlockOSDDrafter
from methods.specblock.model import SpecBlockConfig, SpecBlockModel
from methods.specblock.objective import LossSettings, SpecBlockLoss
from methods.sps.drafter import SpSDrafter, SpSOptions
from methods.sps.confidence import SpSConfidenceDrafter, SpSConfidenceOptions
from methods.suffix import SuffixDrafter, SuffixOptions, arctic_available
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine import loop as engine, kvcache
from specbench.engine.registry import available_methods, method_class
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.target import Target
from specbench.training.batch import TrainBatch
from specbench.engine.verify import SamplingParams, WalkResult, logits_to_probs, sample_token
from stats import loglik_z, sequential_chi2
from tiny import tiny_target

V = 4
DEPTH = 8  # committed tokens checked per sample (the first comes from prefill, the rest from verifies)
PROMPT = [1, 3, 0, 2]
PARAMS = SamplingParams(temperature=1.0)
# SpecBlock's rank features read a draft's top-20 logits, so its targets have 20 tokens; top-k = 4
# sampling keeps 4 live tokens per position (the verifier and the exact law use the same filter).
SPECBLOCK_VOCAB = 20
SPECBLOCK_PARAMS = SamplingParams(temperature=1.0, top_k=V)
ALPHA = 1e-4  # per test: lossless runs must stay above it, broken ones must fall below
SAMPLES = 200
BROKEN_SAMPLES = 150
DEEP_CALLS = 10  # verify calls that accepted >= 3 drafts, at least, in each lossless run


def small_target(layers: int = 2, vocab: int = V) -> Target:
    return tiny_target(4, vocab=vocab, layers=layers, init=0.3)  # eos_token_id None: nothing stops early


def noisy_copy(model, noise: float, seed: int):
    """A draft model that agrees with ``model`` often but not always (perturbed lm_head)."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        draft.lm_head.weight.add_(noise * torch.randn(draft.lm_head.weight.shape, generator=gen))
    return draft


# ---- one drafter per registered method ----------------------------------------------------------
def sps_like(cls, options):
    def build():
        target = small_target()
        return target, cls(options, model=noisy_copy(target.model, 0.5, 1))
    return build


def pacer(cls, use_pos=True, **options):
    def build():
        target = small_target()
        draft = noisy_copy(target.model, 0.3, 2)
        torch.manual_seed(5)
        mb = PreVerifier(draft.config, window=8, use_pos=use_pos).float().eval()
        with torch.no_grad():
            mb.head.weight.normal_(0, 0.5)  # varying stop decisions: chains of 2 to 6
        return target, cls(PacerOptions(block=2, threshold=0.3, max_gamma=6, **options), model=draft, preverifier=mb)
    return build


def dvi(objective):
    def build():
        return small_target(), DVIDrafter(DVIOptions(layer=1, k=5, objective=objective, lr=1e-2, warmup=5, ramp=10,
                                                     batch=8))
    return build


def medusa():
    target = small_target()
    torch.manual_seed(0)
    heads = MedusaHeads.for_target(target, 4, num_layers=1, shared_lm_head=True)
    with torch.no_grad():
        heads.res_weight.normal_(0, 0.3)
    return target, MedusaDrafter(MedusaOptions(topk=3, max_nodes=24), heads=heads)


def eagle3():
    target = small_target(layers=4)
    torch.manual_seed(0)
    return target, Eagle3Drafter(Eagle3Options(top_k=3, depth=4, total_tokens=20), model=Eagle3Model.from_target(target))


@functools.lru_cache(maxsize=None)
def specblock_target() -> Target:
    return small_target(layers=4, vocab=SPECBLOCK_VOCAB)


@functools.lru_cache(maxsize=None)
def trained_specblock(prefix_broadcast: bool = True, layer_shift: bool = True, steps: int = 150) -> SpecBlockModel:
    """A SpecBlock drafter briefly trained on the target's own top-4 samples (an untrained one
    rarely gets past depth 2 among 20 tokens)."""
    target = specblock_target()
    gen = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.tensor([PROMPT] * 8), torch.zeros(8, 24, dtype=torch.long)], 1)
    with torch.no_grad():
        for i in range(len(PROMPT), ids.shape[1]):
            probs = logits_to_probs(target.model(ids[:, :i]).logits[:, -1], SPECBLOCK_PARAMS)
            ids[:, i] = torch.multinomial(probs, 1, generator=gen)[:, 0]
        hidden = target.model(ids, output_hidden_states=True).hidden_states
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, len(PROMPT):] = 1
    taps = {i: hidden[i].float() for i in set(eagle3_taps(4)) | {-1}}
    batch = TrainBatch(ids, torch.ones_like(ids), loss_mask, taps, target.model.lm_head)
    torch.manual_seed(0)
    config = SpecBlockConfig.from_target(target, SPECBLOCK_VOCAB, prefix_broadcast=prefix_broadcast,
                                         layer_shift=layer_shift)
    model = SpecBlockModel(config, eagle3_taps(4), target.model.get_input_embeddings()).train()
    loss = SpecBlockLoss(model, LossSettings(rank_start=0, cross_fraction=0.5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        value, _ = loss(batch)
        opt.zero_grad()
        value.backward()
        opt.step()
    return model.eval()


TREE = dict(budget=24, beam_width=4, branching=[4, 3, 2, 1])
LEARNING = dict(TREE, warmup_queries=0, buffer_queries=1, cooldown=0, cold_start_events=2, value_window=2, lr=1e-2)


def specblock(cls=SpecBlockDrafter, options=None, **config):
    def build():
        return specblock_target(), cls(options or SpecBlockOptions(**TREE), model=copy.deepcopy(trained_specblock(**config)))
    return build


def dflash(cls, **options):
    def build():
        target = small_target()
        torch.manual_seed(3)
        model = DFlashModel.from_target(target, layers=1, block_size=6, mask_token_id=V - 1, target_layer_ids=[0])
        return target, cls(cls.Options(**options), model=model.eval())
    return build



def suffix():
    if not arctic_available():
        pytest.skip("suffix needs arctic-inference (extra 'suffix')")
    # One drafter for every sample: its memory of earlier responses is what it drafts from.
    return small_target(), SuffixDrafter(SuffixOptions(max_spec=6, spec_factor=2.0))


# name -> (build, break): builds a fresh (target, drafter); the break names the negative control.
CASES = {
    "vanilla": (lambda: (small_target(), VanillaDrafter()), "forget_last_row"),
    "sps": (sps_like(SpSDrafter, SpSOptions(gamma=5)), "accept_one_more"),
    "sps-confidence": (sps_like(SpSConfidenceDrafter, SpSConfidenceOptions(gamma=3)), "accept_one_more"),
    "pacer": (pacer(PacerDrafter), "accept_one_more"),
    "pacer-no-pos": (pacer(PacerNoPosDrafter, use_pos=False), "accept_one_more"),
    "pacer-no-growth": (pacer(PacerNoGrowthDrafter, rho=1.0), "accept_one_more"),
    "dvi": (dvi("kl-rl"), "accept_one_more"),
    "dvi-kl": (dvi("kl"), "accept_one_more"),
    "dvi-pg": (dvi("pg"), "accept_one_more"),
    "dvi-ce": (dvi("ce"), "accept_one_more"),
    "dflash": (dflash(DFlashDrafter), "accept_one_more"),
    "ddtree": (dflash(DDTreeDrafter, budget=30), "rows_off_by_one"),
    "medusa": (medusa, "rows_off_by_one"),
    "eagle3": (eagle3, "rows_off_by_one"),
    "specblock": (specblock(), "rows_off_by_one"),
    "specblock-no-broadcast": (specblock(prefix_broadcast=False, steps=300), "rows_off_by_one"),  # ablations learn slower
    "specblock-no-shift": (specblock(layer_shift=False, steps=300), "rows_off_by_one"),
    "specblock-no-valid-prefix": (specblock(), "rows_off_by_one"),
    "specblock-uniform-tree": (specblock(options=method_class("specblock-uniform-tree").Options(
        budget=24, beam_width=4, uniform_width=3)), "rows_off_by_one"),
    "specblock-adapt": (specblock(SpecBlockAdaptDrafter, AdaptOptions(**LEARNING)), "rows_off_by_one"),
    "specblock-osd": (specblock(SpecBlockOSDDrafter, OSDOptions(**LEARNING)), "rows_off_by_one"),
    "pld": (lambda: (small_target(), PLDDrafter(PLDOptions(gamma=6, ngram=2))), "accept_one_more"),
    "suffix": (suffix, "rows_off_by_one"),
    # Window rows shifted by one node differ too little in a 2-layer random model; an extra accepted node does not.
    "lookahead": (lambda: (small_target(), LookaheadDrafter(LookaheadOptions(window=4, ngram=4, guess=4))),
                  "accept_one_more"),
}


# ---- the broken steps of the negative controls ----------------------------------------------------
def accepting_one_more(walk):
    """``walk`` off by one at the rejection point: the first rejected draft is accepted too and the bonus is
    drawn from its row."""
    def broken(tree, logits, params, generator=None, rule=None):
        result = walk(tree, logits, params, generator, rule)
        kids = tree.children.get(result.accepted[-1] if result.accepted else -1, {})
        if not kids:
            return result
        child = next(iter(kids.values()))
        return WalkResult(result.accepted + [child], sample_token(logits[child + 1], params, generator))
    return broken


def break_step(monkeypatch, kind: str) -> None:
    if kind == "forget_last_row":
        # Compaction drops the last kept row (for vanilla, the bonus): the target forgets tokens.
        real = Target.commit

        def commit(self, rows):
            real(self, rows)
            kvcache.truncate(self.cache, self.length - 1)
            self.length -= 1
        monkeypatch.setattr(Target, "commit", commit)
    elif kind == "rows_off_by_one":
        # Compaction keeps row i for node i (forgetting that row 0 is the root): every accepted
        # node's keys/values are those of the node listed before it.
        real = Target.commit
        monkeypatch.setattr(Target, "commit", lambda self, rows: real(self, [0] + [r - 1 for r in rows[1:]]))
    elif kind == "accept_one_more":
        # Off by one at the rejection point: the first rejected draft is accepted too and the
        # bonus is drawn from its row.
        monkeypatch.setattr(engine, "walk", accepting_one_more(engine.walk))
    else:
        raise ValueError(kind)


# ---- sampling and the exact law -------------------------------------------------------------------
def params_of(name: str) -> SamplingParams:
    return SPECBLOCK_PARAMS if name.startswith("specblock") else PARAMS


def run(name: str, samples: int):
    build, _ = CASES[name]
    target, drafter = build()
    drafter.setup(target)
    sequences, accepted = [], []
    start = time.perf_counter()
    config = GenerationConfig(max_new_tokens=DEPTH, sampling=params_of(name))
    for seed in range(samples):
        record = generate(target, drafter, PROMPT, dataclasses.replace(config, seed=seed))
        assert len(record.new_tokens) == DEPTH
        sequences.append(tuple(record.new_tokens))
        accepted.extend(verifier_accepts(record))
    return target, sequences, np.array(accepted), time.perf_counter() - start


def verifier_accepts(record) -> list[int]:
    """Each verify call's accepted depth as the walk found it, read from the depth counts (accept lengths
    count only the tokens the turn keeps, and these turns are only DEPTH tokens long)."""
    reached = [record.n_verify, *record.depth_accepts, 0]  # reached[k]: calls that accepted depth k or more
    return [k for k in range(len(reached) - 1) for _ in range(reached[k] - reached[k + 1])]


def exact_law(target: Target, sequences, params: SamplingParams):
    """(conditional, prefix probability) of every prefix of the sampled sequences, from one
    batched target forward over the distinct sequences."""
    distinct = sorted(set(sequences))
    ids = torch.tensor([PROMPT + list(s[:-1]) for s in distinct])
    with torch.no_grad():
        logits = target.model(ids).logits[:, len(PROMPT) - 1:].float()
    vocab = logits.shape[-1]
    probs = logits_to_probs(logits.reshape(-1, vocab), params).reshape(len(distinct), DEPTH, vocab).double().numpy()
    conditional, prefix_prob = {}, {(): 1.0}
    for seq, rows in zip(distinct, probs):
        for t in range(DEPTH):
            conditional[seq[:t]] = rows[t]
            if t:
                prefix_prob[seq[:t]] = prefix_prob[seq[:t - 1]] * rows[t - 1][seq[t - 1]]
    return conditional.__getitem__, prefix_prob.__getitem__


def pvalue(name: str, samples: int):
    target, sequences, accepted, seconds = run(name, samples)
    conditional, prefix_prob = exact_law(target, sequences, params_of(name))
    stat, dof, p_chi2 = sequential_chi2(sequences, conditional, prefix_prob)
    z, p_ll = loglik_z(sequences, conditional)
    p = min(1.0, 2 * min(p_chi2, p_ll))  # Bonferroni over the two tests
    print(f"{name}: chi2={stat:.1f} dof={dof} p={p_chi2:.2e} loglik z={z:.2f} p={p_ll:.2e} n={samples} "
          f"mean accepted={accepted.mean():.2f} "
          f"calls>=3={np.sum(accepted >= 3)} {seconds:.1f}s")
    return p, accepted


def test_every_registered_method_has_a_case():
    assert set(CASES) == set(available_methods())


@pytest.mark.parametrize("name", list(CASES))
def test_deep_sampling_matches_target(name):
    p, accepted = pvalue(name, SAMPLES)
    if name != "vanilla":  # drafts are accepted, deep ones too: the walk and compaction at depth ran
        assert accepted.mean() > 0.3 and np.sum(accepted >= 3) >= DEEP_CALLS, (accepted.mean(), np.sum(accepted >= 3))
    assert p > ALPHA


@pytest.mark.parametrize("name", list(CASES))
def test_broken_step_is_caught(name, monkeypatch):
    break_step(monkeypatch, CASES[name][1])
    p, _ = pvalue(name, BROKEN_SAMPLES)
    assert p < ALPHA


# ---- the statistics themselves, on direct draws from a known law ---------------------------------
def random_law(prefix: tuple) -> np.ndarray:
    """A fixed, prefix-dependent next-token law over V tokens."""
    logits = np.random.default_rng(zlib.crc32(bytes(prefix))).normal(size=V)
    return np.exp(logits) / np.exp(logits).sum()


def draw(law, n: int, seed: int) -> list[tuple]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seq: tuple = ()
        for _ in range(DEPTH):
            seq += (int(rng.choice(V, p=law(seq))),)
        out.append(seq)
    return out


def combined_pvalue(sequences, law) -> float:
    def prefix_prob(prefix):
        return float(np.prod([law(prefix[:t])[prefix[t]] for t in range(len(prefix))]))
    _, _, p_chi2 = sequential_chi2(sequences, law, prefix_prob)
    return min(1.0, 2 * min(p_chi2, loglik_z(sequences, law)[1]))


def test_statistics_accept_the_law_and_catch_a_context_error_after_position_four():
    assert combined_pvalue(draw(random_law, SAMPLES, 0), random_law) > ALPHA
    # From position 4 on, the sampler forgets the token at position 2 (a compaction-like error).
    forgetful = lambda prefix: random_law(prefix[:2] + prefix[3:] if len(prefix) >= 4 else prefix)  # noqa: E731
    assert combined_pvalue(draw(forgetful, BROKEN_SAMPLES, 0), random_law) < ALPHA
