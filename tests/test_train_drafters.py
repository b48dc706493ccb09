"""The retraining plan behind the shipped drafters: one recipe per drafter the methods load by default,
every flag one its trainer takes, all on the same data, PACER after the SpS student it reads."""

import importlib.util
from pathlib import Path

from specbench.training.plugin import option_fields, registered_trainers

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "train_drafters.py"


def load_script():
    spec = importlib.util.spec_from_file_location("train_drafters", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flags_of(trainer) -> set[str]:
    out = set()
    for f in option_fields(trainer):
        flag = "--" + f.name.replace("_", "-")
        out |= {flag, "--no-" + f.name.replace("_", "-")}
    return out


def test_every_shipped_drafter_has_a_recipe_its_trainer_accepts(tmp_path):
    module = load_script()
    plan = module.recipes(tmp_path)
    drafters = SCRIPT.parent.parent / "drafters"
    shipped = {p.name if p.parent.name == module.TARGET else f"{p.parent.name}/{p.name}"
               for p in drafters.glob("*/*") if p.is_dir()}
    assert shipped <= set(plan)
    assert {"specblock-no-broadcast", "specblock-no-shift", "specblock-no-valid-prefix"} <= set(plan)
    trainers = registered_trainers()
    for name, argv in plan.items():
        command, rest = argv[0], argv[1:] + module.DATA
        assert command in trainers, name
        accepted = flags_of(trainers[command])
        assert {a for a in rest if a.startswith("--")} <= accepted, name
    names = list(plan)
    assert names.index("sps") < names.index("pacer") and str(tmp_path / "sps" / "drafter") in plan["pacer"]


def test_install_replaces_a_drafter_folder_only_when_finished(tmp_path, monkeypatch):
    module = load_script()
    monkeypatch.setattr(module, "ROOT", tmp_path)
    run = tmp_path / "runs" / "eagle3" / "drafter"
    run.mkdir(parents=True)
    (run / "model.safetensors").write_bytes(b"new")
    assert not module.finished(tmp_path / "runs", "eagle3")
    (run / "learning_curve.csv").write_text("tokens,tau_proxy\n")
    old = tmp_path / "drafters" / module.TARGET / "eagle3"
    old.mkdir(parents=True)
    (old / "stale.json").write_text("{}")
    assert module.finished(tmp_path / "runs", "eagle3")
    dest = module.install(tmp_path / "runs", "eagle3")
    assert dest == old and (dest / "model.safetensors").read_bytes() == b"new" and not (dest / "stale.json").exists()


def test_a_recipe_with_more_epochs_than_its_finished_run_is_not_finished(tmp_path):
    import json

    module = load_script()
    run = tmp_path / "eagle3" / "drafter"
    run.mkdir(parents=True)
    (run / "learning_curve.csv").write_text("tokens,tau_proxy\n")
    (run / "config.json").write_text(json.dumps({"recipe": {"epochs": 1}}))
    assert module.finished(tmp_path, "eagle3", 1) and module.finished(tmp_path, "eagle3")
    assert not module.finished(tmp_path, "eagle3", 2)  # rerunning continues it from its checkpoint
    assert module.epochs_of(module.recipes(tmp_path)["eagle3"]) == 6


def test_a_recipe_overrides_the_shared_data_options_it_sets_itself(tmp_path):
    module = load_script()
    plan = module.recipes(tmp_path)
    pacer = module.data_options(plan["pacer"])
    assert "--limit" not in pacer and "--max-new-tokens" in pacer and "--held-out" in pacer
    assert module.data_options(plan["eagle3"]) == module.DATA


def test_specblock_and_eagle3_train_on_one_budget(tmp_path):
    # The pair the SpecBlock paper compares: the same answers, epochs, schedule, batch, learning rate, length and
    # evaluation points; only the method and its head (the largest draft vocabulary each 20 MiB folder holds) differ.
    module = load_script()
    plan = module.recipes(tmp_path)
    eagle3, specblock = plan["eagle3"], plan["specblock"]
    assert eagle3[1:1 + len(module.EQUAL_BUDGET)] == specblock[1:1 + len(module.EQUAL_BUDGET)] == module.EQUAL_BUDGET
    assert module.epochs_of(eagle3) == module.epochs_of(specblock) == 6
    assert module.data_options(eagle3) == module.data_options(specblock) == module.DATA
    assert eagle3[1 + len(module.EQUAL_BUDGET):] == ["--draft-vocab", "4096"]
    assert specblock[1 + len(module.EQUAL_BUDGET):] == module.SPECBLOCK_HEAD


def test_specblock_ablations_train_alike_on_a_short_schedule_of_their_own(tmp_path):
    # The ablation table's base (specblock-400-steps) is a 400-step cosine schedule of its own in float32 (native on
    # every CPU) with the shipped SpecBlock's head; each ablated drafter differs from it by its --variant only.
    module = load_script()
    plan = module.recipes(tmp_path)
    base = plan[module.ABLATION_BASE]
    assert module.ABLATION_BASE == "specblock-400-steps"
    assert base[base.index("--max-steps") + 1] == "400" and base[base.index("--dtype") + 1] == "float32"
    assert base[-len(module.SPECBLOCK_HEAD):] == module.SPECBLOCK_HEAD
    for variant in ("no-broadcast", "no-shift", "no-valid-prefix"):
        assert plan[f"specblock-{variant}"] == [*base, "--variant", variant]


def test_another_targets_drafter_is_named_target_slash_name_and_installs_under_its_target(tmp_path, monkeypatch):
    module = load_script()
    monkeypatch.setattr(module, "ROOT", tmp_path)
    name = f"{module.PAIR_TARGET}/pacer"
    argv = module.recipes(tmp_path / "runs")[name]
    full = module.command(tmp_path / "runs", name, argv)
    assert full[full.index("--target") + 1] == module.PAIR_TARGET and full[full.index("--draft") + 1] == module.PAIR_DRAFT
    assert full[full.index("--out") + 1] == str(tmp_path / "runs" / module.PAIR_TARGET / "pacer")
    assert module.target_of("pacer") == (module.TARGET, "pacer")
    run = tmp_path / "runs" / module.PAIR_TARGET / "pacer" / "drafter"
    run.mkdir(parents=True)
    (run / "model.safetensors").write_bytes(b"w")
    assert module.install(tmp_path / "runs", name) == tmp_path / "drafters" / module.PAIR_TARGET / "pacer"


def test_a_recipe_whose_pair_is_not_fetched_is_skipped_with_the_fetch_command(monkeypatch):
    import specbench.engine.packaged as packaged

    module = load_script()
    argv = module.recipes(Path("runs"))[f"{module.PAIR_TARGET}/pacer"]
    monkeypatch.setattr(packaged, "is_assembled", lambda name: name != module.PAIR_DRAFT)
    assert module.unfetched(f"{module.PAIR_TARGET}/pacer", argv) == module.PAIR_DRAFT
    monkeypatch.setattr(packaged, "is_assembled", lambda name: True)
    assert module.unfetched(f"{module.PAIR_TARGET}/pacer", argv) is None
    assert module.unfetched("pacer", module.recipes(Path("runs"))["pacer"]) is None  # a path draft, nothing to fetch
