"""`specbench train pacer`: PACER's pre-verification layer, trained on replayed speculative decoding
(paper §3.3, App. D) with the shared fit loop: replay greedy SD of the SpS draft against the
target's regenerated responses, pack every step of a response into one sequence (Fig. 5 mask),
binary cross-entropy; held-out BCE, accuracy and AUC."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from methods.pacer.checkpoint import draft_fingerprint, save_preverifier
from methods.pacer.model import PreVerifier
from methods.pacer.objective import pacer_loss
from methods.pacer.packing import collate, pack_example
from specbench.engine.target import Target
from specbench.training.learning_curve import curve_section
from specbench.training.model_card import schedule_length
from specbench.training.plugin import MethodTrainer, TrainOptions, option


@dataclass
class PacerTrainOptions(TrainOptions):
    draft: str = option("", "SpS draft model (empty = the shipped one for the target).")
    window: int = option(50, "Drafts per replayed step (the paper drafts 50).", ge=1)
    position_embedding: bool = option(True, "Learned draft-position embedding (off = the paper's ablation).")
    epochs: int = option(5)
    lr: float = option(5e-4)
    batch_size: int = option(4, "Responses (packed sequences) per step.")
    dtype: str = option("float32", "The target's dtype while it regenerates the answers: bfloat16 is several times "
                                   "faster on CPUs with native bf16 and on GPUs (auto picks it where native); the layer "
                                   "trains under bf16 autocast either way.")
    bf16_weights: bool = option(False, "Save the layer in bf16: half the file (a 0.5B draft's layer is 15M parameters, "
                                       "60 MB in fp32); it runs in the target's dtype either way.")


class PacerTrainer(MethodTrainer):
    """Train PACER's pre-verification layer on replayed speculative decoding (binary CE)."""

    command = "pacer"
    Options = PacerTrainOptions
    omit = ("max_length", "cache_features")  # packed sequences of cached draft states

    def train(self, o: PacerTrainOptions) -> dict:
        from specbench.data import distributed
        from specbench.training.fit import fit, recipe_for, training_data

        t, data_file, examples = training_data(o)
        recipe = recipe_for(o, max_length=0, window=o.window, position_embedding=o.position_embedding,
                            draft=o.draft or "shipped", target_dtype=str(t.dtype).removeprefix("torch."))
        recipe.betas = (0.9, 0.999)  # the paper's AdamW betas
        recipe.dtype = "bfloat16"  # autocast: ~2x faster on CPU; the layer and optimizer state stay fp32
        with distributed.main_first():  # under torchrun rank 0 replays (and caches) first
            packed, draft_model = replay_dataset(t, examples, data_file, o.draft, o.window)
        replay_s = packed[0].get("replay_s")
        model = PreVerifier(draft_model.config, o.window, o.position_embedding).float()
        model.init_from_draft(draft_model)
        if model.pos is not None:
            recipe.extra["position_init_std"] = round(model.scale_positions_to(
                torch.cat([p["hidden"] for p in packed[:64]])), 4)
        model.body.embed_tokens.weight.requires_grad_(False)
        stats: dict = {}

        def describe(trains: list[dict], evals: list[dict]) -> dict:
            labels = torch.cat([p["labels"][p["labels"] >= 0] for p in trains])
            stats.update({"train_steps": sum(len(p["steps"]) for p in trains), "train_rows": int(labels.numel()),
                          "train_positive_rate": float(labels.mean()), "replay_s": replay_s})
            return {**stats, "parameters": model.trainable_parameters()}

        return fit(model, lambda b: pacer_loss(model, b), packed, packed_batches(o.batch_size),
                   lambda folder: save_preverifier(folder, model, t, o.draft, recipe.__dict__, draft_model,
                                                  torch.bfloat16 if o.bf16_weights else torch.float32), recipe,
                   o.out, o.held_out, data_file, describe=describe, card=lambda folder, final: write_card(folder, final, stats),
                   saved="pre-verification layer")


def packed_batches(batch_size: int):
    """batches(items, epoch, world) over packed sequences: similar lengths together, the chunks
    shuffled per epoch (none for the held-out pass); under torchrun this rank's rows of each."""
    from specbench.data import distributed

    def batches(items, epoch, world):
        order = sorted(range(len(items)), key=lambda i: items[i]["hidden"].shape[0])
        chunks = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
        if epoch is not None:
            random.Random(epoch).shuffle(chunks)
        for chunk in chunks:
            mine, filler = distributed.rows_of(chunk, world) if world is not None else (chunk, False)
            batch = collate([items[i] for i in mine])
            batch.filler = filler  # a rank without a row of this batch: weight 0
            yield batch

    return batches


def replay_dataset(target: Target, examples: list[dict], data_file: Path, draft: str, window: int):
    """Packed sequences for every example, cached on disk by data file, draft and window (replaying
    SD is the slow part and is shared by the with/without position-embedding runs)."""
    import hashlib
    import time

    from rich.progress import track

    from methods.sps.drafter import SpSDrafter, SpSOptions
    from specbench.engine.packaged import cache_dir

    sps = SpSDrafter(SpSOptions(draft=draft, dtype="bfloat16"))  # the draft as benchmarks run it
    sps.setup(target)
    # Keyed by the draft's weights, not its path: a retrained draft in the same folder replays afresh.
    key = f"{data_file}|{draft_fingerprint(sps.model)}|{window}|{len(examples)}"
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    path = cache_dir() / "pacer" / f"{data_file.stem}-{tag}.pt"
    if path.exists():
        return torch.load(path, weights_only=False), sps.model
    start = time.time()
    packed = []
    for e in track(examples, description="replaying SD"):
        item = pack_example(sps.model, e, window, target.vocab_size)
        if item is not None:
            packed.append(item)
    packed[0]["replay_s"] = round(time.time() - start, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(packed, path)
    return packed, sps.model


def position_init(extra: dict) -> str:
    std = extra.get("position_init_std")  # absent in layers trained before it was drawn at the states' scale
    return f", drawn at the draft states' scale, std {std}" if std else ""


def write_card(folder: Path, evaluation: dict, stats: dict) -> None:
    config = json.loads((folder / "config.json").read_text())
    recipe, arch = config["recipe"], config["architecture"]
    extra = recipe.get("extra", {})
    lines = [f"# PACER pre-verification layer for {config['target']['name']}", "", config["note"], "",
             "| | |", "|---|---|",
             f"| draft model | {config['draft']} |",
             f"| architecture | 1 decoder layer (init from the draft's last layer) + final norm + "
             f"{'draft-position embedding (window ' + str(arch['window']) + position_init(extra) + ')' if arch['use_pos'] else 'NO position embedding'}"
             f" + scalar head; {arch['parameters']:,} parameters |",
             f"| data | {extra.get('train_examples')} ShareGPT responses regenerated by the target"
             f"{' in ' + extra['target_dtype'] if 'target_dtype' in extra else ''} (the paper uses CodeAlpaca, "
             f"which is not in the offline store), {extra.get('eval_examples')} held out; replayed greedy SD, window "
             f"{arch['window']}: {stats.get('train_steps')} draft steps, {stats.get('train_rows')} labelled drafts, "
             f"{100 * stats.get('train_positive_rate', 0):.1f}% accepted |",
             f"| recipe | AdamW {recipe.get('betas')} lr {recipe.get('lr')}, cosine, warmup {recipe.get('warmup_ratio')}, "
             f"batch {recipe.get('batch_size')} responses, {schedule_length(recipe)}, binary CE |",
             f"| steps / wall time | {evaluation.get('steps')} / {evaluation.get('wall_time_s')} s on {extra.get('hardware', 'CPU')} "
             f"(+ {stats.get('replay_s')} s replaying SD) |",
             f"| held-out | BCE {evaluation.get('bce', float('nan')):.4f}, accuracy {evaluation.get('accuracy', float('nan')):.4f} "
             f"(positive rate {evaluation.get('positive_rate', float('nan')):.4f}), AUC {evaluation.get('auc', float('nan')):.3f}, "
             f"AUC on draft 1 {evaluation.get('auc_draft1', float('nan')):.3f} |",
             "", "Generated by `specbench train pacer`; numbers are from the held-out split at the end of training."]
    lines += ["", *curve_section(folder)]
    (folder / "README.md").write_text("\n".join(lines) + "\n")
