"""User-facing errors: raised at the edges (loaders, CLI), printed as one line, exit code 2."""


class SpecbenchError(Exception):
    """A problem the user can fix; the message says what to do."""
