"""The core knows no method: no code under specbench/ names one or imports the methods package.

Names and strings count; comments and docstrings (which may explain a protocol with its paper) do not.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "specbench"
# Short names count only where no letter is glued to them (``sps_note`` and ``pld`` count, ``hspsd`` does not).
METHOD = re.compile(r"specblock|eagle|medusa|dflash|ddtree|pacer|dvi|(?<![a-z])(?:sps|pld|lookahead)(?![a-z])",
                    re.IGNORECASE)
TEXT_TOKENS = {tokenize.NAME, tokenize.STRING} | ({tokenize.FSTRING_MIDDLE} if hasattr(tokenize, "FSTRING_MIDDLE") else set())


def core_files() -> list[Path]:
    return [p for p in sorted(CORE.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]


def documentation(tree: ast.AST) -> set[tuple[int, int]]:
    """Start positions of string statements: docstrings (and attribute docs), which explain, not act."""
    return {(n.lineno, n.col_offset) for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}


def method_mentions(source: str) -> list[tuple[int, str]]:
    """(line, token) of every name or non-doc string in Python ``source`` that names a method."""
    docs = documentation(ast.parse(source))
    return [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type in TEXT_TOKENS and tok.start not in docs and METHOD.search(tok.string)]


def methods_imports(source: str) -> list[int]:
    """Lines that import the methods package (or a module of it)."""
    lines = []
    for n in ast.walk(ast.parse(source)):
        names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
            [n.module or ""] if isinstance(n, ast.ImportFrom) and not n.level else []
        lines += [n.lineno for name in names if name == "methods" or name.startswith("methods.")]
    return lines


def test_the_checker_tells_code_from_documentation():
    source = ('"""EAGLE-style trees."""\n'
              "import methods.dvi\n"
              "def f(x):  # a comment about Medusa is fine\n"
              '    """Docstring naming DDTree."""\n'
              '    return x["specblock"] + eagle3_scale + f"{x}pacer" + sps_note(x, "pld")\n')
    found = method_mentions(source)
    assert {line for line, _ in found} == {2, 5}  # the import and the code line; no doc or comment line
    tokens = " ".join(token for _, token in found)
    assert all(word in tokens for word in ("dvi", '"specblock"', "eagle3_scale", "pacer", "sps_note", '"pld"'))
    assert methods_imports(source) == [2]
    assert methods_imports("from specbench import methods_x\nfrom .methods import y\n") == []


def test_no_core_code_names_a_method_or_imports_methods():
    found = []
    for path in core_files():
        rel = path.relative_to(CORE.parent)
        if path.suffix == ".gz" or path.parent == CORE / "data" / "benches":
            continue  # compressed data; bench cards cite the suite a prompt subset was taken from (provenance)
        if path.suffix != ".py":  # other data shipped in the core: no method names at all
            text = path.read_text(encoding="utf-8", errors="replace")
            found += [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if METHOD.search(line)]
            continue
        source = path.read_text(encoding="utf-8")
        found += [f"{rel}:{line}: {token}" for line, token in method_mentions(source)]
        found += [f"{rel}:{line}: imports methods" for line in methods_imports(source)]
    assert not found, "method knowledge in the core:\n" + "\n".join(found)
