"""specbench's own methods, each registered under the entry-point group ``specbench.methods``
(pyproject.toml). Data that the core reads is declared there too, by these paths."""

from pathlib import Path

PRESETS = Path(__file__).parent / "presets"  # paper presets (group specbench.presets)
CLAIMS = Path(__file__).parent / "claims.yaml"  # the papers' claims for the orderings table (group specbench.claims)
PAPER_NUMBERS = Path(__file__).parent / "paper_numbers.csv"  # the papers' printed numbers (group specbench.paper_numbers)
