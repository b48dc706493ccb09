"""DDTree against its authors' own loop: ``ddtree_generate`` (ddtree.py) of github.com/liranringel/ddtree
(MIT), with their own copy of the DFlash draft model (model/dflash.py), imported at run time from a
snapshot of the repository (``--reference-src`` or ``$SPECBENCH_REF_DDTREE``; nothing of it is copied).

Our drafter's weights go into their draft model class the way z-lab's take them (their copy has z-lab's
layout and config: ``zlab_config`` / ``zlab_draft_model`` in methods/parity/dflash.py); our reduced draft
vocabulary reaches their loop as the target's lm_head restricted to those rows (``DraftVocabularyHead``,
-inf elsewhere: the same top-k and the same log-normaliser). Both sides get the same options: the node
budget B (their ``tree_budget``), the drafter's block size, mask id and weights, greedy, the target's EOS
ids as their ``stop_token_ids``.

Their loop runs unchanged. Three shims bridge this environment: the first two replace globals of their
ddtree module for the call only (``authors_shims``), the third is the target their loop is handed:
* ``LegacyCropCache``: their loop calls ``DynamicCache.crop(n)`` to keep the first n positions (the draft
  cache after each block, the target cache after compaction); transformers 5 refuses a positive n (crop
  now takes minus the number of positions to remove).
* ``RecordingClock``: their clock ``cuda_time`` synchronizes CUDA before ``perf_counter``; a CPU build of
  torch has no CUDA to synchronize, so there it is ``perf_counter`` alone. It also keeps every reading,
  from which the decode time is taken over the interval ours covers (see ``decode_seconds``).
* ``AuthorsTargetView`` (reduced-vocabulary drafters only): their loop scores its draft with
  ``target.lm_head`` and verifies with ``target(...)``, one model for both; the view gives the draft the
  draft-vocabulary rows while the verify keeps the target's own head, and passes on what else their loop
  reads (``.model.embed_tokens``, ``.dtype``). A full-vocabulary drafter gets the target's model itself.

Their C++ compaction of the target cache (``maybe_enable_cpp_compact``, on by default in their
benchmark.py) builds an inline torch extension that narrows, index-selects and copies the appended window
in place; it has no CUDA code, so on a CPU it builds (with a C++ compiler and ninja) and does the same
tensor operations as their Python fallback with less interpreter overhead. The adapter turns it on as
their benchmark does; where it cannot build, their code logs a warning and falls back to Python, and the
reference string says which one ran.

Their output is read as ours is recorded: the new tokens (``new_tokens``), their acceptance lengths minus
the root they count, only the rounds whose tokens are kept (``kept_steps``), and the decode time over our
interval (``decode_seconds``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Sequence

import torch
from torch import nn

from methods.parity.dflash import DraftVocabularyHead, zlab_draft_model
from specbench.errors import SpecbenchError
from specbench.run.parity import ReferenceOutput
from specbench.run.snapshots import Repository, Snapshot, import_snapshot, locate_snapshot

REPOSITORY = Repository(url="https://github.com/liranringel/ddtree", licence="MIT", env="SPECBENCH_REF_DDTREE",
                        marker="ddtree.py")
TOPS = ("ddtree", "dflash", "model", "distributed")  # their top-level modules (z-lab's package is `dflash` too)
WHO = "the DDTree authors' DFlashDraftModel"
PARITY_BUDGET = 32  # our default node budget, pinned for both sides (the paper sweeps 16..1024)


# ---- shims ------------------------------------------------------------------------------------
def legacy_crop_cache_class():
    """A ``DynamicCache`` whose ``crop(n)`` keeps the first n positions, as their loop expects.

    transformers < 5 read a non-negative ``crop`` argument as the length to keep; transformers 5 raises
    on it and reads a negative one as the number of positions to remove. ``crop(-k)`` means the same in
    both, so this works under either."""
    from transformers import DynamicCache

    class LegacyCropCache(DynamicCache):
        def crop(self, max_length: int) -> None:
            if max_length < 0:  # already the new convention
                return super().crop(max_length)
            remove = self.get_seq_length() - max_length
            if remove > 0:
                super().crop(-remove)

    return LegacyCropCache


class RecordingClock:
    """Their ``cuda_time`` (synchronize + perf_counter) on CUDA, ``perf_counter`` alone on a CPU (a CPU
    build of torch refuses ``torch.cuda.synchronize``); every reading is kept, in call order."""

    def __init__(self, device: torch.device, theirs) -> None:
        self.base = theirs if device.type == "cuda" else time.perf_counter
        self.readings: list[float] = []

    def __call__(self) -> float:
        now = self.base()
        self.readings.append(now)
        return now


class AuthorsTargetView:
    """The target as their loop reads it, with another ``lm_head`` for the draft logits: calling it runs the
    whole model with its own head (the verify); ``.model`` (``embed_tokens``: the block's embeddings) and
    ``.dtype`` (the tree mask) are the target's."""

    def __init__(self, causal_lm: nn.Module, head: nn.Module) -> None:
        self.causal_lm, self.model, self.lm_head = causal_lm, causal_lm.model, head
        self.dtype, self.device, self.config = causal_lm.dtype, causal_lm.device, causal_lm.config

    def __call__(self, *args, **kwargs):
        return self.causal_lm(*args, **kwargs)


def authors_target(target, ours):
    """The target as ``ddtree_generate`` should see it for drafter ``ours``; one line when the target lacks
    what their loop reads (``.model.embed_tokens``, ``.lm_head``: a Llama/Qwen-style ``*ForCausalLM``)."""
    causal_lm = target.model
    if not hasattr(getattr(causal_lm, "model", None), "embed_tokens") or not hasattr(causal_lm, "lm_head"):
        raise SpecbenchError(f"ddtree: the DDTree authors' loop reads target.model.embed_tokens and target.lm_head, "
                             f"which {type(causal_lm).__name__} ({target.name!r}) does not have")
    if not ours.config.draft_vocab_size:
        return causal_lm
    return AuthorsTargetView(causal_lm, DraftVocabularyHead(causal_lm.get_output_embeddings().weight, ours.vocab_ids))


def refuse_unheld(cfg, name: str) -> None:
    """Their copy of the draft model has none of the published dflash_config knobs (embedding scale,
    logit multiplier, soft-capping) and attends over the whole block in every layer (no causal or
    sliding layers): a drafter that uses any of them is refused in one line."""
    used = [k for k, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                                 ("final_logit_softcapping", 0.0)) if float(getattr(cfg, k, default)) != default]
    kinds = [cfg.layer_attention(i) for i in range(cfg.num_hidden_layers)] if hasattr(cfg, "layer_attention") else []
    if any(causal or window for causal, window in kinds):
        used.append("causal or sliding-window layers")
    if used:
        raise SpecbenchError(f"{name}: the DDTree authors' copy of the DFlash draft model cannot hold this drafter "
                             f"({', '.join(used)}); use a drafter without them")


@contextmanager
def authors_shims(ddtree, clock: RecordingClock, cache_class):
    """Their ddtree module's ``cuda_time`` and ``DynamicCache`` replaced for one call (module globals of
    their module only: nothing of ours, nothing on disk)."""
    saved = ddtree.cuda_time, ddtree.DynamicCache
    ddtree.cuda_time, ddtree.DynamicCache = clock, cache_class
    try:
        yield
    finally:
        ddtree.cuda_time, ddtree.DynamicCache = saved


def new_tokens(output_ids: list[int], prompt_ids: list[int], mask_token_id: int, eos: set[int],
               max_new_tokens: int) -> list[int]:
    """The generated tokens in their ``output_ids``. Their loop fills a buffer initialised with the mask id
    and returns it without every mask-id entry (the unused slots), the prompt's own mask ids included, yet
    slices the new tokens at the prompt's full length; the new tokens start after the prompt's count of
    non-mask tokens instead, cut at the first EOS (inclusive) and at the budget. (A mask-id token the
    target generates is lost in their filter: by design, it shows as a text difference.)"""
    start = sum(t != mask_token_id for t in prompt_ids)
    tokens = output_ids[start:]
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[: min(end, max_new_tokens)]


def kept_steps(acceptance_lengths: Sequence[int], kept_tokens: int) -> int:
    """How many of their verify rounds produced kept tokens. Round i commits ``acceptance_lengths[i]``
    tokens (its root, the previous bonus, and the accepted drafts) and a new bonus, so before it
    1 + sum(lengths[:i]) tokens exist; it counts when that is below the tokens kept. Their loop runs while
    the bonus's position is below the budget, so a round ending exactly at the budget is followed by one
    more whose tokens their own cut drops; ours stops there."""
    produced, steps = 1, 0
    for n in acceptance_lengths:
        if produced >= kept_tokens:
            break
        produced += n
        steps += 1
    return steps


def decode_seconds(readings: Sequence[float], time_to_first_token: float, round_timestamps: Sequence[float],
                   steps: int) -> float:
    """Their decode time over the interval ours covers: from the end of their prefill clock (reading 2:
    prefill forward, first token, context features) to the end of the last kept round (its commit), so
    the first draft forward, which their own ``decode_start`` leaves out, is in, and their post-loop
    output cut is out. Their round clock starts at reading 4 (after ``decode_start``, reading 3)."""
    if len(readings) < 4 or readings[1] - readings[0] != time_to_first_token:
        raise SpecbenchError("ddtree: this snapshot's ddtree_generate reads its clock in another order than "
                             "commit c96427a's (prefill start, prefill end, decode start, round clock start); "
                             "the adapter cannot take its decode time from it")
    if steps == 0:
        return 0.0
    return (readings[3] - readings[1]) + round_timestamps[steps - 1]


def notes_for(snapshot: Snapshot, compaction: str | None) -> str:
    """The table's paragraph: what runs, every shim, what differs by design, what each clock covers."""
    ran = {None: "", "C++": " It built and ran.",
           "Python": " It did not run (turned off, or it did not build): their Python fallback ran."}[compaction]
    return ("The DDTree authors' own loop, ddtree_generate of " + snapshot.describe() + ", with their copy of the "
            "DFlash draft model (model/dflash.py, z-lab's layout) holding our drafter's weights, imported at run "
            "time from a snapshot of the repository; both sides get the same node budget B (their tree_budget), "
            "block size, mask id and EOS ids (their stop_token_ids), greedy. Shims, each applied only for the "
            "call: a DynamicCache whose crop(n) keeps the first n positions, as their loop expects (transformers 5 "
            "refuses a positive crop and removes -n positions for a negative one); their clock cuda_time is "
            "perf_counter alone on a CPU (nothing to synchronize; a CPU build of torch refuses to), theirs "
            "(synchronize + perf_counter) on CUDA, its readings kept; our shipped drafter's reduced draft "
            "vocabulary reaches their loop as a target view whose lm_head, used only for their draft logits, "
            "scores those rows (-inf elsewhere: same top-k, same normaliser) while the verify keeps the target's "
            "own head. Their C++ compaction of the target cache (maybe_enable_cpp_compact, on by default in "
            "their benchmark, as here) is an inline torch extension with no CUDA code: on a CPU it does the same "
            "narrow/index_select/copy as their Python fallback." + ran + " By design their loop keeps the "
            "target's keys/values in a transformers DynamicCache compacted in place, takes log-probabilities as "
            "logits minus logsumexp (ours log_softmax: equal up to rounding) and breaks exact ties in its heap by "
            "rank tuple (ours by push order); it drops every mask-id token from its output (its buffer's unused "
            "slots), so a generated mask-id token is lost (the adapter reads the new tokens after the prompt's "
            "non-mask tokens); and when a round ends exactly at the token budget it runs one more verify whose "
            "tokens its own cut drops, which the adapter leaves out of the accept lengths and the time. Clocks: "
            "ours is the sum of the decode phases (every drafter forward, the tree build, compile, verify, "
            "commit), the prompt's prefill excluded; their own decode clock (time_per_output_token) starts "
            "after the first draft forward and ends after their output cut, so the adapter takes their clock's "
            "readings from the end of their prefill (prefill forward, first token, context features) to the end "
            "of the last kept round's commit: the same interval as ours, the first draft forward included.")


# ---- the adapter ------------------------------------------------------------------------------
class DDTreeAuthorsLoop:
    name = "ddtree"
    reference = "DDTree authors' ddtree_generate (github.com/liranringel/ddtree)"
    notes = ""  # set by load(): notes_for(the snapshot, the compaction that ran)

    repository = REPOSITORY
    source: str | None = None
    options = {"budget": PARITY_BUDGET}  # both sides, unless --opt budget= is given
    cpp_compact = True  # as their benchmark.py's default (--disable-cpp-compact-cache turns it off)

    def version(self) -> str:
        self.snapshot: Snapshot = locate_snapshot(self.repository, self.source)
        self.reference = f"DDTree authors' ddtree_generate, {self.snapshot.describe()}"
        self.notes = notes_for(self.snapshot, None)
        return self.snapshot.commit[:12]

    def load(self, target, drafter, options) -> None:
        if not hasattr(self, "snapshot"):
            self.version()
        ours = getattr(drafter, "model", None)
        cfg = getattr(ours, "config", None)
        if cfg is None or not hasattr(cfg, "block_size"):
            raise SpecbenchError(f"{drafter.name}: the DDTree authors' loop needs a DFlash drafter; this one "
                                 "holds none")
        refuse_unheld(cfg, drafter.name)
        modules = import_snapshot(self.snapshot, ["ddtree", "model"], tops=TOPS)
        self.ddtree = modules["ddtree"]
        self.model = zlab_draft_model(ours, drafter.name, modules["model"].DFlashDraftModel, WHO)
        self.view = authors_target(target, ours)
        self.target, self.budget = target, int(options.budget)
        if cfg.draft_vocab_size and self.budget > cfg.draft_vocab_size:
            # their top-k runs over the whole vocabulary: past the draft rows it would pick -inf entries
            raise SpecbenchError(f"{drafter.name}: budget {self.budget} exceeds the drafter's "
                                 f"{cfg.draft_vocab_size}-token draft vocabulary, which the authors' loop sees as "
                                 "the whole vocabulary with -inf elsewhere; use a budget up to its size")
        self.block_size, self.mask_token_id = int(self.model.block_size), int(self.model.mask_token_id)
        self.cache_class = legacy_crop_cache_class()
        self.ddtree.maybe_enable_cpp_compact(bool(self.cpp_compact))
        built = bool(self.cpp_compact) and self.ddtree.load_cpp_compact_module() is not None
        compaction = "C++" if built else "Python"
        self.reference = f"DDTree authors' ddtree_generate, {self.snapshot.describe()}; {compaction} cache compaction"
        self.notes = notes_for(self.snapshot, compaction)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> ReferenceOutput:
        device = self.target.device
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device).reshape(1, -1)
        clock = RecordingClock(device, self.ddtree.cuda_time)
        with authors_shims(self.ddtree, clock, self.cache_class):
            out = self.ddtree.ddtree_generate(
                model=self.model, target=self.view, input_ids=ids, mask_token_id=self.mask_token_id,
                max_new_tokens=max_new_tokens, block_size=self.block_size,
                stop_token_ids=sorted(self.target.eos_token_ids), temperature=0.0, tree_budget=self.budget)
        tokens = new_tokens(out.output_ids[0].tolist(), list(prompt_ids), self.mask_token_id,
                            self.target.eos_token_ids, max_new_tokens)
        steps = kept_steps(out.acceptance_lengths, len(tokens))
        seconds = decode_seconds(clock.readings, out.time_to_first_token, out.round_timestamps, steps)
        # their acceptance length counts the root (our previous bonus) with the accepted drafts
        return ReferenceOutput(tokens, [n - 1 for n in out.acceptance_lengths[:steps]], seconds)

