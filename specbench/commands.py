"""Commands built from option declarations (``specbench.options``): one Typer parameter per declared
field, with the field's spelling, command-line type and default, and its help with its range; then the
parsed values back into the declaration, converted and validated (bounds, choices, checks, conflicts).

A command is thus declared once, as a dataclass: `specbench run` (``RunConfig`` and ``SideFlags``),
`parity` (``ParityConfig``), `reproduce` (``ReproduceConfig``), `train data` and every trainer.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from specbench import options as opts


def _optional(hint: Any) -> Any:
    """``X | None`` as ``Optional[X]``, the spelling every Typer version reads."""
    args = typing.get_args(hint)
    if type(None) in args and len(args) == 2:
        return Optional[next(a for a in args if a is not type(None))]
    return hint


def cli_type(option: opts.Declared) -> Any:
    """The type Typer parses the flag as: the declared one, with a choice (``Literal``) read as text so that
    the declaration, not Typer, words the error."""
    if option.cli_type is not opts.SAME:
        return option.cli_type
    if typing.get_origin(option.element) is Literal:
        text = list[str] if option.is_list else str
        return Optional[text] if option.optional else text
    return _optional(option.type)


def cli_default(option: opts.Declared) -> Any:
    if option.cli_default is not opts.SAME:
        return option.cli_default
    return ... if option.default is dataclasses.MISSING else option.default  # ...: Typer's "required"


def parameter(option: opts.Declared) -> inspect.Parameter:
    """One keyword parameter of a command function, as Typer reads it."""
    import typer

    default, help = cli_default(option), opts.help_text(option)
    if option.positional:
        info = typer.Argument(default, help=help, show_default=False)
    else:
        info = typer.Option(default, *option.flags, help=help)
    return inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=cli_type(option))


def flags_of(*declarations: type, skip: tuple[str, ...] = ()) -> list[opts.Declared]:
    """Every command-line field of the declarations, in order (internal fields and ``skip`` left out)."""
    return [d for cls in declarations for d in opts.declared(cls) if not d.internal and d.name not in skip]


def command(callback: Callable[..., Any], fields: list[opts.Declared], doc: str | None = None,
            context: bool = False) -> Callable[..., Any]:
    """A function with one keyword parameter per field that calls ``callback(**values)``; Typer reads its
    signature (so the command's flags are the declarations' fields). ``context``: ``callback`` also gets
    ``ctx``, the command's context, which says which flags the command line gave (``get_parameter_source``)."""
    params = [parameter(option) for option in fields]
    if context:
        import typer

        params.insert(0, inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))

    def run(**values: Any) -> Any:
        return callback(**values)

    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    run.__doc__ = doc if doc is not None else inspect.getdoc(callback)
    run.__name__ = getattr(callback, "__name__", "command").lstrip("_")
    return run


def values_for(cls: type, flags: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """``cls``'s keyword arguments from parsed flags (each converted where its flag's form differs),
    plus ``extra``."""
    out = {}
    for option in opts.declared(cls):
        if option.name in flags and not option.internal:
            value = flags[option.name]
            out[option.name] = option.convert(value) if option.convert is not None and value is not None else value
    return {**out, **extra}


def label(*declarations: type) -> Callable[[str], str]:
    """How errors name a field of the declarations: its flag (``--top-p``, ``--attn``), or its name in
    capitals for an argument."""
    known = {name: d for cls in declarations for name, d in opts.declared_by_name(cls).items()}

    def name(field: str) -> str:
        option = known.get(field)
        if option is None:
            return "--" + field.replace("_", "-")
        return option.name.upper() if option.positional else option.flag

    return name


def build(cls: type, flags: dict[str, Any], owner: str, **extra: Any) -> Any:
    """``cls`` from parsed flags, validated against its declaration (one line per error)."""
    return opts.validate(cls(**values_for(cls, flags, **extra)), owner, label(cls))


def path_text(value: Optional[Path]) -> Optional[str]:
    """A path flag's value as the field's text (a field holds text, so that its header entry reads back)."""
    return str(value) if value is not None else None
