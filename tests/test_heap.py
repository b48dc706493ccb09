"""`specbench train` fixes glibc's mmap threshold, so a freed activation-sized tensor leaves the
process's resident memory instead of staying as a heap hole (a CPU trainer grew to 12 GB without it)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROBE = textwrap.dedent("""
    import sys, torch
    from specbench.training.heap import return_large_frees_to_os
    applied = return_large_frees_to_os() if sys.argv[1] == "fix" else None
    def resident_mib(): return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
    x = torch.ones(30 * 2**18); del x  # a freed 30 MiB block raises glibc's default threshold past 20 MiB
    a = torch.ones(20 * 2**18)         # so these 20 MiB come from the heap (unless the threshold is fixed)
    b = torch.ones(2**18)              # and this lands after them
    before = resident_mib(); del a
    print(applied, before - resident_mib())
""")


def freed_mib(mode: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"}, cwd=Path(__file__).parents[1]).stdout.split()
    return out[0], float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_fixed_threshold_returns_a_freed_tensor_to_the_os():
    applied, returned = freed_mib("fix")
    if applied != "True":
        pytest.skip("not glibc")
    assert returned > 15  # the 20 MiB left the process
    _, kept_default = freed_mib("none")
    assert kept_default < 5  # glibc's dynamic threshold kept them: the behaviour being fixed


def test_trainer_entry_applies_it(monkeypatch, tmp_path):
    from specbench.training import cli

    calls = []
    monkeypatch.setattr(cli, "return_large_frees_to_os", lambda: calls.append(1) or True)

    class Trainer:
        from specbench.training.plugin import TrainOptions as Options

        def check(self, options):
            pass

        def train(self, options):
            return {"trained": True}

    assert cli.run_trainer(Trainer, {"out": tmp_path / "out"}) == {"trained": True} and calls == [1]
