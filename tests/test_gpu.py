"""The GPU tier (`pytest -m gpu`, skipped without CUDA): every registered method greedy-equal to
vanilla on CUDA in fp32 (bf16: match rate reported), every method that may share a batch greedy-equal
per request through the batched loop on CUDA, the same under the compiled engine (CUDA graphs), T = 1 through the engine on CUDA (the generator lives on
the GPU) alone and in batches, the device-built tree mask, flash-attn chains, and timing sanity."""

from __future__ import annotations

import time
from collections import deque

import pytest
import torch

from drafters import RandomTreeDrafter, RandomTreeOptions, SampledTreeDrafter, SampledTreeOptions, random_tree
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine.batch_loop import BatchConfig, BatchRequest, generate_batch
from specbench.engine.registry import available_methods, method_class
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.target import Target
from specbench.engine.tree import verify_visibility
from specbench.engine.verify import SamplingParams
from stats import chi2_pvalue
from test_batch_sampling import NEIGHBOURS
from tiny import tiny_llama, tiny_target

pytestmark = pytest.mark.gpu
CUDA = "cuda"
PROMPTS = [[3, 17, 5, 42, 8], [1, 2, 3], [60, 7, 7, 7, 19, 33, 2, 9, 41]]


def ready(drafter, target):
    drafter.setup(target)
    return drafter


def build(name: str):
    """(CPU target, drafter of method ``name`` built for it) with small untrained weights, as in the
    method's own CPU tests. A new registered method must be added here."""
    from methods.eagle3.drafter import Eagle3Model, Eagle3Options
    from methods.pacer.model import PreVerifier
    from methods.specblock.drafter import SpecBlockDrafter
    from methods.sps.drafter import SpSDrafter
    from methods.dvi import DVIDrafter
    from methods.dflash.drafter import DFlashDrafter
    from methods.ddtree import DDTreeDrafter
    from methods.medusa.drafter import MedusaDrafter
    from methods.pacer.drafter import PacerDrafter

    cls = method_class(name)
    if cls is VanillaDrafter:
        return tiny_target(0), cls()
    if issubclass(cls, PacerDrafter):
        from test_pacer import noisy_copy

        draft = noisy_copy(0, 0.6)
        mb = PreVerifier(draft.config, window=8, use_pos=name != "pacer-no-pos").float().eval()
        with torch.no_grad():
            mb.head.weight.normal_(0, 0.5)
        return tiny_target(0), cls(cls.Options(block=2, threshold=0.45, max_gamma=12), model=draft, preverifier=mb)
    if issubclass(cls, SpSDrafter):
        return tiny_target(0), cls(cls.Options(gamma=3), model=tiny_llama(1))
    if issubclass(cls, SpecBlockDrafter):
        from test_specblock import fresh

        target = tiny_target(0, layers=8, init=0.5)
        return target, cls(cls.Options(budget=24, beam_width=4), model=fresh(target, seed=9))
    if name == "eagle3":
        target = tiny_target(0, layers=8, init=0.5)
        torch.manual_seed(5)
        return target, cls(Eagle3Options(top_k=4, depth=3, total_tokens=20), model=Eagle3Model.from_target(target).eval())
    if issubclass(cls, (DFlashDrafter, DDTreeDrafter)):
        from test_dflash import new_model

        target = tiny_target(0, layers=6, init=0.5)
        options = cls.Options(budget=16) if issubclass(cls, DDTreeDrafter) else cls.Options()
        return target, cls(options, model=new_model(target, 5).eval())
    if issubclass(cls, DVIDrafter):
        return tiny_target(0, layers=4), cls(cls.Options(layer=2, k=3))
    if issubclass(cls, MedusaDrafter):
        from test_medusa import random_heads

        target = tiny_target(0)
        return target, cls(heads=random_heads(target, 4))
    if name in ("pld", "suffix", "lookahead"):  # training-free: no weights to build
        from methods.suffix import arctic_available

        if name == "suffix" and not arctic_available():
            pytest.skip("suffix needs arctic-inference (extra 'suffix')")
        return tiny_target(0), cls()
    raise AssertionError(f"no GPU test construction for method {name!r}; add one to tests/test_gpu.py")


def on_cuda(target: Target, drafter, dtype=torch.float32):
    """Move the target (in place) and every module the drafter holds to CUDA."""
    moved = Target(target.model.to(CUDA, dtype), name=target.name)
    for value in list(vars(drafter).values()):
        if isinstance(value, torch.nn.Module):
            value.to(CUDA, dtype)
    return moved, ready(drafter, moved)


@pytest.mark.parametrize("name", sorted(available_methods()))
def test_every_method_greedy_equals_vanilla_on_cuda_fp32(name):
    target, drafter = on_cuda(*build(name))
    vanilla = ready(VanillaDrafter(), target)
    config = GenerationConfig(max_new_tokens=32)
    for prompt in PROMPTS:
        record = generate(target, drafter, prompt, config)
        assert record.new_tokens == generate(target, vanilla, prompt, config).new_tokens
        assert record.forwards.get("target", 0) == record.n_verify


@pytest.mark.parametrize("name", sorted(available_methods()))
def test_every_method_greedy_equals_vanilla_on_cuda_compiled_engine(name):
    """The compiled engine on CUDA: static cache, graphs per row bucket captured as CUDA graphs
    (reduce-overhead); every method's fp32 text equals vanilla's under it, and graph builds stay off the clock."""
    eager, drafter = on_cuda(*build(name))
    target = Target(eager.model, name=eager.name, engine="compiled")
    assert target.static.cuda_graphs
    drafter = ready(drafter, target)
    vanilla = ready(VanillaDrafter(), target)
    config = GenerationConfig(max_new_tokens=32)
    for prompt in PROMPTS:
        record = generate(target, drafter, prompt, config)
        assert record.new_tokens == generate(target, vanilla, prompt, config).new_tokens
        assert record.new_tokens == generate(eager, ready(VanillaDrafter(), eager), prompt, config).new_tokens
        assert record.forwards.get("target", 0) == record.n_verify
        assert all(v >= 0 for v in record.times.values())


@pytest.mark.parametrize("name", sorted(available_methods()))
def test_every_method_runs_in_bf16_on_cuda_with_match_rate(name):
    """bf16 can flip near-ties between a tree verify and one-token decoding, so this reports the
    greedy match rate (share of positions equal to vanilla before the first difference)."""
    target, drafter = on_cuda(*build(name), dtype=torch.bfloat16)
    vanilla = ready(VanillaDrafter(), target)
    config = GenerationConfig(max_new_tokens=32)
    matched = total = 0
    for prompt in PROMPTS:
        ours = generate(target, drafter, prompt, config).new_tokens
        plain = generate(target, vanilla, prompt, config).new_tokens
        first_diff = next((i for i, (a, b) in enumerate(zip(ours, plain)) if a != b), min(len(ours), len(plain)))
        matched += first_diff
        total += len(plain)
        assert ours[0] == plain[0]  # same prefill: the first token cannot differ
    print(f"{name}: bf16 greedy match rate {matched / total:.3f}")


@pytest.mark.parametrize("name", sorted(available_methods()))
def test_every_batchable_method_is_lossless_per_request_in_cuda_batches(name):
    """Mixed prompt lengths share static and continuous batches on the GPU (rows padded, per-request positions
    and masks built there): each request's text equals its batch-1 vanilla text on CUDA."""
    target, drafter = build(name)
    if reason := drafter.batch_refusal():  # its refusal is tested on the CPU (test_batch_drafters.py)
        pytest.skip(f"{name} {reason}")
    target, drafter = on_cuda(target, drafter)
    vanilla = ready(VanillaDrafter(), target)
    config = GenerationConfig(max_new_tokens=32)
    expected = [generate(target, vanilla, prompt, config).new_tokens for prompt in PROMPTS]
    for batch in (BatchConfig(len(PROMPTS)), BatchConfig(2, continuous=True)):
        queue = deque(BatchRequest(b, list(prompt), config) for b, prompt in enumerate(PROMPTS))
        records = {request.key: record for request, record in generate_batch(target, drafter, queue, batch)}
        assert [records[b].new_tokens for b in range(len(PROMPTS))] == expected, batch
        assert all(r.batch["batched_drafting"] == drafter.batched_drafting for r in records.values())


# ---- T = 1 through the engine on CUDA (generator on the GPU) -------------------------------------
V = 8
SAMPLES = 1_200


def exact_first_two(target, prompt):
    with torch.no_grad():
        p1 = target.model(torch.tensor([prompt], device=CUDA)).logits[0, -1].float().softmax(-1)
        joint = {}
        for a in range(V):
            p2 = target.model(torch.tensor([prompt + [a]], device=CUDA)).logits[0, -1].float().softmax(-1)
            for b in range(V):
                joint[(a, b)] = float(p1[a] * p2[b])
    return joint


@pytest.mark.parametrize("make,rule", [
    (lambda: method_class("sps")(method_class("sps").Options(gamma=3), model=tiny_llama(5, vocab=V, init=0.3)), None),
    (lambda: RandomTreeDrafter(RandomTreeOptions(nodes=5, seed=3)), "A"),
    (lambda: RandomTreeDrafter(RandomTreeOptions(nodes=5, seed=3)), "B"),
    (lambda: SampledTreeDrafter(SampledTreeOptions(width=2, depth=2), model=tiny_llama(6, vocab=V, init=0.3)), "C"),
], ids=["sps-chain-rule-C", "random-tree-rule-A", "random-tree-rule-B", "sampled-tree-rule-C"])
def test_sampling_through_the_engine_on_cuda_matches_target(make, rule):
    from specbench.engine.verify import TreeRule

    target, drafter = on_cuda(tiny_target(4, vocab=V, init=0.3), make())
    prompt = [1, 4, 2]
    params = SamplingParams(temperature=1.0)
    tree_rule = TreeRule(rule) if rule else None
    samples = []
    for seed in range(SAMPLES):
        config = GenerationConfig(max_new_tokens=2, sampling=params, seed=seed, tree_rule=tree_rule)
        samples.append(tuple(generate(target, drafter, prompt, config).new_tokens[:2]))
    stat, pvalue = chi2_pvalue(samples, exact_first_two(target, prompt))
    print(f"chi2={stat:.1f} p={pvalue:.3f} n={SAMPLES}")
    assert pvalue > 1e-3


def test_batched_sampling_on_cuda_matches_target():
    """SpS through the batched loop on CUDA: each counted request's first two tokens follow the target's law
    while neighbours of other lengths and budgets join and leave its continuous batch."""
    target, drafter = on_cuda(tiny_target(4, vocab=V, init=0.3),
                              method_class("sps")(method_class("sps").Options(gamma=3), model=tiny_llama(5, vocab=V,
                                                                                                       init=0.3)))
    prompt, params = [1, 4, 2], SamplingParams(temperature=1.0)
    queue = deque()
    for seed in range(SAMPLES):
        queue.append(BatchRequest(("counted", seed), prompt, GenerationConfig(max_new_tokens=2, sampling=params,
                                                                             seed=seed)))
        if seed % 2:
            neighbour = NEIGHBOURS[seed % len(NEIGHBOURS)]
            queue.append(BatchRequest(("neighbour", seed), neighbour,
                                      GenerationConfig(max_new_tokens=3 + seed % 5, sampling=params, seed=seed)))
    samples = [tuple(record.new_tokens[:2]) for request, record in
               generate_batch(target, drafter, queue, BatchConfig(4, continuous=True)) if request.key[0] == "counted"]
    assert len(samples) == SAMPLES
    stat, pvalue = chi2_pvalue(samples, exact_first_two(target, prompt))
    print(f"batched chi2={stat:.1f} p={pvalue:.3f} n={SAMPLES}")
    assert pvalue > 1e-3


# ---- verify inputs built on the device -------------------------------------------------------------
def test_tree_mask_is_built_on_the_gpu_and_equals_the_host_mask():
    gen = torch.Generator().manual_seed(0)
    for n in (1, 5, 40):
        tree = random_tree(n, 64, gen, max_children=2)
        visible = verify_visibility(tree.parents.to(CUDA))
        assert visible.device.type == "cuda" and torch.equal(visible.cpu(), tree.verify_mask())
    target, drafter = on_cuda(tiny_target(1), RandomTreeDrafter(RandomTreeOptions(nodes=12, seed=2)))
    record = generate(target, drafter, [5, 6, 7], GenerationConfig(max_new_tokens=8))
    assert target._mask_buffer.device.type == "cuda" and record.times["compile"] > 0
    tree = random_tree(9, target.vocab_size, gen, max_children=2)
    compiled = target.compile_tree(5, tree)  # the engine's compile phase: everything verify needs, on the GPU
    assert {compiled.ids.device.type, compiled.positions.device.type, compiled.mask.device.type} == {"cuda"}
    assert torch.equal(compiled.positions[0].cpu(), target.length + tree.position_offsets())


def test_split_verify_on_cuda_equals_a_full_forward():
    from specbench.engine.tree import DraftTree

    target, _ = on_cuda(tiny_target(0, layers=4), VanillaDrafter())
    prompt, drafts = [3, 17, 5, 42, 8, 11], [9, 30, 2]
    target.prefill(prompt[:-1])
    for token in [prompt[-1]] + drafts:
        target.run_layers([token], 2)
    out = target.verify(target.compile_tree(prompt[-1], DraftTree.chain(drafts)), taps=(2, -1))
    with torch.no_grad():
        ref = target.model(torch.tensor([prompt + drafts], device=CUDA), output_hidden_states=True)
    rows = slice(len(prompt) - 1, None)
    torch.testing.assert_close(out.logits, ref.logits[0, rows], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.taps[2], ref.hidden_states[2][0, rows], atol=1e-4, rtol=0)


def test_flash_attention_chains_equal_sdpa():
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        pytest.skip("flash-attn is not installed")
    from specbench.engine.target import FLASH

    target, drafter = on_cuda(tiny_target(0), method_class("sps")(method_class("sps").Options(gamma=3),
                                                                 model=tiny_llama(0)), dtype=torch.bfloat16)
    config = GenerationConfig(max_new_tokens=32)
    sdpa = [generate(target, drafter, p, config).new_tokens for p in PROMPTS]
    target.use_chain_attention(FLASH)
    flash = [generate(target, drafter, p, config).new_tokens for p in PROMPTS]
    same = sum(a == b for x, y in zip(sdpa, flash) for a, b in zip(x, y)) / sum(len(x) for x in sdpa)
    print(f"flash vs sdpa token agreement (bf16): {same:.3f}")
    assert all(x[0] == y[0] for x, y in zip(sdpa, flash))


# ---- timing ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["vanilla", "sps", "eagle3"])
def test_cuda_phase_times_are_positive_sum_within_wall_and_forwards_counted(name):
    target, drafter = on_cuda(*build(name))
    config = GenerationConfig(max_new_tokens=32)
    generate(target, drafter, PROMPTS[0], config)  # warm up kernels
    torch.cuda.synchronize()
    start = time.perf_counter()
    record = generate(target, drafter, PROMPTS[0], config)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    times = record.times
    assert {"prefill", "draft", "compile", "verify", "commit"} <= set(times) and all(v > 0 for v in times.values())
    assert times["prefill"] + times["draft"] + times["compile"] + times["verify"] + times["commit"] <= wall
    assert record.forwards["target"] == record.n_verify > 0
    assert 0 < record.forward_times["target"] <= times["verify"]
    if name != "vanilla":
        assert record.forwards["drafter"] >= record.n_verify and record.forward_times["drafter"] <= times["draft"]
