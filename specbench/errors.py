"""User-facing errors: raised at the edges (loaders, CLI), printed as one line, exit code 2."""

import difflib


class SpecbenchError(Exception):
    """A problem the user can fix; the message says what to do."""


def installed_version(dist: str, missing: str) -> str:
    """The installed version of distribution ``dist``; ``missing`` (one line saying what to install) if it is
    absent, or present without its metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        raise SpecbenchError(missing) from None


def unknown_name_error(kind: str, name: str, known: list[str], how_to_list: str) -> SpecbenchError:
    """'unknown bench 'humanevl'; did you mean 'humaneval'? see `specbench list benches` ...'"""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return SpecbenchError(f"unknown {kind} {name!r}; {hint}see `{how_to_list}` (known: {', '.join(known)})")
