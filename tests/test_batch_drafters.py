"""Every method that may share a batch, lossless per request (tiny random models, fp32, T = 0): four
requests of mixed prompt lengths decode together, one stops at EOS inside an accepted chain, one accepts
nothing, and each request's text equals its batch-1 vanilla text. For the methods that draft the whole
batch in one drafter forward per step (``Drafter.batched_drafting``), every request's draft tree at every
step equals the tree the per-request drafting (one fork per request, the drafter hooks' default) gives it
in the same batch: that is what shows the ragged drafter cache right. Methods refused a batch say why in
one line."""

from __future__ import annotations

import copy
import dataclasses
from collections import deque

import pytest
import torch

from specbench.engine.batch_loop import BatchConfig, BatchRequest, generate_batch
from specbench.engine.drafter import Drafter
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.tree import DraftTree
from specbench.engine.verify import SamplingParams
from specbench.engine.vanilla import VanillaDrafter
from specbench.errors import SpecbenchError
from test_cli import base_args, cli, read
from test_deep_sampling import CASES

# Mixed lengths (the longest is more than twice the others, so rows carry wide dead gaps).
PROMPTS = [(1, 3, 0, 2), (2,), (0, 1, 2, 3, 3, 2, 1, 0, 1, 2, 0), (3, 3, 3, 3, 3, 3)]
TOKENS = 20
# Learners whose updates follow the stream request by request, and DVI (it drafts through the target's own
# one-request cache): refused a batch.
REFUSED = {"dvi", "dvi-kl", "dvi-pg", "dvi-ce", "specblock-adapt", "specblock-osd"}
# One drafter forward per step / chain position / depth for the whole batch.
BATCHED = {"sps", "eagle3", "medusa", "dflash", "ddtree", "pacer", "pacer-no-pos", "pacer-no-growth", "specblock",
           "specblock-no-valid-prefix", "specblock-uniform-tree"}
# The SpecBlock ablations that train their own drafter (minutes here) draft with SpecBlock's code, run above.
METHODS = sorted(set(CASES) - REFUSED - {"specblock-no-broadcast", "specblock-no-shift"})
COPYING = {"vanilla", "pld", "lookahead", "suffix"}  # drafts copied from text: no new token inside a chain


def sliding_ddtree():
    """DDTree over a DFlash drafter whose layer is causal with a 3-position window (z-lab's sliding layers):
    the window is counted in positions, which differ per request in a batch."""
    target, drafter = CASES["ddtree"][0]()
    drafter.model.config.layer_types, drafter.model.config.sliding_window = ["sliding_attention"], 3
    return target, drafter


def duplicate_specblock():
    """SpecBlock with the authors' inference convention: block 1 is a transient copy of the last pair."""
    target, drafter = CASES["specblock"][0]()
    drafter.options.bonus_row = "duplicate"
    return target, drafter


BUILDS = {name: build for name, (build, _) in CASES.items()} | {"ddtree-sliding": sliding_ddtree,
                                                              "specblock-duplicate": duplicate_specblock}


def build(name: str):
    target, drafter = BUILDS[name]()
    drafter.setup(target)
    return target, drafter


def forked(drafter: Drafter) -> Drafter:
    """The same drafter (weights, setup) drafting each request of a batch on its own fork."""
    hooks = {hook: getattr(Drafter, hook) for hook in ("begin_batch", "propose_batch", "observe_batch", "end_batch")}
    twin = copy.copy(drafter)
    twin.__class__ = type(f"Forked{type(drafter).__name__}", (type(drafter),), {**hooks, "batched_drafting": False})
    return twin


def configs(eos_row: int) -> list[GenerationConfig]:
    """Only ``eos_row`` stops at EOS (a 4-token vocabulary: every text meets the EOS token soon)."""
    return [GenerationConfig(max_new_tokens=TOKENS, stop_on_eos=b == eos_row) for b in range(len(PROMPTS))]


def choose_eos(target, drafter) -> tuple[int, int, bool]:
    """(request, token, inside): a token that first appears in a request's text inside an accepted chain
    (not as the step's bonus), from each request decoded alone, inside = True; failing that (drafts copied
    from the text itself never bring a new token), a token that first appears after a few tokens of the
    first request's text, inside = False."""
    texts = []
    for b, prompt in enumerate(PROMPTS):
        record = generate(target, drafter, list(prompt), GenerationConfig(max_new_tokens=TOKENS, stop_on_eos=False))
        texts.append(record.new_tokens)
        seen, start = {record.new_tokens[0]}, 1  # the prefill's token
        for accepted in record.accept_lengths:
            step = record.new_tokens[start: start + accepted + 1]
            fresh = [t for t in step[:-1] if t not in seen]
            if fresh and start + accepted < TOKENS:
                return b, fresh[0], True
            seen.update(step)
            start += accepted + 1
    first = texts[0]
    return 0, next(t for i, t in enumerate(first[2:], 2) if t not in first[:i]), False


def rejecting(drafter: Drafter, target, prompt: tuple[int, ...]) -> Drafter:
    """``drafter`` whose tree for ``prompt`` gets, each step, the target's least likely next token on every
    child of the root (its shape kept: a drafter may read its own rows back), so that request accepts
    nothing while its neighbours draft as usual."""
    real = drafter.propose_batch

    def propose_batch(states):
        trees = real(states)
        for b, state in enumerate(states):
            if tuple(state.tokens[: state.prompt_len]) == prompt and len(trees[b]):
                with torch.no_grad():
                    wrong = int(target.model(torch.tensor([state.tokens])).logits[0, -1].argmin())
                tree = trees[b]
                trees[b] = DraftTree([wrong if p == -1 else t for t, p in zip(tree.token_list, tree.parent_list)],
                                     tree.parent_list)
        return trees

    drafter.propose_batch = propose_batch
    return drafter


def recording(drafter: Drafter, trees: dict) -> Drafter:
    """Keep every request's draft tree per step, by prompt: (tokens, parents)."""
    real = drafter.propose_batch

    def propose_batch(states):
        out = real(states)
        for state, tree in zip(states, out):
            trees.setdefault(tuple(state.tokens[: state.prompt_len]), []).append((tree.token_list, tree.parent_list))
        return out

    drafter.propose_batch = propose_batch
    return drafter


def run_batch(target, drafter, cfgs, batch: BatchConfig) -> list:
    queue = deque(BatchRequest(b, list(p), c) for b, (p, c) in enumerate(zip(PROMPTS, cfgs)))
    records = {request.key: record for request, record in generate_batch(target, drafter, queue, batch)}
    return [records[b] for b in range(len(PROMPTS))]


@pytest.mark.parametrize("name", METHODS)
def test_each_request_decodes_its_batch1_vanilla_text_whatever_its_neighbours(name, monkeypatch):
    target, drafter = build(name)
    eos_row, eos, inside = choose_eos(target, drafter)
    assert inside or name in COPYING, f"{name}: no request met a new token inside an accepted chain"
    monkeypatch.setattr(target, "eos_token_ids", {eos})  # targets are cached and shared: undone after the test
    cfgs = configs(eos_row)
    vanilla = VanillaDrafter()
    vanilla.setup(target)
    expected = [generate(target, vanilla, list(p), c).new_tokens for p, c in zip(PROMPTS, cfgs)]
    quiet = (eos_row + 1) % len(PROMPTS)  # the request that accepts nothing
    for batch in (BatchConfig(4), BatchConfig(3, continuous=True)):
        target, drafter = build(name)  # fresh: a learner's memory starts as it did alone
        monkeypatch.setattr(target, "eos_token_ids", {eos})
        records = run_batch(target, rejecting(drafter, target, PROMPTS[quiet]), cfgs, batch)
        assert [r.new_tokens for r in records] == expected, batch
        assert max(records[quiet].accept_lengths) == 0
        assert all(r.batch["batched_drafting"] == (name in BATCHED) for r in records)
        stopped = records[eos_row]
        assert stopped.stop_reason == "eos" and stopped.new_tokens[-1] == eos
        assert any(len(r.new_tokens) > len(stopped.new_tokens) for r in records)  # the others decoded on
        if inside and name != "suffix":  # suffix drafts from its neighbours' text too: its chains are not batch 1's
            # the EOS came inside an accepted chain: the verifier accepted past it (depth counts; + 1 each: the
            # verify's bonus), while τ counts only the tokens kept (+ 1: the prefill's token)
            assert sum(stopped.depth_accepts) + stopped.n_verify > stopped.committed == len(stopped.new_tokens) - 1


@pytest.mark.parametrize("name", sorted(BATCHED | {"ddtree-sliding", "specblock-duplicate"}))
def test_batched_drafts_equal_per_request_drafts(name, monkeypatch):
    """Same batch, same neighbours (one stops at EOS, one accepts nothing): the batched drafter's trees are
    those of one fork per request, token for token and parent for parent, at every step."""
    trees: dict[str, dict] = {"batched": {}, "forked": {}}
    for mode in trees:
        target, drafter = build(name)
        assert drafter.batched_drafting
        text = generate(target, VanillaDrafter(), list(PROMPTS[2]), configs(-1)[2]).new_tokens
        monkeypatch.setattr(target, "eos_token_ids", {next(t for i, t in enumerate(text[3:], 3) if t not in text[:i])})  # ends mid-text
        drafter = drafter if mode == "batched" else forked(drafter)
        recording(rejecting(drafter, target, PROMPTS[1]), trees[mode])
        records = run_batch(target, drafter, configs(2), BatchConfig(4))
        assert records[2].stop_reason == "eos" and max(records[1].accept_lengths) == 0
        assert all(r.batch["batched_drafting"] == (mode == "batched") for r in records)
    assert trees["batched"] == trees["forked"]
    assert sum(len(steps) for steps in trees["batched"].values()) > len(PROMPTS)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_methods_refused_a_batch_say_why_before_anything_runs(name):
    target, drafter = build(name)
    queue = deque([BatchRequest(0, [1, 2])])
    with pytest.raises(SpecbenchError, match="--batch-size 1"):
        next(generate_batch(target, drafter, queue, BatchConfig(2)))
    assert len(queue) == 1


def test_a_frozen_dvi_head_is_refused_too():
    """A frozen head does not learn, but it drafts through the target's one-request cache."""
    target, drafter = CASES["dvi"][0]()
    drafter.options.learn = False
    drafter.learns = False
    drafter.setup(target)
    assert "one-request cache" in drafter.batch_refusal()


@pytest.mark.parametrize("name", ["sps", "pacer"])
def test_sampled_chains_drafted_together_draw_what_each_request_draws_alone(name):
    """T = 1: a request's generator serves its own draft draws and its own verify draws in the same order
    in a batch as alone, so with the same seed each request commits the same tokens (and drafts the same
    chains) whatever its neighbours do, rows that stopped drafting early included."""
    target, drafter = build(name)
    sampled = GenerationConfig(max_new_tokens=TOKENS, sampling=SamplingParams(temperature=1.0), stop_on_eos=False)
    cfgs = [dataclasses.replace(sampled, seed=seed) for seed in range(len(PROMPTS))]
    alone = [generate(target, drafter, list(p), c) for p, c in zip(PROMPTS, cfgs)]
    records = run_batch(target, drafter, cfgs, BatchConfig(4))
    assert [r.new_tokens for r in records] == [r.new_tokens for r in alone]
    assert [r.tree_sizes for r in records] == [r.tree_sizes for r in alone]
    assert len({n for r in records for n in r.tree_sizes}) > 1 or name == "sps"  # PACER: chains of several lengths


def test_a_batched_run_says_per_side_how_it_drafted(models, tmp_path, capsys):
    """The header names, per side, whether it drafts the batch in one forward; each record says it too."""
    out = tmp_path / "b.jsonl"
    args = base_args(models, out, "--batch-size", "2", "--also", "pld",
                     "--also", f"sps@draft={models['draft']}@gamma=3@schedule=heuristic_transient@label=sps-transient")
    code, _, stderr = cli(args, capsys)
    assert code == 0, stderr
    header, *records = read(out)
    drafting = header["meta"]["batched_drafting"]
    assert drafting == {"sps": True, "pld": False, "sps-transient": False, "vanilla": False}
    assert records and all(r["batch"]["batched_drafting"] == drafting[r["method"]] for r in records)


def test_a_frozen_dvi_head_is_refused_a_batch_before_the_target_loads(tmp_path, capsys):
    out = tmp_path / "dvi.jsonl"
    args = ["run", "--method", "dvi", "--opt", "learn=false", "--bench", "humaneval", "--batch-size", "2",
            "--out", str(out)]
    code, _, stderr = cli(args, capsys)  # the default target: refused before it loads
    assert code == 2 and "dvi drafts with the target's first layers" in stderr and "--batch-size 1" in stderr
    assert "Traceback" not in stderr and not out.exists()
