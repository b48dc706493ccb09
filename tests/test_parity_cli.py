"""`specbench parity`: the reference adapters reproduce our drafts step by step on tiny random models, the
run writes per-prompt records and the table, and bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import copy
import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import save_tiny  # noqa: F401  (the session's tiny models come from conftest)
from specbench.engine.loop import GenerationConfig, generate
from specbench.run.parity import TABLE_COLUMNS, compare, tau_of
from specbench.engine.verify import SamplingParams
from test_cli import cli
from tiny import tiny_llama, tiny_target

HAS_DFLASH = importlib.util.find_spec("dflash") is not None
needs_dflash = pytest.mark.skipif(not HAS_DFLASH, reason="z-lab's dflash is not installed (pip install -e '.[parity]')")


def ours(target, drafter, ids, n):
    rec = generate(target, drafter, ids, GenerationConfig(n, SamplingParams(0.0), seed=0))
    return rec.new_tokens, rec.accept_lengths


def prompts(count: int, vocab: int = 64, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (6 + i,), generator=gen).tolist() for i in range(count)]


def noisy_copy(model, scale: float, seed: int = 1):
    """The target with noise on every weight: a draft model that agrees often but not always."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return draft


# ---- the adapters, on tiny random models ---------------------------------------------------
def sps_pair(gamma: int, ref_gamma: int):
    from methods.parity.sps import TransformersAssisted
    from methods.sps.drafter import SpSDrafter, SpSOptions

    target = tiny_target(0)
    drafter = SpSDrafter(SpSOptions(gamma=gamma), model=noisy_copy(target.model, 0.1))
    drafter.setup(target)
    reference = TransformersAssisted()
    reference.load(target, drafter, SpSOptions(gamma=ref_gamma))
    return target, drafter, reference


def test_sps_reference_gives_our_tokens_and_per_step_accept_lengths():
    target, drafter, reference = sps_pair(4, 4)
    accepted = 0
    for ids in prompts(3):
        tokens, accept = ours(target, drafter, ids, 40)
        got = reference.generate(ids, 40)
        assert got.tokens == tokens
        assert got.accept_lengths[:-1] == accept[:-1] and len(got.accept_lengths) == len(accept)
        assert got.decode_seconds > 0
        accepted += sum(accept)
    assert accepted > 10  # the draft agrees often enough for the comparison to mean something


def test_sps_reference_with_another_gamma_is_told_apart():
    """Negative control: transformers drafting 2 tokens where we draft 4 must not pass as identical steps."""
    target, drafter, reference = sps_pair(4, 2)
    verdicts = []
    for ids in prompts(3):
        tokens, accept = ours(target, drafter, ids, 40)
        got = reference.generate(ids, 40)
        assert got.tokens == tokens  # lossless either way
        mine = {"tokens": tokens, "accept_lengths": accept, "steps": len(accept)}
        theirs = {"tokens": got.tokens, "accept_lengths": got.accept_lengths, "steps": len(got.accept_lengths)}
        verdicts.append(compare(mine, theirs)["accept_identical"])
    assert not all(verdicts)


def test_pld_reference_gives_our_tokens_and_per_step_accept_lengths():
    from methods.parity.pld import TransformersPromptLookup
    from methods.pld import PLDDrafter, PLDOptions

    target = tiny_target(3)
    drafter = PLDDrafter(PLDOptions(gamma=4, ngram=2))
    drafter.setup(target)
    reference = TransformersPromptLookup()
    reference.load(target, drafter, drafter.options)
    for ids in prompts(2, seed=3):
        ids = ids * 3  # repeats give the lookup something to find
        tokens, accept = ours(target, drafter, ids, 32)
        got = reference.generate(ids, 32)
        assert got.tokens == tokens
        assert got.accept_lengths[:-1] == accept[:-1]


def tiny_dflash(target, reduced: bool):
    from methods.dflash.drafter import DFlashModel

    torch.manual_seed(5)
    vocab = torch.arange(0, target.vocab_size, 2) if reduced else None
    return DFlashModel.from_target(target, layers=2, block_size=4, mask_token_id=1, target_layer_ids=[0, 1],
                                   vocab_ids=vocab).float().eval()


@needs_dflash
@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocabulary", "draft-vocabulary"])
def test_dflash_reference_loop_gives_our_tokens(reduced):
    from methods.dflash.drafter import DFlashDrafter
    from methods.parity.dflash import ZLabDFlash

    target = tiny_target(0, layers=3)
    drafter = DFlashDrafter(model=tiny_dflash(target, reduced))
    drafter.setup(target)
    reference = ZLabDFlash()
    reference.load(target, drafter, drafter.options)
    n, block = 30, drafter.model.block_size
    for ids in prompts(2):
        tokens, accept = ours(target, drafter, ids, n)
        got = reference.generate(ids, n)
        assert got.tokens == tokens
        # z-lab shrinks its block once fewer than block_size tokens remain: compare the steps before that
        full = [i for i in range(len(accept)) if 1 + sum(a + 1 for a in accept[:i]) + block <= n]
        assert [got.accept_lengths[i] for i in full] == [accept[i] for i in full]


class TreeLog:
    """Wraps a drafter's propose to keep every tree (tokens, parents) it hands the engine."""

    def __init__(self, drafter) -> None:
        self.trees: list[tuple[list[int], list[int]]] = []
        propose = drafter.propose

        def logged(state):
            tree = propose(state)
            self.trees.append((tree.tokens.tolist(), tree.parents.tolist()))
            return tree

        drafter.propose = logged


@needs_dflash
@pytest.mark.parametrize("perturb", [False, True], ids=["same-weights", "perturbed-control"])
def test_ddtree_reference_marginals_build_our_trees(perturb):
    """z-lab's draft model, fed through its own context cache, gives the same trees step by step; one
    perturbed weight in their model must change them (negative control)."""
    from methods.ddtree import DDTreeDrafter, DDTreeOptions
    from methods.parity.dflash import ZLabDDTreeDrafterSide

    target = tiny_target(0, layers=3)
    drafter = DDTreeDrafter(DDTreeOptions(budget=6), model=tiny_dflash(target, reduced=True))
    drafter.setup(target)
    reference = ZLabDDTreeDrafterSide()
    reference.load(target, drafter, drafter.options)
    if perturb:
        with torch.no_grad():
            reference.side.ref_model.layers[0].mlp.down_proj.weight.mul_(3.0)
    mine, theirs = TreeLog(drafter), TreeLog(reference.side)
    for ids in prompts(2):
        tokens, _ = ours(target, drafter, ids, 24)
        assert reference.generate(ids, 24).tokens == tokens  # lossless whatever the drafts
    assert (mine.trees == theirs.trees) != perturb


@needs_dflash
def test_dflash_layout_is_rejected_in_one_line_when_their_class_reads_it_otherwise(monkeypatch):
    from methods.dflash.drafter import DFlashDrafter
    from methods.parity import dflash as adapter
    from specbench.errors import SpecbenchError

    target = tiny_target(0, layers=3)
    drafter = DFlashDrafter(model=tiny_dflash(target, reduced=False))
    drafter.setup(target)
    real = adapter.zlab_config

    def other_taps(cfg):  # their config reads target_layer_ids from dflash_config: give it other ones
        config = real(cfg)
        config.dflash_config = {**config.dflash_config, "target_layer_ids": [1, 0]}
        return config

    monkeypatch.setattr(adapter, "zlab_config", other_taps)
    with pytest.raises(SpecbenchError, match="reads different target layers"):
        adapter.ZLabDFlash().load(target, drafter, drafter.options)


def test_tau_counts_the_tokens_verify_steps_produced():
    assert tau_of([5, 6, 7, 8], 2) == 1.5  # the first token is the prefill's
    assert compare({"tokens": [1, 2], "accept_lengths": [0, 3], "steps": 2},
                   {"tokens": [1, 2], "accept_lengths": [0, 1], "steps": 2}) == {
        "text_identical": True, "accept_identical": True, "first_accept_difference": 1, "tokens_left_there": 0}


# ---- the command ---------------------------------------------------------------------------
def test_parity_cli_writes_records_and_the_table(models, tmp_path, capsys):
    out = tmp_path / "parity" / "sps_tiny.jsonl"
    code, stdout, stderr = cli(["parity", "sps", "--target", models["target"], "--opt", f"draft={models['draft']}",
                                "--opt", "gamma=3", "--limit", "2", "--max-new-tokens", "10", "--out", str(out)], capsys)
    assert code == 0, stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    header, records = lines[0], lines[1:]
    assert header["kind"] == "parity" and header["reference"] == "transformers assisted generation"
    assert header["reference_version"] and header["hardware"] and header["dtype"] == "float32"
    assert len(records) == 2 and all(r["text_identical"] and r["accept_identical"] for r in records)
    assert records[0]["first"] == "ours" and records[1]["first"] == "ref"  # interleaved, alternating
    for r in records:
        assert r["ours"]["text"] == r["ref"]["text"] and r["ours"]["decode_s"] > 0 and r["ref"]["decode_s"] > 0
    table = (out.parent / "parity_table.md").read_text()
    assert table.splitlines()[0] == "| " + " | ".join(TABLE_COLUMNS) + " |"
    assert "| sps | transformers assisted generation |" in table and "| 2 | 2/2 |" in table
    rows = list(csv.DictReader(open(out.parent / "parity_table.csv")))
    assert list(rows[0]) == list(TABLE_COLUMNS) and rows[0]["text identical"] == "2/2"
    assert rows[0]["τ ours"] == rows[0]["τ ref"]


def refused(args, capsys, tmp_path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = cli(["parity", *args], capsys)
    assert code == 2
    # transformers' own weight-loading progress bars aside, the refusal is one line
    lines = [line for line in stderr.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    assert not any(tmp_path.rglob("*")), "a refused parity run wrote something"
    return lines[0]


def test_a_method_without_a_reference_is_refused(capsys, tmp_path, monkeypatch):
    line = refused(["vanilla"], capsys, tmp_path, monkeypatch)
    assert "no reference implementation" in line and "sps" in line


def test_an_unknown_method_is_refused(capsys, tmp_path, monkeypatch):
    assert "unknown method" in refused(["spss"], capsys, tmp_path, monkeypatch)


def test_a_missing_reference_package_is_refused(capsys, tmp_path, monkeypatch):
    import importlib.metadata as metadata

    real = metadata.version

    def without_dflash(name):
        if name == "dflash":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", without_dflash)  # as if `pip install dflash` had not run
    line = refused(["dflash"], capsys, tmp_path, monkeypatch)
    assert "'dflash' is not installed" in line and "pip install" in line


@needs_dflash
def test_a_drafter_layout_the_reference_rejects_is_refused(models, capsys, tmp_path, monkeypatch):
    from methods.dflash.drafter import DFlashModel
    from methods.parity import dflash as adapter
    from specbench.engine.target import Target

    target = Target.load(models["target"], "float32", "cpu")
    folder = tmp_path.parent / f"{tmp_path.name}-drafter"
    DFlashModel.from_target(target, layers=1, block_size=4, mask_token_id=1, target_layer_ids=[0]).save(
        folder, target, {}, torch.float32)
    real = adapter.zlab_config

    def other_block(cfg):  # a real tiny drafter cannot make their class disagree; this makes it read L = 8
        config = real(cfg)
        config.dflash_config = {**config.dflash_config, "block_size": 8}
        return config

    monkeypatch.setattr(adapter, "zlab_config", other_block)
    line = refused(["dflash", "--target", models["target"], "--opt", f"path={folder}", "--limit", "1",
                    "--max-new-tokens", "8"], capsys, tmp_path, monkeypatch)
    assert "z-lab's DFlashDraftModel reads different" in line


@pytest.mark.parametrize("row, why", [("pacer", "no public code"), ("dvi", "not lossless")])
def test_a_method_whose_authors_code_gives_no_row_is_refused_with_the_reason(row, why, capsys, tmp_path, monkeypatch):
    line = refused([row], capsys, tmp_path, monkeypatch)
    assert f"{row} has no parity row" in line and why in line


def test_the_table_lists_the_methods_without_a_row(models, tmp_path, capsys):
    out = tmp_path / "parity" / "sps_tiny.jsonl"
    code, _, stderr = cli(["parity", "sps", "--target", models["target"], "--opt", f"draft={models['draft']}",
                           "--limit", "1", "--max-new-tokens", "6", "--out", str(out)], capsys)
    assert code == 0, stderr
    without = (out.parent / "parity_table.md").read_text().split("Without a row:")[1]
    assert "- dvi (" in without and "- pacer (" in without and "| dvi |" not in without


def test_parity_needs_one_method_or_all(capsys, tmp_path, monkeypatch):
    assert "one METHOD or --all" in refused([], capsys, tmp_path, monkeypatch)


def test_all_takes_no_per_method_options(capsys, tmp_path, monkeypatch):
    refusal = refused(["--all", "--opt", "gamma=3"], capsys, tmp_path, monkeypatch)
    assert "--all and --opt cannot be used together" in refusal  # a conflict ParityConfig declares


# ---- medusa: the reference's dense tree is the parity run's default -------------------------
def test_medusa_reference_offers_a_dense_tree_it_can_run():
    from methods.medusa.drafter import MedusaDrafter, resolve_choices
    from methods.parity.medusa import DENSE_TOPK, MedusaLLM, dense_topk
    from specbench.options import parse

    choices = MedusaLLM.options["choices"]
    assert dense_topk(resolve_choices(choices)) == list(DENSE_TOPK)
    assert dense_topk(resolve_choices(parse(MedusaDrafter.Options, {}, "medusa").choices)) is None  # ours: sparse


@pytest.mark.skipif(importlib.util.find_spec("medusa") is None,
                    reason="FasterDecoding's medusa-llm is not installed (pip install -e '.[parity]')")
def test_parity_medusa_runs_the_references_dense_tree_on_both_sides(models, tmp_path, capsys):
    from methods.medusa.drafter import MedusaHeads, save_medusa
    from methods.parity.medusa import MedusaLLM
    from specbench.engine.target import Target

    target = Target.load(models["target"], "float32", "cpu")
    heads = MedusaHeads.for_target(target, num_heads=3)
    folder = save_medusa(tmp_path / "heads", heads, target)
    out = tmp_path / "parity" / "medusa_tiny.jsonl"
    code, stdout, stderr = cli(["parity", "medusa", "--target", models["target"], "--opt", f"path={folder}",
                                "--limit", "2", "--max-new-tokens", "10", "--out", str(out)], capsys)
    assert code == 0, stderr  # without the adapter's default tree medusa-llm refuses our sparse default
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    header, records = lines[0], lines[1:]
    assert header["method_options"]["choices"] == MedusaLLM.options["choices"]
    assert len(records) == 2 and all(r["text_identical"] and r["accept_identical"] for r in records)
