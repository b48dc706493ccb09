"""bf16 negative controls on the real default target (SmolLM2-135M) and real HumanEval prompts: the forced
check tells each injected bug of ``injected_bugs.py`` from the batched forward's own rounding, and passes the
unbugged methods.

In bf16 no absolute bound holds; the reference is the A/A side (vanilla's own tokens as a chain at the
methods' row counts, no tree logic). The criterion, per turn: a turn is *outside* the A/A distribution
when it committed a token other than vanilla's, or when its largest per-position max |Δlogit| exceeds
``FACTOR`` times the largest one any clean A/A turn showed on these prompts (the worst disagreement a correct
forward gave here). A bug *changed* a turn when its forced pass's per-position figures differ from the same
method's clean pass. Each bug must put at least 90% of the turns it changed outside; every unbugged method's
turns must all be inside.

The exact rule's half (``divergence.exact_verdict``, re-scored by ``engine/rescore.py``): each bug decodes
the first ``EXACT_PROMPTS`` prompts freely (no forcing) through its method, and every turn whose text left
vanilla's has its first flip judged as a bf16 run judges it, with the noise N measured on this machine. What
the rule can promise on every CPU: a flip it excuses lies at a true near-tie, both sides' gaps within N of the
exact gap. So a bug that moves the flipped pair by more than N is unexplained: the three that put a token outside
the other side's 4 best (``LARGE``) must be unexplained in at least 90% of the turns they changed. The draft
positions bug shifts a row's rotary phase by one step, tenths of a logit at most positions, and can flip a true
near-tie by less than N (measured: token 18 of HumanEval/1, 0.20 from the exact gap against N 0.18 on a Xeon
with AMX, unexplained; inside N on an AMD Zen 4, a near-tie). Its magnitude evidence is the forced check's: each
turn the exact rule excuses must be one whose forced pass, under the same bug, lies outside the A/A distribution.
The re-scoring runs correct forwards of its own, after the bug is lifted (``rescore.py`` never calls the patched
verify path anyway)."""

from __future__ import annotations

import pytest

from bench_data import DATA, needs_data
from injected_bugs import BUGS
from specbench import agreement, divergence
from specbench.divergence import IDENTICAL, UNEXPLAINED
from specbench.engine.devices import emulated_bf16
from specbench.engine.forced import forced_check
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.prompts import render_chat
from specbench.engine.registry import create_drafter
from specbench.engine.rescore import Rescorer
from specbench.engine.target import Target
from specbench.data.streams import load_stream_prompts

# Calibrated on native bf16 (a Xeon with AMX); a CPU without it (AVX2 only) emulates bf16: other kernels, other
# rounding, and 5-6x the time (the clean passes alone took 1,012 s on a 2-core AMD EPYC with AVX2, 170 s with AMX).
pytestmark = [pytest.mark.slow, needs_data,
              pytest.mark.skipif(emulated_bf16("cpu"), reason="this CPU has no native bf16 (avx512_bf16/amx_bf16): "
                                 "the real-target bf16 controls run on one that has, or on a GPU")]

PROMPTS, MAX_NEW = 4, 48
CONFIG = GenerationConfig(max_new_tokens=MAX_NEW)
METHODS = ("sps", "pld", "eagle3", "specblock", "ddtree", "medusa")  # with the shipped drafters
# Each bug through a method that reaches it: a chain for what any accepted node exercises, trees for the gather and
# the mask. Measured with two methods each (SpS and EAGLE-3 for the positions and the bonus, EAGLE-3 and SpecBlock
# for the gather and the mask), every changed turn was outside; one each keeps the test short.
BUG_METHODS = [("positions", "sps"), ("stale-kv", "eagle3"), ("sibling-mask", "specblock"), ("bonus-row", "eagle3")]
FACTOR = 2.0  # measured: clean methods' largest max 0.84-1.09 (A/A 0.97-1.09), bugs' smallest 6.3
# The exact rule's control: free decodes of EXACT_NEW tokens of the first EXACT_PROMPTS prompts (a flip's re-scoring
# replays the prefix up to it, about 10 s of CPU a flip here, so the turns stay short). Measured: 10 changed turns
# (positions 1, flip at token 18; stale-kv 3, 8-9; sibling-mask 3, 6-7; bonus-row 3, 4), all unexplained.
EXACT_PROMPTS, EXACT_NEW = 3, 24
LARGE = {"stale-kv", "sibling-mask", "bonus-row"}  # bugs that move a flipped pair by more than any machine's noise


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


@pytest.fixture(scope="module")
def forced_under(target, vanilla, drafters):
    """forced_under(bug, name): the method's forced passes over every prompt with the bug in place, made once."""
    made = {}

    def get(bug: str, name: str) -> list[dict]:
        if (bug, name) not in made:
            with BUGS[bug]():  # only the method's side is judged: no A/A pass
                made[bug, name] = [forced_check(target, drafters[name], base, CONFIG, aa=False) for base in vanilla]
        return made[bug, name]

    return get


@pytest.mark.parametrize("bug,name", BUG_METHODS)
def test_each_bug_falls_outside_the_aa_distribution(clean, forced_under, bug, name):
    reference = aa_reference(clean)
    broken = forced_under(bug, name)
    changed = [b for b, c in zip(broken, clean[name]) if b["deltas"] != c["deltas"] or b["tokens_differ"]]
    caught = [b for b in changed if outside(b, reference)]
    print(f"{bug} through {name}: {len(changed)} of {len(broken)} turns changed, {len(caught)} outside; largest "
          f"max |Δ| {max(b['max'] for b in broken):.3g} against the A/A reference {reference:.3g}")
    assert changed and len(caught) >= 0.9 * len(changed)


@pytest.fixture(scope="module")
def rescorer(target) -> Rescorer:
    return Rescorer(target)  # its float32 copy of the target is made once, at the first flip


def first_flips(target, turns, vanilla) -> list[tuple[int, dict, object, object]]:
    """(prompt index, divergence entry, turn, vanilla turn) of each turn whose text left vanilla's (vanilla cut to
    its length)."""
    layers = divergence.layers_of(target.model)
    entries = [divergence.classify(ours.new_tokens, base.new_tokens[:len(ours.new_tokens)], ours.top_logits,
                                   base.top_logits, target.dtype, layers) for ours, base in zip(turns, vanilla)]
    return [(i, entry, ours, base) for i, (entry, ours, base) in enumerate(zip(entries, turns, vanilla))
            if entry["status"] != IDENTICAL]


@pytest.mark.parametrize("bug,name", BUG_METHODS)
def test_each_bug_is_unexplained_by_the_exact_rule(target, vanilla, drafters, rescorer, clean, forced_under, bug,
                                                   name):
    config = GenerationConfig(EXACT_NEW)
    with BUGS[bug]():
        turns = [generate(target, drafters[name], base.prompt_ids, config) for base in vanilla[:EXACT_PROMPTS]]
    judged = {i: rescorer.judge(entry, base.prompt_ids, ours) if divergence.rescorable(entry) else entry
              for i, entry, ours, base in first_flips(target, turns, vanilla)}
    excused = [i for i, d in judged.items() if d["status"] != UNEXPLAINED]
    print(f"{bug} through {name}: {len(judged)} of {len(turns)} turns changed, {len(judged) - len(excused)} "
          f"unexplained by the exact rule (first flips at {[d.get('position') for d in judged.values()]}, offsets "
          f"from the exact gap {[round(d.get('method_offset', float('nan')), 3) for d in judged.values()]} against "
          f"N {[round(d.get('position_noise', float('nan')), 3) for d in judged.values()]}, the bound's verdicts "
          f"{[d.get('old_status', d['status']) for d in judged.values()]})")
    assert judged
    assert all(d.get("rule") == divergence.EXACT for d in judged.values() if divergence.rescorable(d))
    if bug in LARGE:
        assert len(excused) <= 0.1 * len(judged)
    else:  # a flip excused at a true near-tie: the forced check must carry the evidence on that prompt
        reference = aa_reference(clean)
        forced = forced_under(bug, name)
        assert all(outside(forced[i], reference) for i in excused), [forced[i]["max"] for i in excused]
