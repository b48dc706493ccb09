"""The teacher-forced check on tiny random targets in fp32: the forced walk commits the given tokens, every
tree/chain method's committed verify rows equal vanilla's one-row steps within the engine's bound at every
position (and the A/A oracle chain's do), a learning drafter checks on a copy, each injected bug of
``injected_bugs.py`` fails the check through a method that reaches it, and `specbench run --check forced`
writes the figures that the report's divergence table shows."""

from __future__ import annotations

import json

import pytest
import torch

from drafters import RandomTreeDrafter, RandomTreeOptions
from injected_bugs import BUGS
from methods.ddtree import DDTreeDrafter, DDTreeOptions
from methods.dflash.drafter import DFlashModel
from methods.dvi import DVIDrafter, DVIOptions
from methods.eagle3.drafter import Eagle3Drafter, Eagle3Model, Eagle3Options
from methods.lookahead import LookaheadDrafter, LookaheadOptions
from methods.medusa.drafter import MedusaDrafter, MedusaHeads
from methods.pld import PLDDrafter, PLDOptions
from methods.specblock.drafter import SpecBlockDrafter, SpecBlockOptions
from methods.specblock.model import SpecBlockConfig, SpecBlockModel
from methods.sps.drafter import SpSDrafter, SpSOptions
from methods.suffix import SuffixDrafter, SuffixOptions, arctic_available
from methods.taps import eagle3_taps
from specbench import agreement
from specbench.engine.drafter import DecodeState
from specbench.engine.forced import OracleChain, forced_check
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.target import Target
from specbench.engine.tree import DraftTree
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine.verify import SamplingParams, forced_walk
from tiny import tiny_llama

VOCAB, LAYERS = 512, 8  # eight layers: EAGLE-3's and SpecBlock's three taps are distinct
CONFIG = GenerationConfig(max_new_tokens=32)
PROMPTS = [torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(p)).tolist() for p in range(4)]


def tiny(seed: int = 0):
    return tiny_llama(seed, vocab=VOCAB, layers=LAYERS, init=0.05)


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(tiny(), None, "tiny")


@pytest.fixture(scope="module")
def vanilla(target) -> list:
    """Vanilla's turns with their logit rows kept, made before any bug is injected (the reference)."""
    drafter = VanillaDrafter()
    drafter.setup(target)
    keep = GenerationConfig(CONFIG.max_new_tokens, keep_logits=True)
    return [generate(target, drafter, prompt, keep) for prompt in PROMPTS]


def _specblock(target):
    model = SpecBlockModel(SpecBlockConfig.from_target(target, VOCAB), eagle3_taps(LAYERS),
                           target.model.get_input_embeddings())
    return SpecBlockDrafter(SpecBlockOptions(budget=20, beam_width=4), model=model.eval())


# Every method that drafts chains or trees, built on the tiny target (random drafters accept little; SpS on
# a copy of the target and the random tree with the target's greedy path planted accept deeply).
METHODS = {
    "sps-self": lambda t: SpSDrafter(SpSOptions(gamma=4), model=tiny()),
    "pld": lambda t: PLDDrafter(PLDOptions(gamma=4, ngram=2)),
    "lookahead": lambda t: LookaheadDrafter(LookaheadOptions(window=4, ngram=4, guess=2)),
    "suffix": lambda t: SuffixDrafter(SuffixOptions()),
    "eagle3": lambda t: Eagle3Drafter(Eagle3Options(top_k=4, depth=3, total_tokens=20),
                                      model=Eagle3Model.from_target(t).eval()),
    "medusa": lambda t: MedusaDrafter(heads=MedusaHeads.for_target(t, 4)),
    "specblock": _specblock,
    "ddtree": lambda t: DDTreeDrafter(DDTreeOptions(budget=16), model=DFlashModel.from_target(
        t, layers=1, block_size=4, mask_token_id=VOCAB - 1, target_layer_ids=[1, 5]).eval()),
    "dvi": lambda t: DVIDrafter(DVIOptions(layer=2, k=3)),
    "random-tree": lambda t: RandomTreeDrafter(RandomTreeOptions(nodes=8, seed=1), oracle=t.model),
}


def ready(name: str, target: Target):
    torch.manual_seed(0)
    drafter = METHODS[name](target)
    drafter.setup(target)
    return drafter


def checks(target, drafter, vanilla, aa: bool = True) -> list[dict]:
    return [forced_check(target, drafter, base, CONFIG, aa) for base in vanilla]


@pytest.fixture(scope="module")
def clean(target, vanilla):
    """Each method's checks without a bug, made once per method (``ready`` builds the same drafter each time)."""
    done: dict[str, list[dict]] = {}

    def of(name: str) -> list[dict]:
        if name not in done:
            done[name] = checks(target, ready(name, target), vanilla)
        return done[name]

    return of


# ---- the walk -------------------------------------------------------------------------------------------
def test_forced_walk_follows_the_forced_tokens_then_the_argmax():
    # root -> 5 (node 0) -> 9 (node 2); root -> 7 (node 1) -> 9 (node 3) -> 4 (node 4)
    tree = DraftTree(torch.tensor([5, 7, 9, 9, 4]), torch.tensor([-1, -1, 0, 1, 3]))
    logits = torch.zeros(6, 16)
    logits[:, 5] = 1.0  # every row's own choice is 5
    walked = forced_walk(tree, logits, [7, 9, 2])
    assert walked.accepted == [1, 3] and walked.bonus == 2  # node 4 (token 4) is not the forced 2
    assert walked.stop_row == 4
    past = forced_walk(tree, logits, [7])  # deeper than the forced tokens: each row's argmax (5)
    assert past.accepted == [1] and past.bonus == 5


def test_oracle_chain_takes_the_methods_sizes_and_leaves_a_bonus():
    oracle = OracleChain([10, 11, 12, 13], sizes=[3, 3])
    state = DecodeState(tokens=[1, 2, 10], prompt_len=2, params=SamplingParams())  # vanilla's first token committed
    assert oracle.propose(state).token_list == [11, 12]  # three asked, two left before the last (the bonus)
    assert oracle.propose(state).token_list == [11, 12]
    assert oracle.propose(state).token_list == []  # sizes used up: one-row steps


# ---- fp32: every method within the bound --------------------------------------------------------------------
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.skipif(
    name == "suffix" and not arctic_available(), reason="arctic-inference is not installed (extra 'suffix')"))
    for name in sorted(METHODS)])
def test_every_method_commits_vanillas_rows_within_the_fp32_bound(vanilla, clean, name):
    for base, out in zip(vanilla, clean(name)):
        assert out["tokens_differ"] == 0 and out["positions"] == len(base.new_tokens) - 1
        assert out["within_bound"] and out["aa"]["within_bound"] and out["bound"] == agreement.FP32_BOUND
        assert out["max"] <= agreement.FP32_BOUND and out["top1"] == 1.0 and out["margin_order"] == 1.0
        assert len(out["deltas"]) == out["positions"] and out["aa"]["positions"] == out["positions"]
        assert sum(out["rows"].values()) >= 1 and out["aa"]["tokens_differ"] == 0


def test_the_oracle_chain_runs_the_methods_row_counts(target, vanilla):
    drafter = ready("random-tree", target)
    out = forced_check(target, drafter, vanilla[0], CONFIG)
    assert out["rows"] == {"9": sum(out["rows"].values())}  # the random tree has 8 nodes every step
    # all accepted, the oracle needs fewer steps; each has the tree's 9 rows but where vanilla's text runs out
    assert set(out["aa"]["rows"]) <= {str(r) for r in range(1, 10)} and out["aa"]["rows"].get("9", 0) >= 1
    assert sum(out["aa"]["rows"].values()) < sum(out["rows"].values())


def test_a_learning_drafter_checks_on_a_copy(target, vanilla):
    drafter = ready("dvi", target)
    generate(target, drafter, PROMPTS[0], CONFIG)  # a timed turn: it learns from it
    steps, head = drafter.steps, {k: v.detach().clone() for k, v in drafter.head.trainable().items()}
    assert steps > 0
    for out in checks(target, drafter, vanilla):
        assert out["within_bound"]
    assert drafter.steps == steps
    assert all(torch.equal(head[k], v) for k, v in drafter.head.trainable().items())


def test_no_rows_kept_no_check(target):
    drafter, base = ready("pld", target), VanillaDrafter()
    base.setup(target)
    plain = generate(target, base, PROMPTS[0], CONFIG)
    assert getattr(plain, "logit_rows", None) is None and forced_check(target, drafter, plain, CONFIG) is None


# ---- fp32: each injected bug fails it -----------------------------------------------------------------------
@pytest.mark.parametrize("bug,name", [("positions", "sps-self"), ("positions", "random-tree"),
                                      ("stale-kv", "random-tree"), ("sibling-mask", "random-tree"),
                                      ("bonus-row", "sps-self"), ("bonus-row", "random-tree")])
def test_each_injected_bug_fails_the_check(target, vanilla, clean, bug, name):
    with BUGS[bug]():
        broken = checks(target, ready(name, target), vanilla, aa=False)  # the method's side is what is judged
    changed = [b for c, b in zip(clean(name), broken) if b["deltas"] != c["deltas"] or b["tokens_differ"]]
    failed = [b for b in changed if not b["within_bound"]]
    print(f"{bug} through {name}: {len(changed)} of {len(broken)} turns changed, {len(failed)} failed; "
          f"max |Δ| {max(b['max'] for b in broken):.3g}")
    assert all(c["within_bound"] for c in clean(name))
    assert changed and len(failed) == len(changed) and "aa" not in broken[0]


# ---- the run and the report ---------------------------------------------------------------------------------
def test_run_writes_forced_figures_and_the_report_shows_them(models, tmp_path, capsys):
    from test_cli import base_args, cli

    from specbench.analysis.report.checks import divergence_table
    from specbench.analysis.report.records import load_result_files
    from specbench.analysis.report.render import render_markdown

    out = tmp_path / "r.jsonl"
    code, _, err = cli(base_args(models, out, "--check", "forced"), capsys)
    assert code == 0, err
    records = [o for o in map(json.loads, out.read_text().splitlines()) if o["type"] == "record"]
    sps = [r for r in records if r["method"] == "sps"]
    assert len(sps) == 2 and all(r["forced"] is None for r in records if r["method"] == "vanilla")
    for r in sps:
        assert r["forced"]["within_bound"] and r["forced"]["positions"] == len(r["new_tokens"]) - 1
        assert r["forced"]["aa"]["within_bound"]
    table = divergence_table(load_result_files(str(out)))
    assert table.columns[-4:] == ["Forced |Δ| p50/p90/p99/max", "Top-1", "A/A |Δ| p50/p90/p99/max", "A/A top-1"]
    assert "| 100.0% |" in render_markdown(table) and table.data["forced_positions"].iloc[0] > 0


@pytest.mark.parametrize("extra,message", [(["--temperature", "1"], "needs --temperature 0"),
                                           (["--baseline", "none"], "needs --temperature 0, --baseline vanilla"),
                                           (["--check", "exact"], "--check must be one of 'forced' (got 'exact')")])
def test_forced_check_refuses_a_run_it_cannot_check(models, tmp_path, capsys, extra, message):
    from test_cli import base_args, cli

    flags = extra if extra[0] == "--check" else ["--check", "forced", *extra]
    code, _, err = cli(base_args(models, tmp_path / "r.jsonl", *flags), capsys)
    assert code == 2 and message in err and "Traceback" not in err and not (tmp_path / "r.jsonl").exists()


def test_a_damaged_forced_field_is_one_line(tmp_path):
    from specbench.schemas import FileSchemaError, parse_record

    line = {"method": "sps", "bench": "humaneval", "prompt_id": "p", "turn": 0, "new_tokens": [1], "prompt_tokens": 1, "stop_reason": "eos", "times": {}, "n_verify": 0,
            "accept_lengths": [], "tree_sizes": [], "depth_attempts": [], "depth_accepts": [],
            "forced": {"positions": "many"}}
    with pytest.raises(FileSchemaError, match=r"r.jsonl line 2: field forced.positions"):
        parse_record(line, tmp_path / "r.jsonl", 2)
