"""References that import their authors' code from a repository snapshot: without one, `specbench parity ROW` is
refused in one line naming what to fetch and where to point, exit 2, nothing written (no snapshot needed)."""

from __future__ import annotations

import pytest

from test_parity_cli import refused

# row -> (repository to clone, the variable that points at a checkout)
SNAPSHOT_ROWS = {"eagle3": ("https://github.com/SafeAILab/EAGLE", "SPECBENCH_REF_EAGLE")}


@pytest.mark.parametrize("row", sorted(SNAPSHOT_ROWS))
@pytest.mark.parametrize("given", ["nothing", "not-a-checkout"])
def test_a_reference_without_its_snapshot_is_refused_in_one_line(row, given, capsys, tmp_path, monkeypatch):
    url, env = SNAPSHOT_ROWS[row]
    monkeypatch.delenv(env, raising=False)
    args = [] if given == "nothing" else ["--reference-src", str(tmp_path.parent / f"{tmp_path.name}-not-a-checkout")]
    line = refused([row, *args], capsys, tmp_path, monkeypatch)
    assert f"git clone {url}" in line and "--reference-src" in line and f"${env}" in line
