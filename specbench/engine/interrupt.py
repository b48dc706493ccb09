"""Graceful stop on Ctrl-C / SIGTERM: the handler only sets a flag; the decode loop and the trainer
check it at step boundaries and raise ``Interrupted``, so the step in flight finishes, finished
records and checkpoints are kept, and the CLI exits 128 + signal (130 for SIGINT, 143 for SIGTERM)."""

from __future__ import annotations

import shlex
import signal
import sys
from contextlib import contextmanager
from typing import Iterator

_received: int | None = None


class Interrupted(Exception):
    """Raised at a step boundary after SIGINT/SIGTERM; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _handler(signum, frame) -> None:
    global _received
    if _received is not None and signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C: stop now
    _received = signum


def requested() -> bool:
    return _received is not None


def check() -> None:
    """Call between steps: raises ``Interrupted`` once a stop was requested."""
    if _received is not None:
        raise Interrupted(_received)


@contextmanager
def graceful() -> Iterator[None]:
    """SIGINT and SIGTERM set the flag while inside; the previous handlers come back after."""
    global _received
    _received = None
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for s in previous:
            signal.signal(s, _handler)
    except ValueError:  # not the main thread: leave the default handlers alone
        previous = {}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _received = None


def resume_command(argv: list[str] | None = None, flag: str = "--resume") -> str:
    """The command that was run, with ``flag`` added when it is not already there (empty: unchanged)."""
    args = list(sys.argv if argv is None else argv)
    args[0] = "specbench"
    if flag and flag not in args:
        args.append(flag)
    return shlex.join(args)
