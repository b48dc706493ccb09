"""`specbench run`: one or more method configurations and the vanilla baseline on one benchmark
(or a mixed stream), interleaved prompt by prompt in one process, every finished turn appended to
a results file that a rerun resumes.

Sides: ``RunConfig.sides`` (``specbench.sides.Side``: method, options, label), built by the command line
or by a paper preset, plus vanilla. Each side is one drafter instance that lives for the whole run, so
methods that learn while serving see the queries as one stream in the recorded order (``--passes N``
repeats it).

Under ``torchrun --nproc-per-node N`` each rank runs queries i with i % N == rank (every side of
a query on one rank, in the same alternating order), appends to its own part file, and rank 0
merges the parts into ``--out`` (see ``specbench/run/merge.py``).

With ``--batch-size B`` > 1 the stream is cut into batches (B queries; 4B with ``--continuous``) and every
side decodes a batch through the batched loop (``engine/batch_loop.py``) before the next side does,
alternating which side goes first per batch. A sweep (``--batch-size 1,2,4``) decodes each chunk (the
largest B's) at every B in turn, writing one results file per B (``sweep_out``); its B = 1, like
``--batched-loop``, runs through the batched loop."""

from __future__ import annotations

import itertools
import warnings
import zlib
from collections import deque
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from specbench.data import distributed, drafter_paths, machine_load

from specbench import divergence, metrics

from specbench.engine import hub, interrupt
from specbench.data.benchmarks import Prompt
from specbench.engine.drafter import Drafter
from specbench.engine.registry import method_class
from specbench.engine.forced import forced_check
from specbench.engine.loop import GenerationConfig, generate, generate_turns
from specbench.engine.compiled_forward import tuning_level
from specbench.engine.batch_loop import BatchConfig, BatchRequest, generate_batch, generate_conversations
from specbench.errors import SpecbenchError
from specbench.data.part_files import find_parts, part_path
from specbench.run.merge import merge_into, read_run
from specbench.engine.prompts import ChatFormat, render_chat
from specbench.engine.rescore import Rescorer
from specbench.records import GenerationRecord
from specbench.data.results import environment_metadata
from specbench.run.context_fit import TREE_SLACK, ContextFit
from specbench.run.store import RunStore, already_exists
from specbench.run.run_config import RunConfig
from specbench.run.plan import PlannedSide, RunPlan
from specbench.data.streams import Query
from specbench.engine.target import Target
from specbench.engine import VANILLA as BASELINE
from specbench.engine.verify import SamplingParams

CONTINUOUS_CHUNK = 4  # --continuous: batches per chunk of the stream, so a chunk's draining tail is a small part of it


def weights_metadata(target: Target, sides: list[tuple[str, Drafter]]) -> dict:
    """The files and commit sha of the target and of every side's weights (sha None: a local path)."""
    source = target.source or hub.Resolved(target.name, Path(target.name))
    return {"target": source.as_dict(),
            "drafters": {label: {name: drafter_paths.portable(src.as_dict()) for name, src in d.sources.items()}
                         for label, d in sides}}


def drafter_recipes(weights: dict) -> dict:
    """Side label -> weights option -> what trained the drafter folder it loaded (``weights_metadata``'s sources,
    ``drafter_paths.folder_recipes``), so the report tells drafters of one method apart by their recipe; sides
    without such a folder are left out."""
    return {label: recipes for label, sources in weights["drafters"].items()
            if (recipes := drafter_paths.folder_recipes(sources))}


def record_seed(seed: int, prompt_id: str, turn: int) -> int:
    """A per-turn seed, so each record is reproducible on its own (resumed runs included)."""
    return (seed * 1_000_003 + zlib.crc32(f"{prompt_id}#{turn}".encode())) % (2**31)


class Runner:
    def __init__(self, plan: RunPlan, console: Console | None = None) -> None:
        """Opens every results file of ``plan`` (``plan.plan_run``: every parse and refusal is done there),
        then loads the target and the sides' drafters."""
        self.load_start = machine_load.load_average()  # before anything of ours loads
        cfg = self.cfg = plan.cfg
        self.dtype_reason = plan.dtype_reason
        self.console = console or Console(stderr=True)
        self.world = distributed.init(cfg.device)
        self.stream_prompts = plan.prompts  # every rank's: what --on-long-prompt skip checks before a turn runs
        self.queries: list[Query] = distributed.shard(plan.stream, self.world)
        self.bench = plan.bench
        self.batch_sizes = plan.batch_sizes
        self.outs = plan.outs
        self.inputs = plan.inputs
        self.stores: dict[int, RunStore] = {}
        try:  # a model that fails to load (or a file that cannot be opened) leaves no results file behind
            for size in self.batch_sizes:
                meta = plan.meta(size)
                identity = cfg.at_batch(size).identity()
                self.out = self.outs[size]
                if self.world.active:
                    self.store = self._open_part(meta, identity)
                else:
                    self.store = RunStore(self.out, meta, resume=cfg.resume, overwrite=cfg.overwrite,
                                          inputs=self.inputs, identity=identity)
                self.stores[size] = self.store
            self._at(self.batch_sizes[0])
            # a signal during a load stops it at once (nothing to keep yet)
            with distributed.main_first(), interrupt.abortable():  # rank 0 fills any model cache first
                self._load(cfg, plan.sides, cfg.with_baseline)
        except BaseException:
            for store in self.stores.values():
                store.abandon()
            raise
        self.sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
        self.skipped: list[str] = []  # prompt ids skipped past the context, each once
        self.warned: set[tuple[str, int]] = set()  # (prompt id, tokens) of the turns a skip line was printed for
        # T = 0 with a vanilla side: each method turn is compared with vanilla's (divergence.py); a method turn
        # that ran before its vanilla twin waits here, unwritten, until the twin exists (lost on an interrupt,
        # so a resume reruns it).
        self.explain = cfg.with_baseline and self.sampling.greedy
        # bf16/fp16: each new flip is re-scored by the exact rule (an fp32 copy of the target made at the first one)
        self.rescorer = Rescorer(self.target) if self.explain and divergence.exact_rule_applies(self.target.dtype) \
            else None
        self.held: dict[tuple, GenerationRecord] = {}
        # --check forced: vanilla's turns keep their logit rows until their query has ended (engine/forced.py)
        self.forced = cfg.turn_check == "forced"
        self.with_rows: list[GenerationRecord] = []
        self.groups = {label: itertools.count() for label, _ in self.sides}  # batch groups, numbered per side
        learners = [label for label, d in self.sides if d.learns]
        if cfg.resume and any(store.done for store in self.stores.values()) and learners:
            warnings.warn(f"resuming {', '.join(learners)}: what they learnt before the interruption is not restored, "
                          "so later queries start from the pre-deployment drafter; rerun with --overwrite for a clean stream")
        if self.world.active and learners and self.world.main:
            warnings.warn(f"{', '.join(learners)} learn while serving: under {self.world.size} processes each rank's "
                          f"drafter sees only every {self.world.size}th query of the stream; run one process for the "
                          "paper's single-stream setting")

    def _open_part(self, meta: dict, identity: dict) -> RunStore:
        """This rank's part file. Every rank checks the merged file and the parts on disk before any
        rank writes (one barrier), so a fresh run never mistakes another rank's new part for an old
        one; on --resume the records already in the merged file or in other parts count as done."""
        cfg, world = self.cfg, self.world
        mine = part_path(self.out, world.rank, world.size)
        existing = ([self.out] if self.out.exists() and self.out.stat().st_size > 0 else []) + find_parts(self.out)
        if existing and not (cfg.resume or cfg.overwrite):
            raise already_exists(existing[0])
        done = {}
        if cfg.resume:
            for path in existing:
                if path != mine:
                    done.update(RunStore.read_done(path, meta["config_hash"], identity))
        distributed.barrier()
        store = RunStore(mine, {**meta, "rank": world.rank}, resume=cfg.resume, overwrite=cfg.overwrite,
                         inputs=self.inputs, identity=identity)
        store.done.update(done)
        return store

    def _merge_parts(self) -> list[GenerationRecord]:
        """Rank 0, once every rank has finished: parts (+ an earlier merged file on --resume) -> --out."""
        ours = [part_path(self.out, r, self.world.size) for r in range(self.world.size)]
        if self.cfg.resume:
            sources = ours + [p for p in find_parts(self.out) if p not in ours]
            sources += [self.out] if self.out.exists() else []
        else:
            sources = ours
        merge_into(self.out, sources, inputs=self.inputs)
        for path in find_parts(self.out):
            path.unlink()
        merged = read_run(self.out)
        self.skipped = list(dict.fromkeys(o["prompt_id"] for o in merged.lines if o["type"] == "skip"))
        return [GenerationRecord.from_dict(o) for o in merged.lines if o["type"] == "record"]

    def _load(self, cfg: RunConfig, sides: list[PlannedSide], with_baseline: bool) -> None:
        """Target, prompt format and every side's drafter; then the header (with their shas)."""
        self.target = Target.load(cfg.target, cfg.dtype, distributed.rank_device(cfg.device, self.world),
                                  cfg.attn_implementation, cfg.target_revision, device_map=cfg.device_map,
                                  engine=cfg.engine)
        self.fit = ContextFit(self.target.max_context, cfg.max_new_tokens, cfg.on_long_prompt)
        self.fit.check_answerable((side.label, side.options) for side in sides)
        self.target.chat = ChatFormat(cfg.chat_template, cfg.chat_template_kwargs).resolve(
            self.target.tokenizer, self.target.name).check(self.target.tokenizer, cfg.system_prompt) \
            if self.target.tokenizer is not None else None
        self.sides: list[tuple[str, Drafter]] = []
        for side in sides:
            drafter = side.cls(side.options)
            drafter.setup(self.target)
            self.sides.append((side.label, drafter))
        if with_baseline:
            baseline = method_class(BASELINE)()
            baseline.setup(self.target)
            self.sides.append((BASELINE, baseline))
        prompt_format = self.target.chat.describe(self.target.tokenizer) if self.target.chat else None
        weights = weights_metadata(self.target, self.sides)
        env = {**environment_metadata(self.target.device), "weights": weights, "drafter_recipes": drafter_recipes(weights),
               "prompt_format": prompt_format, "dtype_reason": self.dtype_reason,
               **machine_load.start_fields(self.load_start)}
        if cfg.engine == "compiled" and self.target.device.type == "cpu":  # how its graphs were tuned
            env["compile_tuning"] = tuning_level()
        if cfg.device_map:
            placed = getattr(self.target.model, "hf_device_map", None) or {"": str(self.target.device)}
            env["device_map"] = sorted({str(d) for d in placed.values()})  # the devices the target spans
        for store in self.stores.values():
            store.start(env)

    def _at(self, size: int) -> None:
        """Point the run at one B of a sweep: its results file and store (the only one without a sweep)."""
        self.out, self.store = self.outs[size], self.stores[size]

    @property
    def prompts(self) -> list[Prompt]:
        return [q.prompt for q in self.queries]

    # ---- one prompt ------------------------------------------------------------------------
    def _fits(self, ids: list[int], prompt: Prompt) -> bool:
        """Whether the turn ``ids`` leaves room for --max-new-tokens and a draft tree; a turn that does not fails
        the run (--on-long-prompt fail) or is skipped with one line per prompt turn, however many sides skip it."""
        skip_line = self.fit.turn(len(ids), f"{self.bench}/{prompt.id}")
        if skip_line is None:
            return True
        if (prompt.id, len(ids)) not in self.warned:  # the sides render the same turn alike: once for them all
            self.warned.add((prompt.id, len(ids)))
            self.console.print(skip_line, markup=False, highlight=False, soft_wrap=True)
        return False

    def _skip(self, prompt_id: str) -> None:
        """Count a skipped prompt once, whichever sides and turns skip it."""
        if prompt_id not in self.skipped:
            self.skipped.append(prompt_id)

    def _check_a_prompt_fits(self) -> None:
        """Refuse a run whose every prompt is past the context (only first turns are known before the run)."""
        if self.target.tokenizer is None or not self.stream_prompts:
            return
        self.fit.check_some_prompt_fits((len(render_chat(self.target.tokenizer, [{"role": "user", "content": p.turns[0]}],
                                                         self.cfg.system_prompt, self.target.chat))
                                         for p in self.stream_prompts), self.bench)

    def _reserve_cache(self) -> None:
        """The compiled engine's static cache sized once for the longest conversation of the stream (its turns
        and an answer of --max-new-tokens to each), so it does not grow, rebuilding its graphs, mid-run."""
        if self.cfg.engine != "compiled" or self.target.tokenizer is None or not self.stream_prompts:
            return
        longest = max(len(render_chat(self.target.tokenizer, [{"role": "user", "content": "\n".join(p.turns)}],
                                      self.cfg.system_prompt, self.target.chat))
                      + len(p.turns) * self.cfg.max_new_tokens for p in self.stream_prompts)
        self.target.reserve(longest + TREE_SLACK)

    def _run_side(self, label: str, drafter: Drafter, query: Query) -> None:
        prompt = query.prompt

        turn = 0

        def admit(ids: list[int]) -> bool:
            if self._fits(ids, prompt):
                return True
            self._skip(prompt.id)
            if self.world.active:  # the merge must tell a skipped query from a missing one
                self.store.skip(label, self.bench, prompt.id, turn, query.index)
            return False

        def config_for(k: int) -> GenerationConfig:
            return GenerationConfig(self.cfg.max_new_tokens, self.sampling, record_seed(self.cfg.seed, prompt.id, k),
                                    keep_logits=self.forced and label == BASELINE)

        def finished(k: int) -> GenerationRecord | None:
            nonlocal turn
            turn = k  # generate_turns asks before it renders (and admits) turn k
            return self.store.done.get((label, self.bench, prompt.id, k))

        turns = generate_turns(self.target, drafter, prompt.turns, config_for, self.cfg.system_prompt, label,
                               finished=finished, admit=admit, repeats=self.cfg.repeats)
        for record in _naming_prompt(turns, prompt.id):
            record.bench, record.prompt_id, record.query_index = self.bench, prompt.id, query.index
            record.config_hash = self.store.meta["config_hash"]
            record.load_avg = machine_load.load_average()
            self._store(label, record)

    def _run_side_batched(self, label: str, drafter: Drafter, queries: list[Query], size: int) -> None:
        """Every turn of ``queries`` for one side, decoded ``size`` at a time; each record is stored (in the
        current B's file, ``_at``) as soon as its turn finishes."""
        cfg = self.cfg

        def admit(c: int, ids: list[int]) -> bool:
            if self._fits(ids, queries[c].prompt):
                return True
            self._skip(queries[c].prompt.id)
            return False

        def config_for(c: int, k: int) -> GenerationConfig:
            return GenerationConfig(cfg.max_new_tokens, self.sampling, record_seed(cfg.seed, queries[c].prompt.id, k))

        def finished(c: int, k: int) -> GenerationRecord | None:
            return self.store.done.get((label, self.bench, queries[c].prompt.id, k))

        turns = generate_conversations(self.target, drafter, [q.prompt.turns for q in queries], config_for,
                                       BatchConfig(size, cfg.continuous), cfg.system_prompt, label,
                                       finished=finished, admit=admit, groups=self.groups[label])
        for c, record in turns:
            query = queries[c]
            record.bench, record.prompt_id, record.query_index = self.bench, query.prompt.id, query.index
            record.config_hash = self.store.meta["config_hash"]
            record.load_avg = machine_load.load_average()
            self._store(label, record)

    # ---- divergence from vanilla ----------------------------------------------------------------
    def _store(self, label: str, record: GenerationRecord) -> None:
        """Append a finished turn; at T = 0 a method turn first gets its divergence from vanilla's turn
        (held until vanilla's has run), and vanilla's turn releases the method turns that wait for it."""
        if not self.explain:
            self.store.append(record)
            return
        twin = (record.bench, record.prompt_id, record.turn)
        if label == BASELINE:
            self.store.append(record)
            if self.forced:
                self.with_rows.append(record)
            for key in [k for k in self.held if k[1:] == twin]:
                self._explain_and_append(self.held.pop(key), record)
        elif (base := self.store.done.get((BASELINE, *twin))) is not None:
            self._explain_and_append(record, base)
        else:
            self.held[(label, *twin)] = record

    def _explain_and_append(self, record: GenerationRecord, base: GenerationRecord | None) -> None:
        earlier = self.store.done.get((record.method, record.bench, record.prompt_id, record.turn - 1))
        if base is None:
            pass  # vanilla did not run this turn (e.g. its own earlier answers made the prompt too long)
        elif earlier is not None and earlier.divergence and (earlier.divergence.get("status") != divergence.IDENTICAL
                                                            or "after_turn" in earlier.divergence):
            first = earlier.divergence.get("after_turn", earlier.turn)
            record.divergence = divergence.inherited(earlier.divergence, first)
        else:
            record.divergence = divergence.classify(record.new_tokens, base.new_tokens,
                                                    getattr(record, "top_logits", None),
                                                    getattr(base, "top_logits", None), self.target.dtype,
                                                    divergence.layers_of(self.target.model))
            prompt_ids = getattr(record, "prompt_ids", None)  # kept in memory by generate
            if self.rescorer is not None and prompt_ids is not None and divergence.rescorable(record.divergence):
                record.divergence = self.rescorer.judge(record.divergence, prompt_ids, record)
        if self.forced and base is not None:  # untimed: after the turn's clock has stopped
            record.forced = forced_check(self.target, dict(self.sides)[record.method], base,
                                         GenerationConfig(self.cfg.max_new_tokens, self.sampling, record.seed))
        self.store.append(record)

    def _release_held(self) -> None:
        """After a query: method turns whose vanilla twin never ran are written without a divergence, and
        vanilla's logit rows (--check forced) are let go."""
        for key in list(self.held):
            self._explain_and_append(self.held.pop(key), None)
        for record in self.with_rows:  # every side of the query has run: vanilla's rows are done with
            record.logit_rows = None
        self.with_rows.clear()

    def _warmup(self) -> None:
        """One short generation per side, discarded: first calls pay for allocation and kernels."""
        ids = render_chat(self.target.tokenizer, [{"role": "user", "content": self.prompts[0].turns[0]}],
                          self.cfg.system_prompt, self.target.chat)
        if len(ids) + 16 + TREE_SLACK > self.target.max_context:
            return
        for _, drafter in self.sides:
            if drafter.learns:
                continue  # a warm-up query would already change what the drafter has learnt
            if self.cfg.loop == "batched":  # a full batch at every B: the batched shapes are the ones timed
                for size in self.batch_sizes:
                    queue = deque(BatchRequest(i, ids, GenerationConfig(16, self.sampling, i)) for i in range(size))
                    for _ in generate_batch(self.target, drafter, queue, BatchConfig(size)):
                        pass
                continue
            generate(self.target, drafter, ids, GenerationConfig(16, self.sampling, 0))

    def _run_queries(self, progress: Progress, task) -> None:
        for query in self.queries:
            # Alternate which side goes first so slow drift does not favour any.
            order = self.sides if query.index % 2 == 0 else self.sides[::-1]
            for label, drafter in order:
                self._run_side(label, drafter, query)
            self._release_held()
            progress.advance(task)

    def _run_chunks(self, progress: Progress, task) -> None:
        """The batched loop: the stream is cut into chunks of the largest B (4x with ``--continuous``), and each
        chunk is decoded at every B in turn (ascending, then descending on the next chunk). At a B the chunk is
        cut again into the batches that B decodes (B queries, 4B when continuous), and every side decodes one
        batch before any side starts the next, which side goes first alternating per batch as it does per
        query at batch 1: a method's ratio over vanilla at a B is measured side by side, so the machine's
        drift over minutes reaches every side alike and spreads over the Bs."""
        per = CONTINUOUS_CHUNK if self.cfg.continuous else 1
        turn = 0  # batches decoded so far: which side goes first
        for n, chunk in enumerate(_chunks(self.queries, max(self.batch_sizes) * per)):
            for b in self.batch_sizes if n % 2 == 0 else self.batch_sizes[::-1]:
                self._at(b)
                for batch in _chunks(chunk, b * per):
                    for label, drafter in self.sides if turn % 2 == 0 else self.sides[::-1]:
                        self._run_side_batched(label, drafter, batch, b)
                    self._release_held()
                    turn += 1
            progress.advance(task, len(chunk))

    def run(self) -> list[GenerationRecord]:
        columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
        try:  # whatever ends the run, the store closes (a file without a record is not left behind)
            self._check_a_prompt_fits()
            self._reserve_cache()
            if self.cfg.warmup and self.prompts:
                self._warmup()
            # Under torchrun only rank 0 draws its bar (its share of the queries).
            with Progress(*columns, console=self.console, transient=False, disable=not self.world.main) as progress:
                names = ", ".join(label for label, _ in self.sides if label != BASELINE)
                share = f" (rank 0 of {self.world.size})" if self.world.active else ""
                task = progress.add_task(f"{names} on {self.bench}{share}", total=len(self.queries))
                if self.cfg.loop == "batched":
                    self._run_chunks(progress, task)
                else:
                    self._run_queries(progress, task)
            for store in self.stores.values():
                store.finish()
        finally:  # on a stop, the CLI's last line says what the store kept (interrupt.kept)
            for store in self.stores.values():
                store.close()
        if self.world.active:
            distributed.barrier()  # every part is complete
            return self._merge_parts() if self.world.main else []
        return [record for store in self.stores.values() for record in store.done.values()]


def _chunks(queries: list[Query], size: int) -> list[list[Query]]:
    return [queries[i: i + size] for i in range(0, len(queries), size)]


def _naming_prompt(records, prompt_id: str):
    """Re-raise a repeat mismatch with the prompt it happened on."""
    try:
        yield from records
    except SpecbenchError as exc:
        raise SpecbenchError(f"prompt {prompt_id}: {exc}") from None


def summary_table(records: list[GenerationRecord], temperature: float) -> Table:
    """τ, tokens/s, speedups, T_D% and greedy match per bench and method."""
    table = Table(title="specbench summary", show_lines=False)
    sizes = sorted({r.batch["size"] if r.batch else 1 for r in records})
    swept = len(sizes) > 1  # a batch sweep: one row per method and B, each against vanilla at its B
    for col in ("bench", *("B",) * swept, "method", "turns", "τ", "tok/s", "speedup", "decode-only", "T_D%",
                "greedy match", "same/near-tie/unexpl."):
        table.add_column(col, justify="left" if col in ("bench", "method") else "right")
    for bench, size in [(b, s) for b in sorted({r.bench for r in records}) for s in sizes]:
        rows = [r for r in records if r.bench == bench and (r.batch["size"] if r.batch else 1) == size]
        base = [r for r in rows if r.method == BASELINE]
        for method in sorted({r.method for r in rows}, key=lambda m: (m != BASELINE, m)):
            ours = [r for r in rows if r.method == method]
            has_base = bool(base) and method != BASELINE
            table.add_row(
                bench, *(str(size),) * swept, method, str(len(ours)), f"{metrics.tau(ours):.2f}", f"{metrics.tokens_per_second(ours):.1f}",
                f"{metrics.speedup(ours, base):.2f}×" if has_base else "—",
                f"{metrics.speedup(ours, base, decode_only=True):.2f}×" if has_base else "—",
                f"{100 * metrics.draft_share(ours):.0f}%",
                f"{100 * metrics.greedy_match_rate(ours, base):.0f}%" if has_base and temperature == 0 else "—",
                divergence.summary(r.divergence for r in ours) if any(r.divergence for r in ours) else "—",
            )
    return table
