"""A method is one entry point: a toy method with a trainer, in a throwaway package outside the tree
registered only by its entry point, is listed, trained, run and reported by the real command line
(subprocesses, so the package's metadata is found as for an installed plugin) with no core edit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_train_cli import prompt_file

REPO = Path(__file__).resolve().parents[1]

TOY = '''
"""A toy method: a low-rank token bigram drafts a greedy chain of ``gamma`` tokens."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specbench.engine.drafter import Drafter
from specbench.training.plugin import MethodTrainer, TrainOptions, option
from specbench.engine.tree import DraftTree


class Bigram(torch.nn.Module):
    def __init__(self, vocab, rank):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, rank)
        self.out = torch.nn.Linear(rank, vocab)

    def forward(self, ids):
        return self.out(self.embed(ids))


def bigram_loss(model, batch):
    keep = batch.loss_mask[:, 1:].bool()
    logits, labels = model(batch.input_ids[:, :-1])[keep].float(), batch.input_ids[:, 1:][keep]
    loss = F.cross_entropy(logits, labels)
    return loss, {"loss": float(loss), "acc_1": float((logits.argmax(-1) == labels).float().mean())}


@dataclass
class ToyTrainOptions(TrainOptions):
    rank: int = option(8, "Bigram rank.", min=1)
    epochs: int = option(2)


class ToyTrainer(MethodTrainer):
    """Train the toy bigram drafter."""

    Options = ToyTrainOptions

    def train(self, o):
        from specbench.training.checkpoint import save_drafter, target_fingerprint
        from specbench.training.fit import fit_features, recipe_for, training_data

        target, data_file, examples = training_data(o)
        model = Bigram(target.vocab_size, o.rank).to(target.device)
        recipe = recipe_for(o, rank=o.rank)
        config = {"method": "toy", "target": target_fingerprint(target), "architecture": {"rank": o.rank}}
        return fit_features(target, examples, model, lambda b: bigram_loss(model, b), [-1],
                            lambda folder: save_drafter(folder, model.state_dict(), {**config, "recipe": recipe.__dict__}),
                            recipe, o, data_file)


@dataclass
class ToyOptions:
    path: str = ""  # the trained drafter folder
    gamma: int = 3


class ToyDrafter(Drafter):
    Options = ToyOptions
    weight_options = ("path",)
    trainer = ToyTrainer

    def setup(self, target):
        from specbench.training.checkpoint import load_drafter

        super().setup(target)
        config, state = load_drafter(self.resolve_weights("path"), target)
        self.model = Bigram(target.vocab_size, config["architecture"]["rank"])
        self.model.load_state_dict(state)
        self.model.to(device=target.device, dtype=target.dtype).eval()

    @torch.inference_mode()
    def propose(self, state):
        tokens, last = [], state.bonus
        for _ in range(self.options.gamma):
            last = int(self.model(torch.tensor([last], device=self.target.device)).argmax(-1))
            tokens.append(last)
        return DraftTree.chain(tokens)
'''


def install_toy(root: Path) -> Path:
    """The package as pip would lay it out: the module and its dist-info with the entry point."""
    root.mkdir()
    (root / "toy_method.py").write_text(TOY)
    info = root / "toy_method-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-method\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[specbench.methods]\ntoy = toy_method:ToyDrafter\n")
    return root


def specbench(args: list[str], plugin: Path, tmp: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin), str(REPO)]), "OMP_NUM_THREADS": "1",
           "SPECBENCH_CACHE": str(tmp / "cache"), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "specbench", *args], env=env, cwd=tmp, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"specbench {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_toy_plugin_lists_trains_runs_and_reports(models, tmp_path):
    plugin = install_toy(tmp_path / "site")
    prompts = prompt_file(tmp_path)

    listed = specbench(["list", "methods"], plugin, tmp_path)
    toy_row = next(line for line in listed.splitlines() if line.strip("│ ").startswith("toy "))
    assert "specbench train toy" in toy_row  # the table says which command trains it

    out = specbench(["train", "toy", "--target", models["target"], "--prompts", prompts, "--limit", "6",
                     "--max-new-tokens", "12", "--batch-size", "2", "--max-length", "64", "--rank", "4",
                     "--out", str(tmp_path / "toy")], plugin, tmp_path)
    folder = tmp_path / "toy" / "drafter"
    assert "drafter in" in out
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == {"rank": 4} and config["recipe"]["epochs"] == 2  # the toy's own default
    assert json.loads((folder / "eval.json").read_text())["steps"] == 6  # 2 epochs x 3 batches of 2 (1 held out)
    assert (folder / "README.md").is_file()

    results = tmp_path / "toy.jsonl"
    specbench(["run", "--method", "toy", "--opt", f"path={folder}", "--bench", prompts, "--target", models["target"],
               "--dtype", "float32", "--max-new-tokens", "12", "--limit", "3", "--no-warmup", "--out", str(results)],
              plugin, tmp_path)
    records = [json.loads(line) for line in results.read_text().splitlines()[1:]]
    by_prompt: dict[str, dict[str, list[int]]] = {}
    for r in records:
        by_prompt.setdefault(r["prompt_id"], {})[r["method"]] = r["new_tokens"]
    assert len(by_prompt) == 3 and all(sides["toy"] == sides["vanilla"] for sides in by_prompt.values())

    specbench(["report", str(results), "--out-dir", str(tmp_path / "report")], plugin, tmp_path)
    tables = "".join(p.read_text() for p in (tmp_path / "report").glob("*.md"))
    assert "toy" in tables  # the main table has a row for the plugin's method
