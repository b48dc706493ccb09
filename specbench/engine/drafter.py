"""The Drafter protocol: the five hooks the decode loop calls, and what it hands them.

A method is a ``Drafter`` subclass registered under the entry-point group ``specbench.methods``
(``specbench.engine.registry``); adding a method touches no core file. Its ``Options`` are a declaration
(``specbench.options``) that validates ``--opt key=value`` values, fills the results header and
gives `specbench list methods NAME` its text. Where it trains, the class names its trainer
(``Drafter.trainer``), and `specbench train` gets a command for it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import torch

from specbench.errors import SpecbenchError
from specbench.options import NoOptions, validate
from specbench.engine.timing import NullTimer, PhaseTimer
from specbench.engine.tree import DraftTree
from specbench.engine.verify import SamplingParams

if TYPE_CHECKING:
    from specbench.engine.target import Target, TargetOutput


@dataclass
class DecodeState:
    """What a drafter may read during one generation. ``tokens`` are all committed ids
    (prompt + generated); the last one is the bonus token, which the target has not cached."""

    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None = None
    timer: PhaseTimer = field(default_factory=NullTimer)

    @property
    def bonus(self) -> int:
        return self.tokens[-1]


@dataclass
class VerifyResult:
    """What the verifier tells the drafter after each call."""

    tree: DraftTree
    accepted: list[int]  # node indices of the accepted path, in depth order
    committed: list[int]  # tokens appended this call: accepted tokens then the bonus
    bonus: int
    logits: torch.Tensor  # target logits of every verify row [root, nodes...]
    taps: dict[int, torch.Tensor]  # requested taps of the kept rows [root, accepted...]
    stop_row: int  # verify row whose distribution produced the bonus (the rejection point)


class Drafter:
    """Base class: override what your method needs.

    setup(target)                once per run, after options are parsed
    begin(state, prefill)        once per prompt turn, after the target's prefill
    propose(state) -> DraftTree  each decode iteration (timed as drafting)
    observe(state, result)       after each verify (timed as drafting)
    end(state)                   after the turn

    Batched decoding (``engine/batch_loop.py``) calls the ``*_batch`` forms of the same hooks instead.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    taps: tuple[int, ...] = ()  # hidden_states indices of the target this drafter reads
    learns: ClassVar[bool] = False  # True if the drafter updates itself while serving (no warm-up, stream order matters)
    # A learner whose memory concurrent requests share by design (suffix decoding's global tree, as a
    # server runs it) may share a batch; any other learner's updates follow one request after another,
    # which a batch interleaves, so it is refused a batch (``batch_loop.check_batchable``).
    batch_learning: ClassVar[bool] = False
    # Options that name weights: a local folder/file or a hub id ``org/name[@rev]``; a ``revision``
    # option, where the method has one, applies to the first.
    weight_options: ClassVar[tuple[str, ...]] = ()
    # How `specbench train` trains this method's weights: a ``training.plugin.MethodTrainer`` subclass
    # or a "module:Class" reference to one (imported only when the train commands are built); None =
    # nothing to train. Subclasses (variants) inherit it and share its command.
    trainer: ClassVar[Any] = None

    # How reports name and group the method (a subclass inherits these, so each registered class sets
    # its own): ``label`` its display name, ``family`` its method family ("" = the registered name for
    # both), ``ablation_of`` the registered name of the method it ablates (None: a method in its own right).
    label: ClassVar[str] = ""
    family: ClassVar[str] = ""
    ablation_of: ClassVar[str | None] = None

    # The option that caps the drafted nodes one verify call checks (`specbench run --budget B` sets it
    # on every side that has one, so methods are compared at one node budget); ``budget_counts_root``:
    # the option counts verify rows, the root included (B + 1). None: the method has no such knob.
    budget_option: ClassVar[str | None] = None
    budget_counts_root: ClassVar[bool] = False

    @classmethod
    def budget_options(cls, budget: int) -> dict[str, int]:
        """The options that give this method a budget of ``budget`` drafted nodes per verify ({}: none), as
        typed values (``--budget`` is parsed once, by the run's declaration)."""
        if cls.budget_option is None:
            return {}
        return {cls.budget_option: budget + 1 if cls.budget_counts_root else budget}

    @classmethod
    def report_names(cls) -> dict:
        """The header's ``methods`` entry for a side of this method: registered name, label, family, ablation_of,
        and the node-budget option (the report reads a budget sweep's budgets from it)."""
        return {"method": cls.name, "label": cls.label or cls.name, "family": cls.family or cls.name,
                "ablation_of": cls.ablation_of, "budget_option": cls.budget_option}

    def __init__(self, options: Any = None) -> None:
        # Options built in code are held to the same declaration as --opt values.
        self.options = validate(options if options is not None else self.Options(), self.name or type(self).__name__)
        self.sources: dict[str, Any] = {}  # weight option -> hub.Resolved (files and commit), for the header

    @classmethod
    def check_references(cls, options: Any) -> None:
        """Validate the weight references in ``options`` without loading or downloading anything."""
        from specbench.engine import hub

        revision = getattr(options, "revision", "") or None
        first = cls.weight_options[0] if cls.weight_options else None
        if revision and not (first and getattr(options, first, "")):
            raise SpecbenchError(f"{cls.name}: revision={revision} needs {first or 'a weights option'}=ORG/NAME")
        for name in cls.weight_options:
            spec = getattr(options, name, "")
            if spec and not cls.builtin_reference(spec):
                hub.check_reference(spec, revision if name == first else None, f"{cls.name} {name}")

    @classmethod
    def builtin_reference(cls, spec: str) -> bool:
        """A weights value that is neither a path nor a hub id (e.g. SpS's ``truncated:N``)."""
        return False

    def resolve_weights(self, name: str, default: str | Path | None = None, missing: str = "") -> Path:
        """Option ``name`` as a local path: a hub id is downloaded (or found in the HF cache); when
        the option is empty, the ``default`` folder. ``missing`` (with ``{path}``) is the error for a
        folder that does not exist. Where the weights came from is kept in ``sources`` for the header."""
        from specbench.engine import hub

        spec = str(getattr(self.options, name, "") or "")
        local = not spec or not hub.looks_like_hub_id(hub.split_reference(spec)[0])
        path = Path(spec or default or "").expanduser()
        if local and not (spec or default) or local and not path.exists() and not hub.is_local(spec):
            raise SpecbenchError((missing or f"{self.name}: {{path}} does not exist; pass --opt {name}=FOLDER_OR_HUB_ID")
                                 .format(path=spec or default))
        if not spec:
            self.sources[name] = hub.Resolved(str(path), path)
            return path
        first = self.weight_options[0] if self.weight_options else name
        revision = (getattr(self.options, "revision", "") or None) if name == first else None
        resolved = hub.resolve(spec, revision, f"{self.name} {name}")
        self.sources[name] = resolved
        return resolved.path

    def setup(self, target: "Target") -> None:
        self.target = target

    def begin(self, state: DecodeState, prefill: "TargetOutput") -> None:
        pass

    def propose(self, state: DecodeState) -> DraftTree:
        raise NotImplementedError

    def observe(self, state: DecodeState, result: VerifyResult) -> None:
        pass

    def end(self, state: DecodeState) -> dict:
        """Return drafter-specific statistics to store in the record's ``extra``."""
        return {}

    # ---- batches ------------------------------------------------------------------------------
    # The batched loop keeps its requests as rows: ``begin_batch`` appends the requests that join after
    # the current rows, ``end_batch`` removes the rows of those that leave (the others keep their
    # order), and ``propose_batch`` / ``observe_batch`` see every active request in row order; every
    # state carries the batch's one clock. The defaults run the batch-1 hooks on one ``fork`` of this
    # drafter per request: right for every method, one drafter call per request per step. A method that
    # drafts the whole batch in one forward per step overrides all four and sets ``batched_drafting``.
    batched_drafting: bool = False

    def batch_refusal(self) -> str | None:
        """Why this drafter cannot share a batch, in words that follow its name (None: it can); the run
        refuses ``--batch-size`` > 1 with it before any model loads."""
        if self.learns and not self.batch_learning:
            return ("learns while serving: each update follows one request after another in the stream, which a "
                    "batch interleaves; run it with --batch-size 1")
        return None

    def fork(self) -> "Drafter":
        """A drafter for one request of a batch: shares this one's weights and setup, and gets its own
        per-request state from ``begin`` (which rebinds, never mutates, what it keeps per turn)."""
        twin = copy.copy(self)
        twin.__dict__.pop("_batch_forks", None)
        return twin

    def begin_batch(self, states: Sequence[DecodeState], prefills: Sequence["TargetOutput"]) -> None:
        forks = self.__dict__.setdefault("_batch_forks", [])
        for state, prefill in zip(states, prefills):
            forks.append(self.fork())
            forks[-1].begin(state, prefill)

    def propose_batch(self, states: Sequence[DecodeState]) -> list[DraftTree]:
        return [fork.propose(state) for fork, state in zip(self._batch_forks, states, strict=True)]

    def observe_batch(self, states: Sequence[DecodeState], results: Sequence[VerifyResult]) -> None:
        for fork, state, result in zip(self._batch_forks, states, results, strict=True):
            fork.observe(state, result)

    def end_batch(self, rows: Sequence[int], states: Sequence[DecodeState]) -> list[dict]:
        """The ``end`` statistics of the requests leaving from ``rows`` (their states, same order)."""
        forks = self._batch_forks
        stats = [forks[row].end(state) or {} for row, state in zip(rows, states)]
        self._batch_forks = [fork for b, fork in enumerate(forks) if b not in set(rows)]
        return stats
