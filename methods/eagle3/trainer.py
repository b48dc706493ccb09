"""`specbench train eagle3`: an EAGLE-3 drafter on the frozen target (training-time test over
``steps`` unrolled steps, 0.8^s decay), with a reduced draft vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

import typer

from specbench.training.plugin import MethodTrainer, TrainOptions, option


@dataclass
class Eagle3TrainOptions(TrainOptions):
    draft_vocab: int = option(4096, "Reduced draft vocabulary (most frequent response tokens).", ge=0)
    steps: int = option(7, "Training-time-test unroll steps.", ge=1)
    epochs: int = option(4)
    lr: float = option(1e-3)
    batch_size: int = option(8)


class Eagle3Trainer(MethodTrainer):
    """Train an EAGLE-3 drafter (training-time test over ``steps`` unrolled steps, 0.8^s decay)."""

    command = "eagle3"
    Options = Eagle3TrainOptions

    def train(self, o: Eagle3TrainOptions) -> dict:
        from methods.eagle3.drafter import Eagle3Model
        from specbench.training.features import token_counts
        from specbench.training.fit import fit_features, recipe_for, training_data
        from specbench.training.vocab import build_vocab_mapping

        t, data_file, examples = training_data(o)
        d2t, t2d, coverage = build_vocab_mapping(token_counts(examples, t.vocab_size), o.draft_vocab)
        typer.echo(f"draft vocabulary {o.draft_vocab}: {100 * coverage:.2f}% of response tokens")
        model = Eagle3Model.from_target(t, (d2t, t2d))
        recipe = recipe_for(o, draft_vocab=o.draft_vocab, vocab_coverage=coverage, unroll_steps=o.steps)
        return fit_features(t, examples, model, lambda b: model.training_loss(b, steps=o.steps), list(model.taps),
                            lambda folder: model.save(folder, t, recipe.__dict__), recipe, o, data_file)
