"""bf16 negative controls on the real default target (SmolLM2-135M) and real HumanEval prompts: the forced
check tells each injected bug of ``injected_bugs.py`` from the batched forward's own rounding, and passes the
unbugged methods.

In bf16 no absolute bound holds; the reference is the A/A side (vanilla's own tokens as a chain at the
methods' row counts, no tree logic). The criterion, per turn: a turn is *outside* the A/A distribution
when it committed a token other than vanilla's, or when its largest per-position max |Δlogit| exceeds
``FACTOR`` times the largest one any clean A/A turn showed on these prompts (the worst disagreement a correct
forward gave here). A bug *changed* a turn when its forced pass's per-position figures differ from the same
method's clean pass. Each bug must put at least 90% of the turns it changed outside; every unbugged method's
turns must all be inside."""

from __future__ import annotations

import pytest

from bench_data import DATA, needs_data
from injected_bugs import BUGS
from specbench import agreement
from specbench.engine.forced import forced_check
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.prompts import render_chat
from specbench.engine.registry import create_drafter
from specbench.engine.target import Target
from specbench.data.streams import load_stream_prompts

pytestmark = [pytest.mark.slow, needs_data]

PROMPTS, MAX_NEW = 4, 48
CONFIG = GenerationConfig(max_new_tokens=MAX_NEW)
METHODS = ("sps", "pld", "eagle3", "specblock", "ddtree", "medusa")  # with the shipped drafters
# Each bug through a method that reaches it: a chain for what any accepted node exercises, trees for the gather and
# the mask. Measured with two methods each (SpS and EAGLE-3 for the positions and the bonus, EAGLE-3 and SpecBlock
# for the gather and the mask), every changed turn was outside; one each keeps the test short.
BUG_METHODS = [("positions", "sps"), ("stale-kv", "eagle3"), ("sibling-mask", "specblock"), ("bonus-row", "eagle3")]
FACTOR = 2.0  # measured: clean methods' largest max 0.84-1.09 (A/A 0.97-1.09), bugs' smallest 6.3


@pytest.fixture(scope="module")
def target() -> Target:
    return Target.load("smollm2-135m", dtype="bfloat16")


@pytest.fixture(scope="module")
def vanilla(target) -> list:
    prompts = load_stream_prompts("humaneval", str(DATA), limit=PROMPTS)
    drafter = create_drafter("vanilla", {})
    drafter.setup(target)
    keep = GenerationConfig(MAX_NEW, keep_logits=True)
    return [generate(target, drafter, render_chat(target.tokenizer, [{"role": "user", "content": p.turns[0]}], None,
                                                  target.chat), keep) for p in prompts]


@pytest.fixture(scope="module")
def drafters(target) -> dict:
    out = {}
    for name in METHODS:
        out[name] = create_drafter(name, {})
        out[name].setup(target)
    return out


@pytest.fixture(scope="module")
def clean(target, vanilla, drafters) -> dict[str, list[dict]]:
    return {name: [forced_check(target, drafter, base, CONFIG) for base in vanilla] for name, drafter in drafters.items()}


def aa_reference(clean: dict[str, list[dict]]) -> float:
    return max(turn["aa"]["max"] for turns in clean.values() for turn in turns)


def outside(turn: dict, reference: float) -> bool:
    return turn["tokens_differ"] > 0 or turn["max"] > FACTOR * reference


def test_unbugged_methods_fall_inside_the_aa_distribution(clean):
    reference = aa_reference(clean)
    for name, turns in clean.items():
        ours, aa = agreement.pooled(turns), agreement.pooled(t["aa"] for t in turns)
        print(f"{name}: max {ours['max']:.3g} p50/p90/p99 {ours['p50']:.3g}/{ours['p90']:.3g}/{ours['p99']:.3g} "
              f"top-1 {ours['top1']:.3f}; A/A max {aa['max']:.3g} p50/p90/p99 {aa['p50']:.3g}/{aa['p90']:.3g}/"
              f"{aa['p99']:.3g} top-1 {aa['top1']:.3f}; reference {reference:.3g}")
        assert not [t for t in turns if outside(t, reference)], name


@pytest.mark.parametrize("bug,name", BUG_METHODS)
def test_each_bug_falls_outside_the_aa_distribution(target, vanilla, drafters, clean, bug, name):
    reference = aa_reference(clean)
    with BUGS[bug]():
        broken = [forced_check(target, drafters[name], base, CONFIG) for base in vanilla]
    changed = [b for b, c in zip(broken, clean[name]) if b["deltas"] != c["deltas"] or b["tokens_differ"]]
    caught = [b for b in changed if outside(b, reference)]
    print(f"{bug} through {name}: {len(changed)} of {len(broken)} turns changed, {len(caught)} outside; largest "
          f"max |Δ| {max(b['max'] for b in broken):.3g} against the A/A reference {reference:.3g}")
    assert changed and len(caught) >= 0.9 * len(changed)
