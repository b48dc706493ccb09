"""Graceful stop on Ctrl-C / SIGTERM: the handler only sets a flag; the decode loop and the trainer
check it at step boundaries and raise ``Interrupted``, so the step in flight finishes, finished
records and checkpoints are kept, and the CLI exits 128 + signal (130 for SIGINT, 143 for SIGTERM).

A step that does not reach a boundary soon (a forward of minutes, a model load) is not waited for:
with ``escalate_after`` the stop is raised where the program is once that many seconds have passed,
during a model load (``abortable``) at once, and on a second signal at once. Only ``critical``
sections (appending a record, renaming a file into place) hold it back until they are done.

A stop is never lost to timing: the program notes one that arrives while it still imports its command line
(``note_early``) and honours it once the command handles signals; and a stop that cuts an import or a load
ends as a stop even when a library turns it into an error of its own on the way out (``received``)."""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

ESCALATE_S = 3.0  # a run waits this long after a signal for its step in flight, then stops it where it is

_received: int | None = None
_escalate_after: float | None = None
_timer: threading.Timer | None = None
_critical = 0  # depth of critical sections
_pending: int | None = None  # a stop held back by a critical section
_abortable = 0  # depth of abortable sections (model loads)
_settled = False  # the stop was raised (or the CLI is reporting): later signals change nothing
_kept: Callable[[], str] | None = None
_early: int | None = None  # a signal that arrived while the program was still importing (``note_early``)


class Interrupted(BaseException):
    """Raised after SIGINT/SIGTERM; ``exit_code`` is 128 + the signal number. A BaseException, so a
    library's ``except Exception`` around a load or a forward does not turn a stop into an error."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _stop_now(signum: int) -> None:
    global _pending, _settled
    if _settled:
        return
    if _critical:
        _pending = signum  # raised when the critical section ends
        return
    _settled = True
    _cancel_timer()
    raise Interrupted(signum)


def _escalate(signum: int) -> None:
    """Timer thread: deliver the signal again to the main thread, whose handler then stops at once."""
    try:
        signal.pthread_kill(threading.main_thread().ident, signum)
    except (OSError, ValueError):
        pass


def _cancel_timer() -> None:
    global _timer
    if _timer is not None:
        _timer.cancel()
        _timer = None


def _handler(signum, frame) -> None:
    global _received, _timer
    if _settled:
        return
    if _received is None:
        _received = signum
        if _abortable:
            _stop_now(signum)  # a model load keeps nothing: stop it
        elif _escalate_after is not None:
            _timer = threading.Timer(_escalate_after, _escalate, (signum,))
            _timer.daemon = True
            _timer.start()
        return
    _stop_now(_received)  # a second signal, or the step took longer than escalate_after


def requested() -> bool:
    return _received is not None


def received() -> int | None:
    """The signal of the stop requested, if any."""
    return _received


def _note_early(signum, frame) -> None:
    global _early
    if _early is None:
        _early = signum


def _default(signum: int):
    return signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL


def note_early() -> None:
    """From the program's first import on (before torch, typer and the rest load): a Ctrl-C / SIGTERM is noted,
    not acted on, so it cannot end the process with no line or a traceback from the import it cut; ``graceful``
    takes it over, other commands get it back through ``stop_noting``."""
    try:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, _note_early)
    except ValueError:  # not the main thread
        pass


def stop_noting() -> None:
    """For a command that stops at once (not under ``graceful``): the default handlers come back and a signal
    noted during the imports is delivered now."""
    global _early
    for s in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(s) is _note_early:
            signal.signal(s, _default(s))
    signum, _early = _early, None
    if signum is not None:
        signal.raise_signal(signum)


def check() -> None:
    """Call between steps: raises ``Interrupted`` once a stop was requested."""
    if _received is not None and not _settled:
        _stop_now(_received)


@contextmanager
def critical() -> Iterator[None]:
    """A stop that arrives inside waits until the block is done (a record is written whole)."""
    global _critical, _pending
    _critical += 1
    try:
        yield
    finally:
        _critical -= 1
        if not _critical and _pending is not None:
            signum, _pending = _pending, None
            _stop_now(signum)


@contextmanager
def abortable() -> Iterator[None]:
    """Inside (a model load: nothing to keep), a signal stops at once instead of at the next step."""
    global _abortable
    check()
    _abortable += 1
    try:
        yield
    finally:
        _abortable -= 1


def note_kept(describe: Callable[[], str] | None) -> None:
    """Register what a stop now would keep ('r.jsonl (3 records)'), for the CLI's last line."""
    global _kept
    _kept = describe


def kept() -> str | None:
    try:
        return _kept() if _kept is not None else None
    except Exception:  # noqa: BLE001 - the last line must print whatever state the run is in
        return None


def settle() -> None:
    """The CLI is reporting how the command ended: further signals change nothing."""
    global _settled
    _settled = True
    _cancel_timer()


_exiting = False  # the process ends with this stop: signals stay ignored after ``graceful``


def exiting() -> None:
    """The program ends on this stop: a later Ctrl-C must not interrupt its exit (atexit hooks, flushes)."""
    global _exiting
    _exiting = True
    settle()


def _reset() -> None:
    global _received, _pending, _settled, _kept
    _cancel_timer()
    _received, _pending, _settled, _kept = None, None, False, None


@contextmanager
def graceful(escalate_after: float | None = None) -> Iterator[None]:
    """SIGINT and SIGTERM set the flag while inside; the previous handlers come back after. With
    ``escalate_after`` (seconds), a step that has not reached its boundary by then is stopped where it is."""
    global _escalate_after, _received, _early
    _reset()
    _escalate_after = escalate_after
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    previous = {s: _default(s) if h is _note_early else h for s, h in previous.items()}
    try:
        for s in previous:
            signal.signal(s, _handler)
    except ValueError:  # not the main thread: leave the default handlers alone
        previous = {}
    if _early is not None:  # noted while the program imported: the first check() stops
        _received, _early = _early, None
    try:
        yield
    finally:
        global _exiting
        for s, h in previous.items():
            signal.signal(s, signal.SIG_IGN if _exiting else h)
        _escalate_after, _exiting = None, False
        _reset()


def resume_command(argv: list[str] | None = None, flag: str = "--resume") -> str:
    """The command that was run, with ``flag`` added when it is not already there (empty: unchanged). ``--resume``
    continues the file: the flags that would replace it or say not to resume (``--overwrite``, which cannot be
    given with it, and ``--no-resume``) are dropped."""
    args = list(sys.argv if argv is None else argv)
    args[0] = "specbench"
    if flag == "--resume":
        args = [arg for arg in args if arg not in ("--overwrite", "--no-resume")]
    if flag and flag not in args:
        args.append(flag)
    return shlex.join(args)
