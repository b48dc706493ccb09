"""GenerationRecord: one per prompt turn; every table and figure is computed from these."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

DECODE_PHASES = ("draft", "compile", "verify", "commit")  # top level; compile is bookkeeping, not drafting


@dataclass
class GenerationRecord:
    method: str
    new_tokens: list[int]
    prompt_tokens: int
    stop_reason: str  # "eos" | "length"
    times: dict[str, float]  # seconds per phase: prefill, draft, compile, verify, commit (+ tree_build, adapt inside draft)
    n_verify: int  # verify calls in the decode phase (prefill's token is not one)
    # accepted draft nodes per verify call, bonus excluded, counted within the turn's cut (EOS, --max-new-tokens):
    # the last call's tokens past the cut were verified but are not in the text (loop.kept_in_turn)
    accept_lengths: list[int]
    tree_sizes: list[int]  # drafted nodes per verify call
    depth_attempts: list[int]  # [k-1]: calls where depth k was reachable (parent accepted, has a child)
    depth_accepts: list[int]  # [k-1]: calls that accepted depth k
    forwards: dict[str, int] = field(default_factory=dict)  # decode-phase model forwards per owner
    forward_times: dict[str, float] = field(default_factory=dict)  # their seconds per owner
    temperature: float = 0.0
    seed: int | None = None
    bench: str = ""
    prompt_id: str = ""
    turn: int = 0
    query_index: int = -1  # position in the run's query stream (learning drafters see queries in this order)
    config_hash: str = ""
    extra: dict = field(default_factory=dict)  # drafter-specific statistics
    times_repeats: list[dict[str, float]] = field(default_factory=list)  # --repeats: every repeat's `times`; `times` = the median one
    load_avg: list[float] | None = None  # the machine's load average (1, 5, 15 min) when this turn finished
    divergence: dict | None = None  # T = 0 method turns: identical / near-tie / unexplained vs vanilla (divergence.py)
    chain_calls: int = -1  # verify calls whose draft was a chain (causal kernel; the rest were masked trees); -1: not recorded
    forced: dict | None = None  # --check forced: this turn's verify rows against vanilla's, and the A/A side's (agreement.py)
    # --batch-size > 1 (engine/batch_loop.py): size, continuous, group, start/end on the batch clock (s),
    # active_mean (requests per step it shared), batched_drafting; None: decoded alone (batch 1)
    batch: dict | None = None
    # seconds taken out of every phase (PhaseTimer.paused), by reason: graph_compile, the compiled engine
    # building a graph the first time a row count appears; empty (and not written) when nothing was
    outside_clock: dict[str, float] = field(default_factory=dict)

    @property
    def num_new(self) -> int:
        return len(self.new_tokens)

    @property
    def decode_time(self) -> float:
        return sum(self.times.get(p, 0.0) for p in DECODE_PHASES)

    @property
    def total_time(self) -> float:
        return self.total_of(self.times)

    @staticmethod
    def total_of(times: dict[str, float]) -> float:
        """Prefill + decode seconds of one phase-times dict."""
        return times.get("prefill", 0.0) + sum(times.get(p, 0.0) for p in DECODE_PHASES)

    @property
    def committed(self) -> int:
        """Tokens committed by verify calls (accepted + bonus) that the turn keeps: ``num_new - 1`` for a
        record written since accept lengths stop at the cut (the first token comes from the prefill)."""
        return sum(self.accept_lengths) + len(self.accept_lengths)

    def to_dict(self) -> dict:
        data = asdict(self)
        if data["batch"] is None:  # batch-1 lines stay as they were before batching existed
            del data["batch"]
        if not data["outside_clock"]:  # eager-engine lines likewise
            del data["outside_clock"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "GenerationRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
