"""Training data: prompts answered by the target itself (greedy by default), so a drafter learns
the distribution it will be verified against. Batched, resumable, cached outside git."""

from __future__ import annotations

import hashlib
import json
import os
import importlib.resources
from pathlib import Path
from typing import Iterable

import torch
from rich.progress import Progress

from specbench.data import distributed
from specbench.data.benchmarks import Prompt
from specbench.errors import SpecbenchError
from specbench.data.part_files import find_parts, part_path
from specbench.engine.prompts import render_chat
from specbench.engine.packaged import cache_dir
from specbench.engine.target import Target
from specbench.training.checkpoint import vocab_fingerprint

DEFAULT_PROMPTS = "train_prompts/sharegpt_first_turns.jsonl"  # relative to the data dir


def dataset_path(target: Target, prompt_file: str | Path, max_new_tokens: int, temperature: float) -> Path:
    """Cache file keyed by the target (name + tokenizer) and the prompt file's content."""
    tag = f"{Path(prompt_file).stem}-{_prompt_digest(prompt_file)}-n{max_new_tokens}-t{temperature:g}.jsonl"
    target_tag = f"{Path(target.name).name}-{vocab_fingerprint(target.tokenizer)[:8]}"
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
    ``max_prompt_tokens`` are skipped: long ShareGPT pastes dominate the cost and teach little.
    Under torchrun rank r answers every N-th unfinished prompt into ``out.part-rofN`` and rank 0
    appends the parts to ``out`` in the order one process would have written them."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    world = distributed.current()
    if not world.active:
        _answer(target, prompts, out, max_new_tokens, batch_size, temperature, system_prompt, max_prompt_tokens)
    else:
        # Every rank sees the same finished set (the file and any parts of a killed run) before any
        # rank writes, so the unfinished prompts are split the same way everywhere.
        done = {e["id"] for f in [out, *find_parts(out)] if f.exists() for e in read_examples(f)}
        mine = distributed.shard([p for p in prompts if p.id not in done], world)
        distributed.barrier()
        _answer(target, mine, part_path(out, world.rank, world.size), max_new_tokens, batch_size, temperature,
                system_prompt, max_prompt_tokens)
        distributed.barrier()
        if world.main:
            _merge_parts(out, prompts)
        distributed.barrier()
    if not read_examples(out):
        raise SpecbenchError(f"no training examples were produced in {out}; check the prompt file")
    return out


def _merge_parts(out: Path, prompts: list[Prompt]) -> None:
    """Append every part's new examples to ``out`` (shortest prompt first, ties in prompt order,
    as one process writes them), then remove the parts (any world size: a resumed run's too)."""
    parts = find_parts(out)
    done = {e["id"] for e in read_examples(out)} if out.exists() else set()
    rank = {p.id: i for i, p in enumerate(prompts)}
    new = {e["id"]: e for part in parts for e in read_examples(part) if e["id"] not in done}
    ordered = sorted(new.values(), key=lambda e: (len(e["prompt_ids"]), rank.get(e["id"], len(rank))))
    with open(out, "a", encoding="utf-8") as fh:
        for e in ordered:
            fh.write(json.dumps(e) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    for part in parts:
        part.unlink()


def _answer(target: Target, prompts: list[Prompt], out: Path, max_new_tokens: int, batch_size: int,
            temperature: float, system_prompt: str | None, max_prompt_tokens: int) -> None:
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
    with open(out, "a", encoding="utf-8") as fh, Progress(disable=not distributed.current().main) as progress:
        task = progress.add_task("regenerating responses", total=len(todo))
        for chunk in _batches(todo, batch_size):
            responses = _generate_batch(target, [ids for _, ids in chunk], max_new_tokens, temperature, generator)
            for (pid, ids), resp in zip(chunk, responses):
                fh.write(json.dumps({"id": pid, "prompt_ids": ids, "response_ids": resp}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
            progress.advance(task, len(chunk))


# Regenerated answers ship without their prompts (the prompt files stay in the data dir): a
# gzipped JSONL whose first line describes what the responses answer, then {id, response_ids}.
SHIPPED_RESPONSES = Path(str(importlib.resources.files("specbench.training") / "responses"))  # package data


def _prompt_digest(prompt_file: str | Path) -> str:
    return hashlib.sha256(Path(prompt_file).read_bytes()).hexdigest()[:10]


def export_responses(cache_file: str | Path, out: str | Path, **provenance) -> Path:
    """Write the responses of a regeneration cache file (no prompt text) to ``out`` (.jsonl.gz)."""
    import gzip

    examples = read_examples(cache_file)
    header = {"responses_of": Path(cache_file).name, "examples": len(examples), **provenance}
    from specbench.data.safe_files import atomic_path

    out = Path(out)
    with atomic_path(out, "--export") as tmp:  # whole or not at all; never over the prompts it answers
        with gzip.open(tmp, "wt", encoding="utf-8") as fh:
            fh.write(json.dumps(header) + "\n")
            for e in examples:
                fh.write(json.dumps({"id": e["id"], "response_ids": e["response_ids"]}, separators=(",", ":")) + "\n")
    return out


def import_responses(target: Target, prompts: list[Prompt], shipped: str | Path, out: str | Path,
                     system_prompt: str | None = None) -> int:
    """Rebuild cache rows {id, prompt_ids, response_ids} from a shipped responses file by rendering
    each prompt again with the target's chat template. Returns the number of rows added."""
    import gzip

    with gzip.open(shipped, "rt", encoding="utf-8") as fh:
        header = json.loads(fh.readline())
        responses = {row["id"]: row["response_ids"] for row in map(json.loads, fh)}
    if header.get("vocab") != vocab_fingerprint(target.tokenizer):
        raise SpecbenchError(f"{shipped} was generated with another tokenizer; regenerate with `specbench train data`")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {e["id"] for e in read_examples(out)} if out.exists() else set()
    added = 0
    with open(out, "a", encoding="utf-8") as fh:
        for p in prompts:
            if p.id in responses and p.id not in done:
                ids = render_chat(target.tokenizer, [{"role": "user", "content": p.turns[0]}], system_prompt)
                fh.write(json.dumps({"id": p.id, "prompt_ids": ids, "response_ids": responses[p.id]}) + "\n")
                added += 1
        fh.flush()
        os.fsync(fh.fileno())
    return added


def shipped_responses_for(target: Target, prompt_file: str | Path, max_new_tokens: int,
                          temperature: float) -> Path | None:
    """A shipped responses file answering exactly this prompt file with these settings, if any."""
    import gzip

    folder = SHIPPED_RESPONSES / Path(target.name).name
    for path in sorted(folder.glob("*.responses.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            header = json.loads(fh.readline())
        if (header.get("prompt_digest") == _prompt_digest(prompt_file)
                and header.get("max_new_tokens") == max_new_tokens and header.get("temperature") == temperature):
            return path
    return None
