"""The decode loop: prefill -> {propose, compile, verify, walk, commit, observe} until EOS or the budget.

Every method, the vanilla baseline included, runs through ``generate``; the phases it times are
the only clock the metrics use. The engine owns that clock (one ``PhaseTimer`` per generation) and
passes it explicitly: to the target's verify, and to the drafter as ``DecodeState.timer``.

Phases: ``prefill``; per step ``draft`` (propose + observe; drafters time sub-phases such as
``tree_build`` and ``adapt`` inside it through ``state.timer``), ``compile`` (the DraftTree turned
into the verify inputs on the target's device: ids, depth positions, mask, child table; the same
code for every method, bookkeeping and not drafting), ``verify`` (forward + walk), ``commit``.

With ``GenerationConfig.forced`` the same loop commits given tokens instead of the target's choices
(``verify.forced_walk``): the teacher-forced check (``engine/forced.py``) runs every method through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from specbench.engine import interrupt
from specbench.divergence import TopLogits, top_rows
from specbench.engine.drafter import DecodeState, Drafter, VerifyResult
from specbench.engine.prompts import render_chat
from specbench.records import GenerationRecord
from specbench.engine.repeats import merge_repeats
from specbench.engine.target import Target
from specbench.engine.timing import NULL_TIMER, PhaseTimer
from specbench.engine.verify import SamplingParams, TreeRule, forced_walk, sample_token, walk

RESERVE_ROWS = 64  # verify rows past the last token a turn keeps, reserved up front (a wider tree grows the cache)


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    seed: int | None = 0
    tree_rule: TreeRule | None = None  # None: A for deterministic trees, C for sampled ones
    stop_on_eos: bool = True
    # Teacher forcing (T = 0, the forced check): commit these tokens instead of the target's choices
    # (verify.forced_walk); past them the walk is greedy.
    forced: tuple[int, ...] | None = None
    keep_logits: bool = False  # keep every committed position's whole logit row (float32, host) on the record


def _generator(device: torch.device, seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def generate(target: Target, drafter: Drafter, prompt_ids: Sequence[int], config: GenerationConfig,
             method: str | None = None, timer: PhaseTimer | None = None) -> GenerationRecord:
    """Generate one turn. Returns a record whose ``new_tokens`` are cut at the first EOS
    (inclusive) and at ``max_new_tokens``. ``timer`` defaults to a fresh ``PhaseTimer`` on the
    target's device (pass a fresh one per generation; a ``NullTimer`` measures the untimed engine)."""
    if config.max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if config.forced is not None and (not config.forced or not config.sampling.greedy):
        raise ValueError("forced tokens need temperature 0 and at least one token")
    interrupt.check()
    timer = PhaseTimer(target.device) if timer is None else timer
    params = config.sampling
    gen = _generator(target.device, config.seed)
    eos = target.eos_token_ids if config.stop_on_eos else set()
    taps = tuple(drafter.taps)
    prompt_ids = [int(t) for t in prompt_ids]

    # Prefill is timed as a whole: its forwards (the target's, the drafter's in begin) are not
    # counted, so the forward counters cover the decode phase only.
    # Room for the whole turn before the clock starts (the compiled engine's static cache; a no-op eagerly).
    target.reserve(len(prompt_ids) + config.max_new_tokens + RESERVE_ROWS)
    with timer.phase("prefill"):
        out = target.prefill(prompt_ids, taps=taps, timer=timer)
        bonus = config.forced[0] if config.forced else sample_token(out.logits[-1], params, gen)
        state = DecodeState(tokens=prompt_ids + [bonus], prompt_len=len(prompt_ids), params=params,
                            generator=gen, timer=NULL_TIMER)
        drafter.begin(state, out)
    state.timer = timer
    # T = 0: the K best logits of the row that chose each committed token, for explaining a divergence
    # from vanilla (divergence.py). Taken between timed phases from logits already computed; they stay
    # on the device until the generation ends, so decoding never waits for them.
    tops = [top_rows(out.logits[-1:])] if params.greedy else None
    kept = [out.logits[-1:].float()] if config.keep_logits else None  # the same rows, whole (forced check)

    new_tokens = [bonus]
    accept_lengths: list[int] = []
    tree_sizes: list[int] = []
    attempts: list[int] = []
    accepts: list[int] = []
    chain_calls = 0

    hit_eos = bonus in eos
    while not hit_eos and len(new_tokens) < config.max_new_tokens:
        interrupt.check()  # Ctrl-C / SIGTERM: stop after the token step in flight; this turn is not recorded
        with timer.phase("draft"):
            tree = drafter.propose(state)
        with timer.phase("compile"):
            compiled = target.compile_tree(state.bonus, tree)
        with timer.phase("verify"):
            out = target.verify(compiled, taps=taps, timer=timer)
            if config.forced is None:
                result = walk(tree, out.logits, params, gen, config.tree_rule)
            else:
                result = forced_walk(tree, out.logits, config.forced[len(new_tokens):])
        with timer.phase("commit"):
            rows = [0] + [node + 1 for node in result.accepted]
            target.commit(rows)
            committed = [tree.token_list[n] for n in result.accepted] + [result.bonus]
            accept_lengths.append(kept_in_turn(committed, eos, config.max_new_tokens - len(new_tokens)) - 1)
            state.tokens.extend(committed)
            new_tokens.extend(committed)
            hit_eos = any(t in eos for t in committed)
            _count_depths(tree, result.accepted, attempts, accepts)
            tree_sizes.append(len(tree))
            chain_calls += tree.is_chain
            kept_taps = {i: t[rows] for i, t in out.taps.items()} if out.taps else {}
        if tops is not None:
            tops.append(top_rows(out.logits[rows]))
        if kept is not None:
            kept.append(out.logits[rows].float())
        with timer.phase("draft"):
            drafter.observe(state, VerifyResult(tree, result.accepted, committed, result.bonus, out.logits,
                                                kept_taps, result.stop_row))
    extra = drafter.end(state) or {}

    new_tokens, stop_reason = _truncate(new_tokens, eos, config.max_new_tokens)
    timer.resolve()  # CUDA: read every event of this generation (one synchronize)
    record = GenerationRecord(
        method=method or drafter.name,
        new_tokens=new_tokens,
        prompt_tokens=len(prompt_ids),
        stop_reason=stop_reason,
        times=timer.seconds(),
        n_verify=len(accept_lengths),
        accept_lengths=accept_lengths,
        tree_sizes=tree_sizes,
        depth_attempts=attempts,
        depth_accepts=accepts,
        forwards=dict(timer.forward_calls),
        forward_times={k: v / 1e9 for k, v in timer.forward_ns.items()},
        temperature=params.temperature,
        seed=config.seed,
        extra=extra,
        chain_calls=chain_calls,
        outside_clock={k: v / 1e9 for k, v in timer.paused_ns.items()},
    )
    record.top_logits = TopLogits.from_rows(tops, len(new_tokens)) if tops is not None else None  # not written
    record.prompt_ids = prompt_ids  # not written either: a flip's re-scoring replays the prompt (rescore.py)
    if kept is not None:  # not written either: row j chose new_tokens[j]
        record.logit_rows = torch.cat(kept)[: len(new_tokens)].cpu()
    return record


def _count_depths(tree, accepted: list[int], attempts: list[int], accepts: list[int]) -> None:
    """Depth k was attempted if depth k-1 was accepted and that node has a child (alpha_k)."""
    reach = len(accepted) + (1 if tree.children.get(accepted[-1] if accepted else -1) else 0)
    while len(attempts) < reach:
        attempts.append(0)
        accepts.append(0)
    for k in range(reach):
        attempts[k] += 1
    for k in range(len(accepted)):
        accepts[k] += 1


def kept_in_turn(committed: Sequence[int], eos: set[int], room: int) -> int:
    """How many of one verify's committed tokens the turn keeps: up to its first EOS and within the ``room``
    left in the token budget. A record's accept length counts only these, so τ never counts tokens cut from
    the text (a long draft accepted in the last step)."""
    stop = next((i + 1 for i, t in enumerate(committed) if t in eos), len(committed))
    return min(stop, room)


def _truncate(tokens: list[int], eos: set[int], limit: int) -> tuple[list[int], str]:
    for i, t in enumerate(tokens[:limit]):
        if t in eos:
            return tokens[: i + 1], "eos"
    return tokens[:limit], "length"


def generate_turns(target: Target, drafter: Drafter, turns: list[str], config_for: Callable[[int], GenerationConfig],
                   system_prompt: str | None = None, method: str | None = None,
                   finished: Callable[[int], GenerationRecord | None] = lambda turn: None,
                   admit: Callable[[list[int]], bool] = lambda ids: True,
                   repeats: int = 1) -> Iterator[GenerationRecord]:
    """Multi-turn generation (MT-Bench): turn k is rendered with the chat template over the
    earlier user turns and this method's own answers to them.

    Yields each newly generated record as soon as it exists (so the caller can store it before
    the next turn starts). ``finished(k)`` returns an already stored record to reuse instead of
    regenerating (resume); ``admit(ids)`` may refuse a rendered turn (e.g. past the context),
    which ends the conversation. ``repeats`` > 1 times each turn that many times back to back (same
    seed; the tokens must agree) and yields the median repeat's record with every repeat's times."""
    messages: list[dict] = []
    for k, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        record = finished(k)
        if record is None:
            ids = render_chat(target.tokenizer, messages, system_prompt, getattr(target, "chat", None))
            if not admit(ids):
                return
            runs = [generate(target, drafter, ids, config_for(k), method=method) for _ in range(repeats)]
            record = merge_repeats(runs, where=f"turn {k} of {method or drafter.name}") if repeats > 1 else runs[0]
            record.turn = k
            yield record
        answer = target.tokenizer.decode(record.new_tokens, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
