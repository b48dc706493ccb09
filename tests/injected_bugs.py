"""Four subtle verify bugs, injected into the engine for the length of a ``with`` block: the negative controls
that the forced check (and the divergence rule) must catch.

Each is small enough to survive a casual test and each leaves vanilla's one-row steps untouched (no draft
rows, no tree mask, a plain crop of the cache, a walk that stops at the root), so vanilla stays the reference:

* ``draft_positions_off_by_one``: every draft row's position id is one too high (the root's is right);
* ``stale_kv_row_after_compaction``: when a commit gathers the accepted rows, the last one is not moved,
  so its slot keeps whatever verify row sat there;
* ``tree_mask_sees_a_sibling``: each tree node also attends to one sibling (a mask leak);
* ``bonus_from_wrong_row``: after an accepted node the bonus token is read from its parent's row.

``BUGS`` maps each name to its context manager and ``EXERCISED_BY`` names the kind of draft that reaches it."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from specbench.engine import target as target_module
from specbench.engine import verify
from specbench.engine.target import Target


@contextmanager
def _patched(owner, name: str, replacement) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextmanager
def draft_positions_off_by_one() -> Iterator[None]:
    original = Target.compile_tree

    def compile_tree(self, root, tree):
        compiled = original(self, root, tree)
        compiled.positions = compiled.positions.clone()
        compiled.positions[:, 1:] += 1
        return compiled

    with _patched(Target, "compile_tree", compile_tree):
        yield


def _cache_slots(cache) -> list[tuple[object, str]]:
    """(owner, attribute) of every key and value tensor of a DynamicCache, in either layout."""
    if hasattr(cache, "layers"):
        return [(layer, name) for layer in cache.layers for name in ("keys", "values")]
    return [(store, i) for store in (cache.key_cache, cache.value_cache) for i in range(len(store))]


def _get(owner, key):
    return owner[key] if isinstance(key, int) else getattr(owner, key)


@contextmanager
def stale_kv_row_after_compaction() -> Iterator[None]:
    original = Target.commit

    def commit(self, rows):
        rows = list(rows)
        slot = self.length + len(rows) - 1
        gathered = rows != list(range(len(rows)))
        before = [_get(owner, key)[:, :, slot].clone() for owner, key in _cache_slots(self.cache)] if gathered else []
        original(self, rows)
        with torch.inference_mode():  # the cache was filled under inference mode
            for (owner, key), old in zip(_cache_slots(self.cache), before):
                _get(owner, key)[:, :, slot] = old

    with _patched(Target, "commit", commit):
        yield


@contextmanager
def tree_mask_sees_a_sibling() -> Iterator[None]:
    original = target_module.verify_visibility

    def visibility(parents: torch.Tensor) -> torch.Tensor:
        visible = original(parents)
        listed = parents.tolist()
        for node, parent in enumerate(listed):
            sibling = next((s for s, p in enumerate(listed) if p == parent and s != node), None)
            if sibling is not None:
                visible[node + 1, sibling + 1] = True
        return visible

    with _patched(target_module, "verify_visibility", visibility):
        yield


@contextmanager
def bonus_from_wrong_row() -> Iterator[None]:
    original = verify.follow

    def follow(tree, choices):
        result = original(tree, choices)
        if not result.accepted:
            return result
        parent_row = result.accepted[-2] + 1 if len(result.accepted) > 1 else 0
        return verify.WalkResult(result.accepted, choices[parent_row])

    with _patched(verify, "follow", follow):
        yield


BUGS = {
    "positions": draft_positions_off_by_one,
    "stale-kv": stale_kv_row_after_compaction,
    "sibling-mask": tree_mask_sees_a_sibling,
    "bonus-row": bonus_from_wrong_row,
}
EXERCISED_BY = {  # what a draft needs for the bug to reach a committed row
    "positions": "any accepted draft node (chain or tree)",
    "stale-kv": "an accepted path that is not the tree's first rows (a tree, not a chain)",
    "sibling-mask": "an accepted node that has a sibling (a tree)",
    "bonus-row": "any accepted draft node (chain or tree)",
}
