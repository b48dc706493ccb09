"""Training data: prompts answered by the target itself (greedy by default), so a drafter learns
the distribution it will be verified against. Batched, resumable, cached outside git."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

import torch
from rich.progress import Progress

from specbench.benchmarks import Prompt
from specbench.errors import SpecbenchError
from specbench.prompts import render_chat
from specbench.target import Target, cache_dir
from specbench.training.checkpoint import tokenizer_fingerprint

DEFAULT_PROMPTS = "train_prompts/sharegpt_first_turns.jsonl"  # relative to the data dir


def dataset_path(target: Target, prompt_file: str | Path, max_new_tokens: int, temperature: float) -> Path:
    """Cache file keyed by the target (name + tokenizer) and the prompt file's content."""
    digest = hashlib.sha256(Path(prompt_file).read_bytes()).hexdigest()[:10]
    tag = f"{Path(prompt_file).stem}-{digest}-n{max_new_tokens}-t{temperature:g}.jsonl"
    target_tag = f"{Path(target.name).name}-{tokenizer_fingerprint(target.tokenizer)[:8]}"
    return cache_dir() / "data" / target_tag / tag


def read_examples(path: str | Path) -> list[dict]:
    """Examples {id, prompt_ids, response_ids}; a torn last line is ignored."""
    examples = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.endswith("\n"):
                break
            examples.append(json.loads(line))
    return examples


def _batches(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i: i + size]


@torch.inference_mode()
def _generate_batch(target: Target, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                    generator: torch.Generator | None) -> list[list[int]]:
    """Left-padded batched generation with HF generate (KV cache); responses cut after EOS."""
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else min(target.eos_token_ids)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    kwargs = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, pad_token_id=pad)
    if temperature > 0:
        kwargs["temperature"] = temperature
    out = target.model.generate(ids.to(target.device), attention_mask=mask.to(target.device), **kwargs)
    responses = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in target.eos_token_ids), len(row))
        responses.append(row[:cut])
    return responses


def regenerate(target: Target, prompts: list[Prompt], out: str | Path, max_new_tokens: int = 256,
               batch_size: int = 8, temperature: float = 0.0, system_prompt: str | None = None,
               max_prompt_tokens: int = 512) -> Path:
    """Answer every prompt with the target and append {id, prompt_ids, response_ids} to ``out``.

    Finished ids are skipped on a rerun (resume); each batch is fsynced. Prompts longer than
    ``max_prompt_tokens`` are skipped: long ShareGPT pastes dominate the cost and teach little."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {e["id"] for e in read_examples(out)} if out.exists() else set()
    todo = []
    for p in prompts:
        if p.id in done:
            continue
        ids = render_chat(target.tokenizer, [{"role": "user", "content": p.turns[0]}], system_prompt,
                          getattr(target, "chat", None))
        if len(ids) <= max_prompt_tokens:
            todo.append((p.id, ids))
    # Similar lengths batch together: less padding, less wasted compute.
    todo.sort(key=lambda item: len(item[1]))
    generator = torch.Generator().manual_seed(0) if temperature > 0 else None
    with open(out, "a", encoding="utf-8") as fh, Progress() as progress:
        task = progress.add_task("regenerating responses", total=len(todo))
        for chunk in _batches(todo, batch_size):
            responses = _generate_batch(target, [ids for _, ids in chunk], max_new_tokens, temperature, generator)
            for (pid, ids), resp in zip(chunk, responses):
                fh.write(json.dumps({"id": pid, "prompt_ids": ids, "response_ids": resp}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
            progress.advance(task, len(chunk))
    if not read_examples(out):
        raise SpecbenchError(f"no training examples were produced in {out}; check the prompt file")
    return out
