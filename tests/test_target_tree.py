"""Tree verification and KV compaction agree with plain sequential forwards (fp32)."""

import torch

from drafters import random_tree
from specbench.engine.tree import DraftTree
from tiny import tiny_target

PROMPT = [3, 17, 5, 42, 8, 11]


def verify(target, root: int, tree: DraftTree, taps=()):
    """The engine's compile + verify."""
    return target.verify(target.compile_tree(root, tree), taps=taps)


def causal_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_chain_verify_equals_causal_forward():
    target = tiny_target(0)
    target.prefill(PROMPT[:-1])
    chain = DraftTree.chain([9, 30, 2, 7])
    out = verify(target, PROMPT[-1], chain)
    ref = causal_logits(target.model, PROMPT + [9, 30, 2, 7])[len(PROMPT) - 1:]
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)


def test_random_tree_rows_equal_causal_forward_over_their_paths():
    target = tiny_target(1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        tree = random_tree(12, target.vocab_size, gen)
        target.prefill(PROMPT[:-1])
        out = verify(target, PROMPT[-1], tree, taps=(1, -1))
        ref_root = causal_logits(target.model, PROMPT)[-1]
        torch.testing.assert_close(out.logits[0], ref_root, atol=1e-4, rtol=0)
        for node in range(len(tree)):
            path = [tree.token_list[i] for i in tree.path_to(node)]
            ref = causal_logits(target.model, PROMPT + path)[-1]
            torch.testing.assert_close(out.logits[node + 1], ref, atol=1e-4, rtol=0)
        assert set(out.taps) == {1, -1} and out.taps[1].shape == (len(tree) + 1, target.hidden_size)


def test_commit_compacts_cache_to_a_fresh_prefill():
    target = tiny_target(2)
    gen = torch.Generator().manual_seed(1)
    tree = random_tree(10, target.vocab_size, gen)
    deepest = max(range(len(tree)), key=lambda i: int(tree.depths[i]))
    path = tree.path_to(deepest)
    target.prefill(PROMPT[:-1])
    verify(target, PROMPT[-1], tree)
    target.commit([0] + [n + 1 for n in path])
    committed = PROMPT + [tree.token_list[n] for n in path]
    fresh = tiny_target(2)
    fresh.prefill(committed)
    assert target.length == fresh.length == len(committed)
    for ours, theirs in zip(target.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=2e-5, rtol=0)
        torch.testing.assert_close(ours.values, theirs.values, atol=2e-5, rtol=0)
    # Decoding continues exactly as after a fresh prefill.
    nxt = DraftTree.chain([4, 5])
    a = verify(target, 13, nxt).logits
    b = verify(fresh, 13, nxt).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_tree_structure_and_dedup():
    tree = DraftTree(torch.tensor([5, 5, 7, 9, 9]), torch.tensor([-1, -1, 0, 1, 2]),
                     scores=torch.tensor([-1.0, -0.5, -2.0, -1.0, -3.0]))
    assert tree.depths.tolist() == [1, 1, 2, 2, 3]
    assert tree.ancestor_mask[4].tolist() == [True, False, True, False, True]
    deduped = tree.dedup()
    # The higher-scored duplicate (node 1) wins; node 0's subtree goes with it.
    assert deduped.token_list == [5, 9] and deduped.parent_list == [-1, 0]
    mask = tree.verify_mask()
    assert mask[:, 0].all() and mask.shape == (6, 6)
    assert DraftTree.chain([1, 2, 3]).is_chain and not tree.is_chain
