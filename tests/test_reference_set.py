"""The reference-set plan covers what the report's claims need: six benches with enough prompts, every
claim's sides in one file, the mixed stream twice, a sampled run; every run resumable and exact (fp32)."""

import importlib.util
from pathlib import Path

from specbench.drafter import available_methods

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "reference_set.py"


def load_plan():
    spec = importlib.util.spec_from_file_location("reference_set", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, module.plan(limit=24, repeats=1, stream_limit=8, passes=2)


def sides(argv):
    out = [argv[argv.index("--method") + 1]]
    out += [argv[i + 1] for i, a in enumerate(argv) if a == "--also"]
    return out


def test_plan_covers_every_bench_method_and_claim():
    module, runs = load_plan()
    assert len({out for out, _ in runs}) == len(runs)  # one file per run
    for out, argv in runs:
        assert argv[:1] == ["run"] and "--resume" in argv and argv[argv.index("--dtype") + 1] == "float32"
        assert argv[argv.index("--max-new-tokens") + 1] == "128" and argv[argv.index("--out") + 1] == out
        assert argv[argv.index("--budget") + 1] == "16"  # every tree method at one node budget
        assert {s.split("@")[0] for s in sides(argv)} <= set(available_methods())
    t0 = [argv for out, argv in runs if out.endswith("_T0.jsonl") and "mixed" not in out]
    for bench in ("mt_bench", "humaneval", "math500", "natural_questions", "wmt23", "alpaca"):
        ran = [a for a in t0 if a[a.index("--bench") + 1] == bench]
        assert all(int(a[a.index("--limit") + 1]) >= 24 for a in ran)
        together = [set(sides(a)) for a in ran]
        assert any({"specblock", "eagle3"} <= s for s in together)  # SpecBlock vs EAGLE-3 in one file
        assert any({"specblock", "specblock-no-shift", "specblock-no-broadcast",
                    "specblock-no-valid-prefix"} <= s for s in together)
        assert any({"dflash", "ddtree@budget=8", "ddtree@budget=64"} <= s for s in together)
        assert any({"pacer", "sps@gamma=2", "sps@gamma=8"} <= s for s in together)
    streams = [a for out, a in runs if "_mixed_" in out]
    assert any({"specblock", "specblock-osd", "specblock-adapt"} <= set(sides(a)) for a in streams)
    assert any("dvi" in sides(a) for a in streams) and all(a[a.index("--passes") + 1] == "2" for a in streams)
    assert any(a[a.index("--temperature") + 1] == "1" for _, a in runs)
