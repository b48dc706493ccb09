"""A distilled SpS draft model for targets with no smaller sibling (SmolLM2-135M has none).

The student is a few of the target's own decoder layers (copied, then trained) on top of the
target's frozen embedding, final norm and lm_head, distilled with forward KL to the target on
target-regenerated responses. Only the student's layers and norm are saved, so the checkpoint is
small (the 49k-row embedding/lm_head is read from the target at load time). It is *distilled*,
not an off-the-shelf sibling: records label it so.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specbench.errors import SpecbenchError
from specbench.engine.target import Target
from specbench.training.batch import TrainBatch
from specbench.training.checkpoint import check_target, load_drafter, save_drafter, target_fingerprint
from specbench.training.checks import layer_numbers
from specbench.training.plugin import MethodTrainer, TrainOptions, option

METHOD = "sps-student"


def build_student(target: Target, layers: list[int]):
    """A causal LM made of the target's ``layers`` (copied) + its embedding, norm and lm_head."""
    if not layers or any(not 0 <= i < target.num_layers for i in layers):
        raise SpecbenchError(f"student layers must be in 0..{target.num_layers - 1}, got {layers}")
    model = copy.deepcopy(target.model).float()
    model.model.layers = torch.nn.ModuleList([model.model.layers[i] for i in layers])
    for new_index, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = new_index  # the KV cache is indexed by position in the stack
    model.config.num_hidden_layers = len(layers)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in layers]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in list(model.model.layers.parameters()) + list(model.model.norm.parameters()):
        p.requires_grad_(True)
    return model


def trained_state(model) -> dict[str, torch.Tensor]:
    """What the checkpoint stores: the student's layers and final norm."""
    return {k: v for k, v in model.state_dict().items() if k.startswith(("model.layers.", "model.norm."))}


def distillation_loss(model, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward KL(p_target || q_student) on next-token predictions of response tokens."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
    # Position j predicts token j+1; train where token j+1 is a response token.
    mask = batch.loss_mask[:, 1:].bool() & batch.attention_mask[:, :-1].bool()
    h_student = out.hidden_states[-1][:, :-1][mask]
    h_target = batch.taps[-1][:, :-1][mask]
    lm_head = model.get_output_embeddings()
    q_log = F.log_softmax(lm_head(h_student).float(), -1)
    with torch.no_grad():
        p_log = F.log_softmax(lm_head(h_target.to(lm_head.weight.dtype)).float(), -1)
    loss = F.kl_div(q_log, p_log, log_target=True, reduction="batchmean")
    acc = (q_log.argmax(-1) == p_log.argmax(-1)).float().mean()
    return loss, {"loss": float(loss.detach()), "acc_1": float(acc)}


def save_student(folder, model, target: Target, layers: list[int], recipe: dict) -> None:
    config = {"method": METHOD, "architecture": {"layers_from_target": layers, "num_layers": len(layers)},
              "target": target_fingerprint(target), "recipe": recipe,
              "note": "distilled student (not an off-the-shelf sibling): target layers copied, then KL-distilled"}
    save_drafter(folder, trained_state(model), config)


def is_student(config: dict) -> bool:
    return config.get("method") == METHOD


def load_student(folder, target: Target, dtype: torch.dtype):
    config, state = load_drafter(folder, target)
    check_target(config, target, folder)
    model = build_student(target, config["architecture"]["layers_from_target"])
    missing = set(trained_state(model)) - set(state)
    if missing:
        raise SpecbenchError(f"student checkpoint {folder} lacks {sorted(missing)[:3]}...; it is incomplete")
    model.load_state_dict(state, strict=False)
    return model.to(dtype=dtype, device=target.device).eval()


# ---- `specbench train sps-student` ----------------------------------------------------------------
@dataclass
class StudentTrainOptions(TrainOptions):
    layers: str = option("0,29", "Target layers copied into the student (comma-separated).")
    epochs: int = option(4)
    lr: float = option(3e-4)
    batch_size: int = option(4)


class StudentTrainer(MethodTrainer):
    """Distil a small SpS draft model from the target (KL on target-regenerated responses)."""

    command = "sps-student"
    Options = StudentTrainOptions

    def check(self, o: StudentTrainOptions) -> None:
        layer_numbers(o.layers, "--layers", required=True)

    def train(self, o: StudentTrainOptions) -> dict:
        from specbench.training.fit import fit_features, recipe_for, training_data

        t, data_file, examples = training_data(o)
        chosen = layer_numbers(o.layers, "--layers", required=True)
        student = build_student(t, chosen)
        recipe = recipe_for(o, layers=chosen)
        return fit_features(t, examples, student, lambda b: distillation_loss(student, b), [-1],
                            lambda folder: save_student(folder, student, t, chosen, recipe.__dict__), recipe, o,
                            data_file)
