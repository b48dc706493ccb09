"""The batched decode loop: B requests decode together, each with its own tree, one target forward per step.

    queue -> join (Target.prefill, per request) -> [ Drafter.propose_batch -> compile_batch -> ONE verify
             forward -> walk per request -> commit per request -> Drafter.observe_batch ] -> leave -> record

Each step every active request drafts its own tree (``Drafter.propose_batch``; by default one drafter
fork per request, see drafter.py); the target verifies all trees in one forward over its ragged cache
(batch_target.py: each request's rows see its own committed prefix and its own ancestors, at its own
positions); each request's path is accepted by the same walk as batch 1 (verify.py), with its own
sampling parameters and generator; the cache keeps each request's accepted rows at its own length
(batch_cache.py). A request that reaches EOS or its token budget leaves the batch after the step; with
``continuous`` the next queued request takes its slot at once, else the batch refills only when all B
have finished (static batches).

One clock for the batch. The phases are those of batch 1 (prefill, draft, compile, verify, commit) on
one ``PhaseTimer``; each step's time and forward counts are charged in full to every request active
in that step (a request's ``times`` are what it waited through while decoding: B requests that share
a 10 ms verify each record 10 ms of verify). A request's prefill (its target prefill, and the
drafter's ``begin_batch`` shared by the requests joining with it) is charged to the joining requests
only. The batch clock (the sum of every phase so far) gives each record ``batch.start`` (before its
prefill) and ``batch.end`` (after its last step): per-request latency is end - start, which includes
other requests' prefills that stalled it, and a group's throughput is its tokens over its makespan
(max end - min start over the records of one ``batch.group``). See docs/usage.md.

Methods that learn while serving (``Drafter.learns``) are refused: their updates follow the stream
one request after another, and a batch interleaves requests; a learner whose memory concurrent
requests share by design (``Drafter.batch_learning``) is the exception.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from specbench.divergence import TopLogits, top_rows
from specbench.engine import MAX_BATCH, interrupt
from specbench.engine.batch_target import BatchTarget
from specbench.engine.drafter import DecodeState, Drafter, VerifyResult
from specbench.engine.loop import GenerationConfig, _count_depths, _generator, _truncate, kept_in_turn
from specbench.engine.prompts import render_chat
from specbench.engine.target import Target
from specbench.engine.timing import NULL_TIMER, PhaseTimer
from specbench.engine.verify import sample_token, walk
from specbench.errors import SpecbenchError
from specbench.records import GenerationRecord


@dataclass(frozen=True)
class BatchConfig:
    size: int = 1  # requests decoded together
    continuous: bool = False  # a finished request's slot is refilled at once (else: static batches)

    def __post_init__(self) -> None:
        if not 1 <= self.size <= MAX_BATCH:
            raise SpecbenchError(f"--batch-size must be in [1, {MAX_BATCH}] (got {self.size})")


@dataclass(eq=False)
class BatchRequest:
    """One prompt turn to decode; ``key`` is the caller's handle, returned with its record."""

    key: Any
    prompt_ids: list[int]
    config: GenerationConfig = GenerationConfig()


def check_batchable(drafter: Drafter) -> None:
    """One line for a method that cannot share a batch (before anything runs)."""
    reason = drafter.batch_refusal()
    if reason:
        raise SpecbenchError(f"{drafter.name or type(drafter).__name__} {reason}")


@dataclass(eq=False)
class _Active:
    """A request in the batch: its decode state and what its record will say."""

    request: BatchRequest
    state: DecodeState
    eos: set[int]
    start: float  # batch clock (s) before its prefill
    group: int
    new_tokens: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    accepts: list[int] = field(default_factory=list)
    chain_calls: int = 0
    hit_eos: bool = False
    rows_seen: int = 0  # sum over its steps of the requests active in them
    tops: list | None = None
    ns: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    forward_ns: Counter = field(default_factory=Counter)

    @property
    def done(self) -> bool:
        return self.hit_eos or len(self.new_tokens) >= self.request.config.max_new_tokens


def _snapshot(timer: PhaseTimer) -> tuple[Counter, Counter, Counter]:
    timer.resolve()  # CUDA: one synchronize per step (the walk has already read the logits back)
    return Counter(timer.ns), Counter(timer.forward_calls), Counter(timer.forward_ns)


def _charge(timer: PhaseTimer, before: tuple[Counter, Counter, Counter], requests: Sequence[_Active]) -> int:
    """Add what the timer measured since ``before`` to every request in ``requests``; returns the
    nanoseconds of the top-level phases (the batch clock's advance)."""
    ns, calls, fwd = _snapshot(timer)
    delta_ns = ns - before[0]
    for active in requests:
        active.ns.update(delta_ns)
        active.calls.update(calls - before[1])
        active.forward_ns.update(fwd - before[2])
    return sum(v for k, v in delta_ns.items() if k in timer.outer)


def generate_batch(target: Target, drafter: Drafter, queue: deque[BatchRequest], batch: BatchConfig,
                   method: str | None = None, groups: Iterator[int] | None = None,
                   timer: PhaseTimer | None = None) -> Iterator[tuple[BatchRequest, GenerationRecord]]:
    """Decode every request of ``queue`` with at most ``batch.size`` at a time; yields (request, record)
    as each finishes (the caller may append follow-up requests to ``queue`` meanwhile). Records are
    batch 1's (tokens cut at EOS and the budget, accept lengths, phase times) plus ``batch``. ``groups``
    numbers the static batches (or this call, when continuous) across calls."""
    check_batchable(drafter)
    timer = PhaseTimer(target.device) if timer is None else timer
    groups = itertools.count() if groups is None else groups
    verifier = BatchTarget(target)
    taps = tuple(drafter.taps)
    active: list[_Active] = []
    clock = 0  # ns on the batch clock
    group = next(groups) if batch.continuous else -1
    try:
        while queue or active:
            if queue and (not active or batch.continuous) and len(active) < batch.size:
                if not active and not batch.continuous:
                    group = next(groups)
                clock += _join(verifier, drafter, queue, batch.size - len(active), active, timer, taps, clock, group)
                if any(a.done for a in active):  # the prefill's token ended it (EOS, or a budget of 1): no step
                    before = _snapshot(timer)
                    active, finished = _leave(verifier, drafter, active, timer)
                    clock += _charge(timer, before, [a for a, _ in finished])
                    for a, extra in finished:
                        yield a.request, _record(a, extra, clock, batch, drafter, method)
                    continue
            interrupt.check()  # Ctrl-C / SIGTERM: stop after the step in flight; unfinished turns are not recorded
            before = _snapshot(timer)
            stepped = active
            states = [a.state for a in active]
            with timer.phase("draft"):
                trees = drafter.propose_batch(states)
            with timer.phase("compile"):
                packed = verifier.compile_batch([s.bonus for s in states], trees)
            with timer.phase("verify"):
                outs = verifier.verify(packed, taps, timer)
                walks = [walk(tree, out.logits, a.state.params, a.state.generator, a.request.config.tree_rule)
                         for a, tree, out in zip(active, trees, outs)]
            kept = [[0] + [node + 1 for node in w.accepted] for w in walks]
            with timer.phase("commit"):
                verifier.commit(packed, kept)
                results = []
                for a, tree, w, out, rows in zip(active, trees, walks, outs, kept):
                    committed = [tree.token_list[n] for n in w.accepted] + [w.bonus]
                    room = a.request.config.max_new_tokens - len(a.new_tokens)
                    a.accept_lengths.append(kept_in_turn(committed, a.eos, room) - 1)
                    a.state.tokens.extend(committed)
                    a.new_tokens.extend(committed)
                    a.hit_eos = any(t in a.eos for t in committed)
                    _count_depths(tree, w.accepted, a.attempts, a.accepts)
                    a.tree_sizes.append(len(tree))
                    a.chain_calls += tree.is_chain
                    a.rows_seen += len(active)
                    kept_taps = {i: t[rows] for i, t in out.taps.items()} if out.taps else {}
                    results.append(VerifyResult(tree, w.accepted, committed, w.bonus, out.logits, kept_taps,
                                                w.stop_row))
            for a, out, rows in zip(active, outs, kept):
                if a.tops is not None:  # T = 0: the rows that chose each token, for divergence.py (untimed, as batch 1)
                    a.tops.append(top_rows(out.logits[rows]))
            with timer.phase("draft"):
                drafter.observe_batch(states, results)
            active, finished = _leave(verifier, drafter, active, timer)
            clock += _charge(timer, before, stepped)
            for a, extra in finished:
                yield a.request, _record(a, extra, clock, batch, drafter, method)
    finally:  # stopped early (an error, Ctrl-C, a caller that stops reading): the drafter forgets these rows
        if active:
            drafter.end_batch(range(len(active)), [a.state for a in active])


def _leave(verifier: BatchTarget, drafter: Drafter, active: list[_Active],
           timer: PhaseTimer) -> tuple[list[_Active], list[tuple[_Active, dict]]]:
    """Drop the finished requests' cache rows (timed as commit) and drafter rows; returns the requests
    that stay and the finished ones with their ``end`` statistics."""
    leaving = [b for b, a in enumerate(active) if a.done]
    if not leaving:
        return active, []
    with timer.phase("commit"):
        verifier.leave(leaving)
    stats = drafter.end_batch(leaving, [active[b].state for b in leaving])  # untimed, as batch 1's end
    gone = set(leaving)
    finished = [(active[b], extra or {}) for b, extra in zip(leaving, stats)]
    return [a for b, a in enumerate(active) if b not in gone], finished


def _join(verifier: BatchTarget, drafter: Drafter, queue: deque[BatchRequest], room: int, active: list[_Active],
          timer: PhaseTimer, taps: tuple[int, ...], clock: int, group: int) -> int:
    """Prefill up to ``room`` queued requests (each as batch 1 does) and hand them to the drafter
    together; each one's prefill is charged to it alone, the drafter's ``begin_batch`` to all of them.
    Returns the batch clock's advance (ns)."""
    joining, prefills = [], []
    advance = 0
    while queue and len(joining) < room:
        request = queue.popleft()
        config = request.config
        if config.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        prompt = [int(t) for t in request.prompt_ids]
        gen = _generator(verifier.target.device, config.seed)
        before = _snapshot(timer)
        with timer.phase("prefill"):
            out = verifier.join(prompt, taps)
            bonus = sample_token(out.logits[-1], config.sampling, gen)
        state = DecodeState(tokens=prompt + [bonus], prompt_len=len(prompt), params=config.sampling, generator=gen,
                            timer=NULL_TIMER)  # begin's forwards are not counted, as in batch 1
        eos = verifier.target.eos_token_ids if config.stop_on_eos else set()
        one = _Active(request, state, eos, start=(clock + advance) / 1e9, group=group, new_tokens=[bonus],
                      hit_eos=bonus in eos,
                      tops=[top_rows(out.logits[-1:])] if config.sampling.greedy else None)
        advance += _charge(timer, before, [one])
        joining.append(one)
        prefills.append(out)
    before = _snapshot(timer)
    with timer.phase("prefill"):
        drafter.begin_batch([a.state for a in joining], prefills)
    advance += _charge(timer, before, joining)
    for a in joining:
        a.state.timer = timer
    active.extend(joining)
    return advance


def _record(a: _Active, extra: dict, clock: int, batch: BatchConfig, drafter: Drafter,
            method: str | None) -> GenerationRecord:
    config = a.request.config
    new_tokens, stop_reason = _truncate(a.new_tokens, a.eos, config.max_new_tokens)
    record = GenerationRecord(
        method=method or drafter.name,
        new_tokens=new_tokens,
        prompt_tokens=a.state.prompt_len,
        stop_reason=stop_reason,
        times={k: v / 1e9 for k, v in a.ns.items()},
        n_verify=len(a.accept_lengths),
        accept_lengths=a.accept_lengths,
        tree_sizes=a.tree_sizes,
        depth_attempts=a.attempts,
        depth_accepts=a.accepts,
        forwards=dict(a.calls),
        forward_times={k: v / 1e9 for k, v in a.forward_ns.items()},
        temperature=config.sampling.temperature,
        seed=config.seed,
        extra=extra,
        chain_calls=a.chain_calls,
        batch={"size": batch.size, "continuous": batch.continuous, "group": a.group, "start": a.start,
               "end": clock / 1e9, "active_mean": a.rows_seen / max(len(a.accept_lengths), 1),
               "batched_drafting": bool(drafter.batched_drafting)},
    )
    record.top_logits = TopLogits.from_rows(a.tops, len(new_tokens)) if a.tops is not None else None  # not written
    record.prompt_ids = a.state.tokens[: a.state.prompt_len]  # not written either: a flip's re-scoring (rescore.py)
    return record


def generate_conversations(target: Target, drafter: Drafter, conversations: Sequence[Sequence[str]],
                           config_for: Callable[[int, int], GenerationConfig], batch: BatchConfig,
                           system_prompt: str | None = None, method: str | None = None,
                           finished: Callable[[int, int], GenerationRecord | None] = lambda c, k: None,
                           admit: Callable[[int, list[int]], bool] = lambda c, ids: True,
                           groups: Iterator[int] | None = None) -> Iterator[tuple[int, GenerationRecord]]:
    """``loop.generate_turns`` for many conversations decoded in batches: turn k of a conversation is
    queued once its turn k-1 has an answer (a stored one from ``finished(c, k)``, or decoded here), so
    the turns of different conversations share batches. Yields (conversation index, record) as each
    turn finishes; ``admit(c, ids)`` may refuse a rendered turn, which ends that conversation."""
    messages: list[list[dict]] = [[] for _ in conversations]
    queue: deque[BatchRequest] = deque()

    def answer(c: int, record: GenerationRecord) -> None:
        text = target.tokenizer.decode(record.new_tokens, skip_special_tokens=True)
        messages[c].append({"role": "assistant", "content": text})

    def advance(c: int, k: int) -> None:
        """Queue conversation c's first turn from k on that has no record yet."""
        for turn in range(k, len(conversations[c])):
            messages[c].append({"role": "user", "content": conversations[c][turn]})
            record = finished(c, turn)
            if record is None:
                ids = render_chat(target.tokenizer, messages[c], system_prompt, getattr(target, "chat", None))
                if admit(c, ids):
                    queue.append(BatchRequest((c, turn), ids, config_for(c, turn)))
                return
            answer(c, record)

    for c in range(len(conversations)):
        advance(c, 0)
    for request, record in generate_batch(target, drafter, queue, batch, method, groups):
        c, turn = request.key
        record.turn = turn
        yield c, record
        answer(c, record)
        advance(c, turn + 1)

