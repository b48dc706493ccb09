"""PACER's training data: replayed speculative decoding of the draft model, every step of one response packed
into one sequence (paper Fig. 5), and padded batches of them. The row convention is inference's
(``drafter.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbench.engine import kvcache


def replay_steps(greedy_next: list[int], tokens: list[int], start: int) -> list[tuple[int, int]]:
    """Greedy SD against the fixed sequence ``tokens``: ``greedy_next[j]`` is the draft's argmax after
    tokens[:j+1]. While drafts match they equal the teacher-forced argmaxes, so each step's accepted
    length follows from one forward. Returns (first draft position c, accepted a) per step; the
    target's bonus token is tokens[c + a]."""
    steps, c, n = [], start, len(tokens)
    while c < n:
        a = 0
        while c + a < n and greedy_next[c + a - 1] == tokens[c + a]:
            a += 1
        steps.append((c, a))
        c += a + 1
    return steps


def step_labels(accepted: int, drafted: int) -> list[int]:
    """1 for drafts 1..a (all equal the target so far), 0 from the first mismatch on."""
    return [1] * min(accepted, drafted) + [0] * max(drafted - accepted, 0)


def packed_visibility(prefix_rows: int, steps: list[tuple[int, int]]) -> torch.Tensor:
    """Bool [T, T] mask of one packed response (Fig. 5). Rows 0..prefix_rows-1 are the committed
    tokens at positions 1..prefix_rows (causal). Then each step (c, m) adds m draft rows; draft j of
    that step sees the prefix rows of positions 1..c-1 and drafts 1..j of its own step."""
    total = prefix_rows + sum(m for _, m in steps)
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:prefix_rows, :prefix_rows] = torch.ones(prefix_rows, prefix_rows, dtype=torch.bool).tril()
    row = prefix_rows
    for c, m in steps:
        mask[row: row + m, : c - 1] = True
        mask[row: row + m, row: row + m] = torch.ones(m, m, dtype=torch.bool).tril()
        row += m
    return mask


@torch.no_grad()
def _free_drafts(model, cache, n_cached: int, roots: list[tuple[int, int]], length: int, vocab: int) -> torch.Tensor:
    """Greedy drafting from K branch roots at once over one shared teacher-forced cache. Root k is
    (position p, token y): token y at p after the cached tokens [0, p). Feeds ``length`` tokens per
    branch and returns the states after each feed, [K, length, H]."""
    k = len(roots)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    positions = torch.tensor([p for p, _ in roots], device=device)
    tokens = torch.tensor([y for _, y in roots], device=device)
    prefix = torch.arange(n_cached, device=device).unsqueeze(0) < positions.unsqueeze(1)  # [K, n_cached]
    own = torch.eye(k, dtype=torch.bool, device=device)
    states = []
    for d in range(length):
        visible = torch.cat([prefix] + [own] * (d + 1), dim=1)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
        out = model(input_ids=tokens.unsqueeze(0), position_ids=(positions + d).unsqueeze(0),
                    attention_mask=mask[None, None], use_cache=True, output_hidden_states=True,
                    **kvcache.cache_arg(model, cache))
        states.append(out.hidden_states[-1][0])
        tokens = out.logits[0, :, :vocab].argmax(-1)
    return torch.stack(states, 1)


@torch.no_grad()
def pack_example(draft_model, example: dict, window: int, vocab: int,
                 store_dtype: torch.dtype = torch.bfloat16) -> dict | None:
    """One packed training sequence for a regenerated response (None if it has no draft step).

    Keys: hidden [T, H] (``store_dtype``: bf16 halves the in-memory dataset), draft_pos [T], position_ids [T], labels [T] (-1 = no loss),
    steps [(c, m)], prefix_rows, accepted (per step)."""
    from transformers import DynamicCache

    tokens = example["prompt_ids"] + example["response_ids"]
    start = len(example["prompt_ids"]) + 1  # the prefill's bonus token comes from the target itself
    if start >= len(tokens):
        return None
    device = next(draft_model.parameters()).device
    cache = DynamicCache()
    out = draft_model(input_ids=torch.tensor([tokens], device=device), use_cache=True,
                      output_hidden_states=True, **kvcache.cache_arg(draft_model, cache))
    forced = out.hidden_states[-1][0]  # [N, H]: state at j produced the draft for position j + 1
    greedy = out.logits[0, :, :vocab].argmax(-1).tolist()
    steps = replay_steps(greedy, tokens, start)
    drafted = [min(window, len(tokens) - c) for c, _ in steps]
    # Drafts after the first mismatch leave the teacher-forced path: draft them for real.
    branches = [(i, c + a, greedy[c + a - 1]) for i, ((c, a), m) in enumerate(zip(steps, drafted)) if m > a + 1]
    free = {}
    if branches:
        length = max(drafted[i] - steps[i][1] - 1 for i, _, _ in branches)
        states = _free_drafts(draft_model, cache, len(tokens), [(p, y) for _, p, y in branches], length, vocab)
        free = {i: states[j] for j, (i, _, _) in enumerate(branches)}
    prefix_rows = len(tokens) - 1
    hidden, draft_pos, pos, labels = [forced[:-1]], [0] * prefix_rows, list(range(1, len(tokens))), [-1] * prefix_rows
    for i, ((c, a), m) in enumerate(zip(steps, drafted)):
        on_path = min(m, a + 1)  # drafts 1..a+1 were produced by teacher-forced states
        rows = [forced[c - 1: c - 1 + on_path]]
        if m > on_path:
            rows.append(free[i][: m - on_path])
        hidden.append(torch.cat(rows))
        draft_pos += list(range(1, m + 1))
        pos += list(range(c, c + m))
        labels += step_labels(a, m)
    return {"hidden": torch.cat(hidden).to(store_dtype).cpu(), "draft_pos": torch.tensor(draft_pos),
            "position_ids": torch.tensor(pos), "labels": torch.tensor(labels, dtype=torch.float32),
            "steps": [(c, m) for (c, _), m in zip(steps, drafted)], "prefix_rows": prefix_rows,
            "accepted": [a for _, a in steps], "id": example.get("id", "")}


@dataclass
class PacerBatch:
    hidden: torch.Tensor  # [B, T, H]
    draft_pos: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, 1, T, T] bool, True = visible
    labels: torch.Tensor  # [B, T], -1 = no loss (committed rows, padding)


def collate(packed: list[dict]) -> PacerBatch:
    """Right-pad packed sequences; padding rows see only themselves (no NaN rows) and carry no loss."""
    width = max(p["hidden"].shape[0] for p in packed)
    b, h = len(packed), packed[0]["hidden"].shape[1]
    hidden = torch.zeros(b, width, h)
    draft_pos = torch.zeros(b, width, dtype=torch.long)
    pos = torch.zeros(b, width, dtype=torch.long)
    labels = torch.full((b, width), -1.0)
    mask = torch.eye(width, dtype=torch.bool).repeat(b, 1, 1)
    for i, p in enumerate(packed):
        t = p["hidden"].shape[0]
        hidden[i, :t] = p["hidden"].float()
        draft_pos[i, :t], pos[i, :t], labels[i, :t] = p["draft_pos"], p["position_ids"], p["labels"]
        mask[i, :t, :t] = packed_visibility(p["prefix_rows"], p["steps"])
    return PacerBatch(hidden, draft_pos, pos, mask.unsqueeze(1), labels)
