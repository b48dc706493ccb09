"""The reference-set plan covers what the report's claims need: six benches with enough prompts, every
claim's sides in one file, the mixed stream twice, a sampled run; every run resumable and exact (fp32)."""

import importlib.util
import json
from pathlib import Path

from specbench.engine.registry import available_methods
from specbench.records import GenerationRecord
from specbench.sides import parse_spec


def learns(spec):
    from specbench.engine.registry import method_class

    return method_class(parse_spec(spec).method).learns

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "reference_set.py"


def load_plan():
    spec = importlib.util.spec_from_file_location("reference_set", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, module.plan(limit=24, repeats=1, stream_limit=8, passes=2)


def sides(argv):
    """The run's side labels: --label (else --method), then each --also spec's label."""
    main = argv[argv.index("--label") + 1] if "--label" in argv else argv[argv.index("--method") + 1]
    also = [argv[i + 1] for i, a in enumerate(argv) if a == "--also"]
    return [main] + [spec.split("@label=", 1)[1] if "@label=" in spec else spec for spec in also]


def methods(argv):
    return [argv[argv.index("--method") + 1]] + [argv[i + 1].split("@")[0] for i, a in enumerate(argv) if a == "--also"]


def test_plan_covers_every_bench_method_and_claim():
    module, runs = load_plan()
    assert len({out for out, _ in runs}) == len(runs)  # one file per run
    for out, argv in runs:
        if argv[0] == "parity":  # transformers' assisted generation on the pair
            assert module.PAIR_GROUP in out and argv[1] == "sps" and argv[argv.index("--out") + 1] == out
            continue
        group = Path(out).name.split("_")[0]
        dtype = {"bfloat16"} if group.endswith(module.BF16_SUFFIX) else {module.PAIR_GROUP: {"bfloat16", "float32"}}.get(
            group, {"float32"})
        assert argv[:1] == ["run"] and "--resume" in argv and argv[argv.index("--dtype") + 1] in dtype
        tokens = module.BATCH_TOKENS if group.startswith(module.BATCH_GROUP) else 128  # the batch sweeps: shorter turns
        assert argv[argv.index("--max-new-tokens") + 1] == str(tokens) and argv[argv.index("--out") + 1] == out
        assert argv[argv.index("--budget") + 1] == "16"  # every tree method at one node budget
        assert set(methods(argv)) <= set(available_methods())
    # the two settings of their own tables, and SpecBlock's one comparison of its two bonus-row readings: fewer prompts
    extra = (module.BF16_GROUP + "_", module.PAIR_GROUP, module.BONUS_ROW_GROUP, module.BATCH_GROUP,
             module.ENGINE_GROUP + "_")
    t0 = [argv for out, argv in runs if out.endswith("_T0.jsonl") and "mixed" not in out and argv[0] == "run"
          and not Path(out).name.startswith(extra)]
    for bench in ("mt_bench", "humaneval", "math500", "natural_questions", "wmt23", "alpaca"):
        ran = [a for a in t0 if a[a.index("--bench") + 1] == bench]
        assert all(int(a[a.index("--limit") + 1]) >= 24 for a in ran)
        together = [set(sides(a)) for a in ran]
        assert any({"specblock", "eagle3"} <= s for s in together)  # SpecBlock vs EAGLE-3 in one file
        assert any({"specblock (400 steps)", "specblock-no-shift (400 steps)", "specblock-no-broadcast (400 steps)",
                    "specblock-no-valid-prefix (400 steps)", "specblock-uniform-tree (400 steps)"} <= s
                   for s in together)
        assert any({"dflash", "ddtree@budget=8", "ddtree@budget=64"} <= s for s in together)
        assert any({"pacer", "sps@gamma=2", "sps@gamma=8"} <= s for s in together)
    streams = [a for out, a in runs if "_mixed_" in out and "bfloat16" not in a]
    assert any({"specblock", "specblock-osd", "specblock-adapt"} <= set(sides(a)) for a in streams)
    assert any("dvi" in sides(a) for a in streams) and all(a[a.index("--passes") + 1] == "2" for a in streams)
    assert any(a[a.index("--temperature") + 1] == "1" for _, a in runs if a[0] == "run")


def test_the_ablation_run_compares_drafters_trained_alike_and_its_claim_pairs_them():
    from specbench.analysis.orderings import comparisons, load_claims
    from specbench.sides import Side, parse_spec
    from test_orderings import rec, result_file

    module, runs = load_plan()
    argv = next(a for out, a in runs if "specblock-ablations_humaneval" in out)
    # The base is SpecBlock trained 400 steps, like the ablated drafters; the uniform tree runs on it too.
    assert argv[argv.index("--opt") + 1] == f"path={module.ABLATION_BASE}"
    assert any(spec.startswith(f"specblock-uniform-tree@path={module.ABLATION_BASE}@") for spec in argv)
    drafters = module.ablation_drafters()
    assert drafters["specblock-400-steps"] == module.ROOT / module.ABLATION_BASE
    assert set(drafters) == {"specblock-400-steps", *(f"specblock-{v}" for v in ("no-broadcast", "no-shift",
                                                                                 "no-valid-prefix"))}
    # Every one of them shipped so far was trained that way (the group refuses to run until all four are).
    for folder in drafters.values():
        if (folder / "config.json").is_file():
            recipe = json.loads((folder / "config.json").read_text())["recipe"]
            assert (recipe["max_steps"], recipe["dtype"]) == (module.ABLATION_STEPS, "float32"), folder
    claim = next(c for c in load_claims() if "ablation" in c.text)
    opts = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--opt")
    run = [Side(argv[argv.index("--method") + 1], opts, argv[argv.index("--label") + 1])]
    run += [parse_spec(argv[i + 1]) for i, a in enumerate(argv) if a == "--also"]
    assert [side.label for side in run] == sides(argv)

    def result(labels, specs, name):  # what the run writes: records of every side, the sides in the header
        records = [rec(label, f"p{i}", 1.0) for label in ["vanilla", *labels] for i in range(8)]
        return result_file(records, name, side_specs=[side.header() for side in specs])

    files = [result(sides(argv), run, "ablations.jsonl"),
             result(["specblock"], [Side("specblock")], "main.jsonl")]  # the main run's two-epoch specblock
    pairs = {(a, b) for a, b, _, _ in comparisons(claim, files, "humaneval")}
    # ... each ablation with its base of the same run; the A/A control (a second vanilla side) pairs with nothing
    assert pairs == {("specblock (400 steps)", label) for label in sides(argv)[1:] if label != "vanilla (A/A)"}


def test_the_ablation_group_refuses_to_run_until_its_four_drafters_are_trained_alike(tmp_path):
    module, _ = load_plan()
    folders = {name: tmp_path / name for name in ("specblock-400-steps", "specblock-no-shift")}

    def ship(name, **recipe):
        folders[name].mkdir(exist_ok=True)
        (folders[name] / "config.json").write_text(json.dumps({"recipe": {"max_steps": 400, "dtype": "float32",
                                                                          **recipe}}))

    ship("specblock-400-steps")
    problem = module.ablation_problem(folders)
    assert "specblock-no-shift holds no trained drafter" in problem
    assert "python bench/train_drafters.py --only specblock-no-shift" in problem
    ship("specblock-no-shift", max_steps=None)
    assert "not trained 400 steps" in module.ablation_problem(folders)
    ship("specblock-no-shift", dtype="bfloat16")
    assert "different dtypes" in module.ablation_problem(folders)
    ship("specblock-no-shift")
    assert module.ablation_problem(folders) is None


def test_the_bf16_group_repeats_the_main_group_in_bf16_on_every_bench():
    module, runs = load_plan()
    fp32 = {a[a.index("--bench") + 1]: a for out, a in runs if Path(out).name.startswith("main_") and "_T0" in out}
    bf16 = {a[a.index("--bench") + 1]: a for out, a in runs if Path(out).name.startswith(module.BF16_GROUP + "_")}
    assert set(bf16) == set(module.BENCHES) == set(fp32)
    for bench, argv in bf16.items():
        assert sides(argv) == sides(fp32[bench]) and "vanilla (A/A)" in sides(argv)
        assert int(argv[argv.index("--limit") + 1]) == module.BF16_LIMIT


def test_every_method_of_the_fp32_set_has_a_bf16_run_whose_divergences_are_counted():
    module, runs = load_plan()
    ran = {dtype: set() for dtype in ("float32", "bfloat16")}
    for out, argv in runs:
        if argv[0] == "run" and module.TARGET in out and "_T0" in out:
            ran[argv[argv.index("--dtype") + 1]].update(methods(argv))
    ablations = {m for m in ran["float32"] if m.startswith("specblock-no-") or m == "specblock-uniform-tree"}
    ablations |= {m for m in ran["float32"] if m.startswith("pacer-no-")}
    assert ran["float32"] - ablations <= ran["bfloat16"]
    assert {"dvi", "specblock-osd", "specblock-adapt", "suffix", "pld", "lookahead"} <= ran["bfloat16"]
    streams = [(out, a) for out, a in runs if "_mixed_" in out and "bfloat16" in a]
    assert {Path(out).name.split("_")[0] for out, _ in streams} == {g + module.BF16_SUFFIX for g in module.STREAM_GROUPS}
    assert all(int(a[a.index("--limit") + 1]) == module.BF16_STREAM_LIMIT for _, a in streams)


def test_the_pair_group_runs_sps_and_its_variants_with_the_packaged_draft_beside_assisted_generation():
    module, runs = load_plan()
    pair = [(out, a) for out, a in runs if module.PAIR_GROUP in out and module.PAIR_FP32_GROUP not in out]
    files = [a for out, a in pair if a[0] == "run"]
    assert {a[a.index("--bench") + 1] for a in files} == set(module.PAIR_BENCHES)
    for argv in files:
        assert argv[argv.index("--target") + 1] == module.PAIR_TARGET
        assert set(sides(argv)) == {"sps", "sps@gamma=3", "sps@gamma=8", "sps@schedule=heuristic", "sps-confidence",
                                    "pacer", "vanilla (A/A)"}
        assert all(f"draft={module.PAIR_DRAFT}" in spec for spec in [argv[argv.index("--opt") + 1],
                                                                      *(argv[i + 1] for i, a in enumerate(argv)
                                                                        if a == "--also" and "vanilla" not in argv[i + 1])])
    parity = [a for out, a in pair if a[0] == "parity"]
    assert len(parity) == 1 and parity[0][parity[0].index("--opt") + 1] == f"draft={module.PAIR_DRAFT}"


def test_where_the_pair_runs_in_bf16_its_texts_are_also_checked_in_fp32(monkeypatch):
    module, _ = load_plan()

    def fp32_runs(emulated: bool, named: bool = False) -> list[list[str]]:
        monkeypatch.setattr(module, "emulated_bf16", lambda device: emulated)
        return [a for out, a in module.plan(8, 1, 8, 2, pair_fp32=named) if module.PAIR_FP32_GROUP in out]

    assert fp32_runs(emulated=True) == []  # a CPU without native bf16 runs the pair in fp32 already
    checks = fp32_runs(emulated=False)
    assert [argv[argv.index("--bench") + 1] for argv in checks] == list(module.PAIR_BENCHES)  # the bf16 run's benches
    for argv in checks:
        assert argv[argv.index("--dtype") + 1] == "float32" and argv[argv.index("--target") + 1] == module.PAIR_TARGET
        assert sides(argv) == ["sps", "sps@gamma=8", "sps-confidence"]  # texts only: no A/A side
    # Named, it runs there too (to check bf16 files another machine made), with the same arguments.
    assert fp32_runs(emulated=True, named=True) == checks


def test_specblocks_two_bonus_row_readings_run_side_by_side_on_every_bench_in_fp32_and_bf16():
    # once (the paper's, the authors' training code's, the shipped drafter's) against duplicate (the authors' inference
    # code), interleaved in one file per bench and dtype, labelled apart from the main table's `specblock`
    module, runs = load_plan()
    for dtype, suffix, limit in (("float32", "", module.BONUS_ROW_LIMIT), ("bfloat16", module.BF16_SUFFIX, module.BF16_LIMIT)):
        group = {a[a.index("--bench") + 1]: a for out, a in runs
                 if Path(out).name.startswith(module.BONUS_ROW_GROUP + suffix + "_")}
        assert set(group) == set(module.BENCHES)
        for argv in group.values():
            assert sides(argv) == ["specblock (bonus row once)", "specblock (bonus row duplicate)", "vanilla (A/A)"]
            assert argv[argv.index("--dtype") + 1] == dtype and int(argv[argv.index("--limit") + 1]) == limit
            assert "bonus_row=once" in argv and any("@bonus_row=duplicate@" in a for a in argv)


def test_the_engine_group_runs_the_headline_methods_in_both_engines_alike():
    module, runs = load_plan()
    group = {out: a for out, a in runs if module.group_of(out) == module.ENGINE_GROUP}
    assert len(group) == 4  # HumanEval and MT-Bench, once per engine
    by_engine = {}
    for out, argv in group.items():
        engine = argv[argv.index("--engine") + 1]
        rest = [a for a in argv if a not in (engine, out)]
        by_engine.setdefault(argv[argv.index("--bench") + 1], {})[engine] = rest
        assert {"sps", "eagle3", "specblock", "ddtree", "pld", "suffix", "vanilla (A/A)"} <= set(sides(argv))
        assert argv[argv.index("--dtype") + 1] == "float32" and argv[argv.index("--temperature") + 1] == "0"
    for bench, engines in by_engine.items():  # the two engines' runs differ in nothing else
        assert set(engines) == {"eager", "compiled"} and engines["eager"] == engines["compiled"]


def test_the_batch_groups_sweep_the_main_methods_over_b_in_both_dtypes():
    from specbench.engine.registry import method_class, parse_options
    from specbench.run.run_config import parse_batch_sizes

    module, runs = load_plan()
    sweeps = {(Path(out).name.split("_")[0], a[a.index("--bench") + 1]): a for out, a in runs if "--batch-size" in a}
    groups = (module.BATCH_GROUP, module.BATCH_GROUP + module.BF16_SUFFIX)
    assert set(sweeps) == {(g, b) for g in groups for b in ("humaneval", "mt_bench")}
    for (group, _), argv in sweeps.items():
        assert parse_batch_sizes(argv[argv.index("--batch-size") + 1]) == [1, 2, 4, 8, 16]
        assert argv[argv.index("--dtype") + 1] == ("bfloat16" if group.endswith(module.BF16_SUFFIX) else "float32")
        assert int(argv[argv.index("--limit") + 1]) == 16  # B = 16 fills
        assert not any(learns(spec) for spec in methods(argv)) and "vanilla (A/A)" not in sides(argv)
        # the methods that draft the batch at once beside the main ones drafting through per-request forks
        assert all(method_class(m)(parse_options(method_class(m), {})).batched_drafting for m in ("sps", "eagle3"))
        assert {"specblock", "eagle3", "sps", "pld"} <= set(methods(argv))


def test_the_gpu_batch_sweeps_are_the_bf16_batch_groups_on_the_device():
    """`make gpu-batch` (bench/gpu_check.py --batch) runs the plan's own bf16 sweeps, only moved to the device and
    to its results folder: same sides, sizes, prompts and tokens."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT.parent / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    module, _ = load_plan()
    group = module.BATCH_GROUP + module.BF16_SUFFIX
    planned = {Path(out).name: argv for out, argv in module.plan(limit=module.BATCH_LIMIT, repeats=1, stream_limit=1,
                                                                 passes=1) if Path(out).name.startswith(group + "_")}
    sweeps = gpu_check.batch_sweeps("cuda", Path("results/gpu"))
    assert sorted(out.name for out, _ in sweeps) == sorted(planned) and len(sweeps) == 2
    for out, argv in sweeps:
        assert out.parent == Path("results/gpu") and argv[argv.index("--out") + 1] == str(out)
        assert argv[-2:] == ["--device", "cuda"] and argv[argv.index("--dtype") + 1] == "bfloat16"
        expected = list(planned[out.name])
        expected[expected.index("--out") + 1] = str(out)
        assert argv[:-2] == module.resuming(str(out), expected)  # --resume only where a file of it exists


def test_a_planned_run_resumes_only_a_file_on_disk(tmp_path, monkeypatch):
    """`specbench run --resume` refuses a file that does not exist: a run not begun starts, a begun one resumes
    (a batch sweep's files are one per B)."""
    module, runs = load_plan()
    monkeypatch.setattr(module, "ROOT", tmp_path)
    for out, argv in [next(r for r in runs if "--batch-size" not in r[1]), next(r for r in runs if "--batch-size" in r[1]
                                                                                 and "," in r[1][r[1].index("--batch-size") + 1])]:
        assert "--resume" in argv and module.resuming(out, argv) == [a for a in argv if a != "--resume"]
        begun = tmp_path / out
        begun.parent.mkdir(parents=True, exist_ok=True)
        if "--batch-size" in argv:
            begun = begun.with_name(f"{begun.stem}_B1{begun.suffix}")
        begun.write_text('{"type": "header", "meta": {}}\n')
        assert module.resuming(out, argv) == argv


def test_the_main_group_and_its_sampled_check_are_groups_a_session_can_run(monkeypatch):
    """The script's default is 8 prompts per bench (the largest group, main fp32, fits one session on the slowest
    CPU class), and the T = 1 check of the main methods is a group of its own, apart from main."""
    module, _ = load_plan()
    plan = module.plan
    monkeypatch.setattr("sys.argv", ["reference_set.py", "--list"])
    captured = {}
    monkeypatch.setattr(module, "plan", lambda limit, *args, **kwargs: captured.setdefault("limit", limit) and [])
    module.main()
    assert captured["limit"] == 8
    runs = plan(limit=8, repeats=1, stream_limit=8, passes=2)
    groups = {module.group_of(out) for out, argv in runs if argv[0] == "run" and argv[argv.index("--temperature") + 1] == "1"}
    assert groups == {module.SAMPLED_GROUP}
    assert not any(module.group_of(out) == "main" and out.endswith("_T1.jsonl") for out, _ in runs)

def test_the_forced_runs_are_the_greedy_one_request_bf16_runs_with_the_check_in_their_own_folder(monkeypatch):
    """`--forced` re-runs every bf16 file the divergence table judges (the pair's too, where it is bf16) with
    `--check forced`, changing nothing else, into results/forced/ (out of the report's default glob)."""
    module, _ = load_plan()
    monkeypatch.setattr(module, "emulated_bf16", lambda device: False)  # a native-bf16 CPU: the pair runs in bf16
    runs = module.plan(limit=24, repeats=1, stream_limit=8, passes=2)
    bf16 = {Path(out).name: argv for out, argv in runs if "bfloat16" in argv and "--temperature" in argv
            and argv[argv.index("--temperature") + 1] == "0" and "--batch-size" not in argv}
    twins = module.forced_runs(runs)
    assert sorted(Path(out).name for out, _ in twins) == sorted(bf16)
    assert {module.BF16_GROUP, module.PAIR_GROUP, module.BONUS_ROW_GROUP + module.BF16_SUFFIX} <= {
        Path(out).name.split("_")[0] for out, _ in twins}
    for out, argv in twins:
        assert Path(out).parent == Path(module.FORCED_DIR) and argv[argv.index("--out") + 1] == out
        expected = list(bf16[Path(out).name])
        expected[expected.index("--out") + 1] = out
        assert argv == [*expected, "--check", "forced"] and "--resume" in argv
    assert not any("--batch-size" in argv for _, argv in twins)  # the runner refuses the check in a batch


def test_the_plan_prices_each_group_from_its_records_and_starts_dirty_files_afresh(tmp_path, monkeypatch):
    module, runs = load_plan()
    monkeypatch.setattr(module, "ROOT", tmp_path)
    out, argv = next((out, argv) for out, argv in runs if Path(out).name.startswith("main-bf16_humaneval_"))
    source = Path(module.__file__).resolve().parent.parent / "results" / "specblock-bonus-row_humaneval_smollm2-135m_T0.jsonl"
    lines = source.read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])
    records = [json.loads(line) for line in lines[1:] if json.loads(line).get("type") == "record"]
    seconds = sum(GenerationRecord.total_of(r["times"]) for r in records)
    (tmp_path / "results").mkdir()
    assert module.replacing_dirty(out, argv) == argv  # nothing on disk: the run resumes (starts) as planned

    for sha, fresh in (("0123456789ab", False), ("0123456789ab-dirty", True)):
        header["meta"]["git_sha"] = sha
        (tmp_path / out).write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n", encoding="utf-8")
        found = module.recorded_groups([(out, argv)])["main-bf16"]
        assert found.files == 1 and found.dirty == ([Path(out).name] if fresh else [])
        assert abs(found.seconds - seconds) < 1e-6 * seconds
        line = module.cost_line("main-bf16", 6, found)
        assert f"{seconds / 60:.0f} min" in line and ("1 of 1 files record a dirty sha" in line) == fresh
        replaced = module.replacing_dirty(out, argv)
        assert ("--overwrite" in replaced and "--resume" not in replaced) == fresh
        assert replaced == argv or fresh
