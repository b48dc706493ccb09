"""Medusa: K extra heads on the target's final hidden state draft tokens 2..K+1 ahead in parallel;
their top-k candidates fill a fixed sparse tree (``medusa_choices``). docs/methods.md#medusa.

Head k (0-based) = ``num_layers`` ResBlocks (x + SiLU(W x + b), W zero-initialised) followed by an
output layer H -> V. On the final-norm output h_j (hidden_states index -1, what lm_head reads) head k
predicts x_{j+2+k}: the bonus b = x_n came from h_{n-1}, so the heads applied to h_{n-1} propose
depths 1..K of the tree under b. The target stays frozen (Medusa-1). Siblings are deterministic
(top-k ranks), so the engine verifies with lossless rule A; the reference repository's typical
acceptance is lossy and deliberately not implemented.

Checkpoints: our format (``config.json`` + ``model.safetensors`` via training.checkpoint) or the
official FasterDecoding/Medusa folder (``config.json`` with ``medusa_num_heads`` and
``medusa_lm_head.safetensors`` / ``medusa_lm_head.pt``).

In a batch (``--batch-size``) the heads read every request's last kept hidden state in ONE forward per
step ([B, H] rows; there is no drafter cache to keep ragged), and each request's tree is filled from
its own row of the top-k.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from methods.checkpoints import check_keys, load_checked, load_ours_or_published, save_ours, shipped_drafter
from methods.checkpoints import read_published_weights  # whole or sharded weights
from methods.weights_options import drafter_weights
from specbench.engine.drafter import DecodeState, Drafter, VerifyResult
from specbench.errors import SpecbenchError
from specbench.options import option
from specbench.engine.target import Target
from specbench.training.batch import TrainBatch
from specbench.training.checkpoint import found_layout
from specbench.engine.tree import DraftTree, SiblingKind

METHOD = "medusa"
OFFICIAL_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
MEDUSA_KEY_WORDS = ("is missing", "has keys that map to nothing:")  # how key errors have always read for Medusa

# Data, reproduced exactly as published in FasterDecoding/Medusa:medusa/model/medusa_choices.py
# (``mc_sim_7b_63``): 63 rank paths, depth <= 4; path (i_1..i_d) = rank-i_d token of head d-1.
MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
    [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9],
    [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1],
    [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0],
    [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0],
    [0, 0, 0, 1], [1, 6], [0, 7, 0],
]
BUILTIN_CHOICES: dict[str, list[list[int]]] = {"mc_sim_7b_63": MC_SIM_7B_63}

RankPath = tuple[int, ...]  # (i_1..i_d): rank i_d of head d-1 under node (i_1..i_{d-1})


# ---- heads ----------------------------------------------------------------------------------------
class MedusaHeads(nn.Module):
    """K Medusa heads with their ResBlocks stored stacked ([K, layers, ...]) so that inference runs
    every head in one batched matmul per layer instead of K small ones.

    ``shared_lm_head=True`` (our default for small targets): every head's output layer is the
    target's frozen lm_head and only the ResBlocks train. For SmolLM2-135M a per-head lm_head is
    49,152 x 576 = 28M parameters (~57 MB in bf16 per head), far above a 20 MB checkpoint; the shared
    variant stores K x (H^2 + H) = 1.7M parameters for K = 5. With ``shared_lm_head=False`` each head
    owns an output layer, initialised from the target's lm_head (paper) by ``for_target``.
    """

    def __init__(self, num_heads: int, hidden: int, vocab: int, num_layers: int = 1,
                 shared_lm_head: bool = True) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise SpecbenchError(f"medusa: need >= 1 head and >= 0 layers, got {num_heads} and {num_layers}")
        self.num_heads, self.hidden, self.vocab, self.num_layers = num_heads, hidden, vocab, num_layers
        self.shared_lm_head = shared_lm_head
        self.res_weight = nn.Parameter(torch.zeros(num_heads, num_layers, hidden, hidden))  # zero: start near identity
        # Bias as nn.Linear initialises it (what the reference ResBlock does).
        bound = 1.0 / math.sqrt(hidden)
        self.res_bias = nn.Parameter(torch.empty(num_heads, num_layers, hidden).uniform_(-bound, bound))
        if shared_lm_head:
            self.register_parameter("lm_weight", None)
        else:
            weight = torch.empty(num_heads, vocab, hidden)
            for k in range(num_heads):
                nn.init.kaiming_uniform_(weight[k], a=math.sqrt(5))  # nn.Linear's default
            self.lm_weight = nn.Parameter(weight)
        self._shared: tuple[nn.Module, ...] = ()  # the target's lm_head; a tuple so it is not registered/saved

    @classmethod
    def for_target(cls, target: Target, num_heads: int = 5, num_layers: int = 1,
                   shared_lm_head: bool = True) -> "MedusaHeads":
        """Fresh heads for ``target`` (fp32, on the target's device), lm_heads from the target's."""
        lm_head = target.model.get_output_embeddings()
        heads = cls(num_heads, target.hidden_size, target.vocab_size, num_layers, shared_lm_head)
        if shared_lm_head:
            heads.attach_lm_head(lm_head)
        else:
            with torch.no_grad():
                heads.lm_weight.copy_(lm_head.weight.detach().float().expand_as(heads.lm_weight))
        return heads.to(target.device)

    def attach_lm_head(self, lm_head: nn.Module) -> None:
        """Use ``lm_head`` (frozen, not saved) as every head's output layer."""
        if tuple(lm_head.weight.shape) != (self.vocab, self.hidden):
            raise SpecbenchError(f"medusa: lm_head is {tuple(lm_head.weight.shape)}, heads need "
                                 f"({self.vocab}, {self.hidden})")
        self._shared = (lm_head,)

    def ensure_lm_head(self, lm_head: nn.Module) -> None:
        """Attach ``lm_head`` if these heads share the target's and none is attached yet."""
        if self.shared_lm_head and not self._shared:
            self.attach_lm_head(lm_head)

    def first_heads(self, n: int) -> "MedusaHeads":
        """The first ``n`` heads as a new module (deeper heads are dropped)."""
        if not 1 <= n <= self.num_heads:
            raise SpecbenchError(f"medusa: heads={n} but the checkpoint has {self.num_heads}")
        out = MedusaHeads(n, self.hidden, self.vocab, self.num_layers, self.shared_lm_head)
        out.load_state_dict({k: v[:n] for k, v in self.state_dict().items()})
        out._shared = self._shared
        return out.to(self.res_weight.device, self.res_weight.dtype)

    # ---- forward ------------------------------------------------------------------------------
    def _output_weight(self) -> torch.Tensor:
        """[V, H] shared (detached: the target stays frozen) or [K, V, H] per head."""
        if not self.shared_lm_head:
            return self.lm_weight
        if not self._shared:
            raise SpecbenchError("medusa: shared-lm_head heads need attach_lm_head(target lm_head) first")
        return self._shared[0].weight.detach()

    def features(self, h: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """ResBlocks of the first ``num_heads`` heads on h [N, H] -> [K', N, H]."""
        k = num_heads or self.num_heads
        x = h.to(self.res_weight.dtype).unsqueeze(0).expand(k, -1, -1)
        for j in range(self.num_layers):
            w, b = self.res_weight[:k, j], self.res_bias[:k, j]
            x = x + F.silu(torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2)))
        return x

    def head_logits(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """Output layer of head ``k`` on its features x [N, H] -> [N, V]."""
        weight = self._output_weight()
        weight = weight if self.shared_lm_head else weight[k]
        return F.linear(x, weight.to(x.dtype))

    def forward(self, h: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits of the first ``num_heads`` heads on h [N, H] -> [K', N, V]."""
        x = self.features(h, num_heads)
        weight = self._output_weight()
        if self.shared_lm_head:
            return F.linear(x, weight.to(x.dtype))
        return torch.matmul(x, weight[: x.shape[0]].transpose(1, 2))

    # ---- training -----------------------------------------------------------------------------
    def training_loss(self, batch: TrainBatch, decay: float = 0.8) -> tuple[torch.Tensor, dict[str, float]]:
        """Σ_k decay^k · CE(head k on h_j, x_{j+2+k}) over response tokens (docs/methods.md#medusa).

        Metrics: ``loss``, ``loss_k`` and top-1 ``acc_k`` for k = 1..K (head k-1 drafts depth k)."""
        self.ensure_lm_head(batch.lm_head)
        h = batch.taps[-1]
        if h.is_inference():  # features.target_taps runs under inference_mode; autograd must save h
            h = h.clone()
        bsz, length, hidden = h.shape
        feats = self.features(h.reshape(-1, hidden)).reshape(self.num_heads, bsz, length, hidden)
        real, wanted = batch.attention_mask.bool(), batch.loss_mask.bool()
        total = feats.sum() * 0.0  # keeps a graph even when no head has a target
        metrics: dict[str, float] = {}
        for k in range(self.num_heads):
            shift = 2 + k  # head k on h_j predicts x_{j+2+k}
            if shift >= length:
                metrics[f"acc_{k + 1}"] = 0.0
                continue
            rows = real[:, :-shift] & real[:, shift:] & wanted[:, shift:]
            labels = batch.input_ids[:, shift:][rows]
            if labels.numel() == 0:
                metrics[f"acc_{k + 1}"] = 0.0
                continue
            logits = self.head_logits(k, feats[k, :, :-shift][rows]).float()
            loss_k = F.cross_entropy(logits, labels)
            total = total + decay ** k * loss_k
            metrics[f"loss_{k + 1}"] = float(loss_k.detach())
            metrics[f"acc_{k + 1}"] = float((logits.argmax(-1) == labels).float().mean())
        metrics["loss"] = float(total.detach())
        return total, metrics


# ---- checkpoints ----------------------------------------------------------------------------------
def save_medusa(folder: str | Path, heads: MedusaHeads, target: Target, recipe: dict | None = None,
                dtype: torch.dtype | None = None) -> Path:
    """Our format; ``dtype=None`` keeps the heads' dtype (bit-exact round trip)."""
    architecture = {"heads": heads.num_heads, "layers": heads.num_layers, "hidden": heads.hidden,
                    "vocab": heads.vocab, "shared_lm_head": heads.shared_lm_head}
    return save_ours(folder, METHOD, heads.state_dict(), target, architecture, [-1], recipe or {}, dtype)


def load_medusa(folder: str | Path, target: Target) -> MedusaHeads:
    """Heads from our format or the official Medusa folder, checked against ``target``."""
    heads = load_ours_or_published(folder, target, METHOD, lambda config, state: _load_ours(folder, config, state, target),
                                   lambda path, raw: _load_official(path, raw, target))
    heads.ensure_lm_head(target.model.get_output_embeddings())
    return heads


def _check_sizes(folder, hidden: int, vocab: int, target: Target) -> None:
    if hidden != target.hidden_size:
        raise SpecbenchError(f"Medusa heads in {folder} have hidden size {hidden} but target {target.name!r} has "
                             f"{target.hidden_size}; use heads trained for this target")
    if vocab != target.vocab_size:
        raise SpecbenchError(f"Medusa heads in {folder} have vocabulary {vocab} but target {target.name!r} has "
                             f"{target.vocab_size}; use heads trained for this target")


def _load_ours(folder, config: dict, state: dict[str, torch.Tensor], target: Target) -> MedusaHeads:
    arch = config.get("architecture", {})
    try:
        heads = MedusaHeads(arch["heads"], arch["hidden"], arch["vocab"], arch["layers"], arch["shared_lm_head"])
    except KeyError as exc:
        raise SpecbenchError(f"{folder}/config.json lacks architecture.{exc.args[0]}; the checkpoint is "
                             "incomplete") from None
    _check_sizes(folder, heads.hidden, heads.vocab, target)
    return load_checked(heads, state, folder, "Medusa", words=MEDUSA_KEY_WORDS)


def official_key_map(num_heads: int, num_layers: int) -> dict[str, tuple[str, int, int]]:
    """Official key -> (our parameter, head, layer). The official module is
    ModuleList([Sequential(ResBlock × layers, Linear(H, V, bias=False))] × heads)."""
    keys: dict[str, tuple[str, int, int]] = {}
    for k in range(num_heads):
        for j in range(num_layers):
            keys[f"{k}.{j}.linear.weight"] = ("res_weight", k, j)
            keys[f"{k}.{j}.linear.bias"] = ("res_bias", k, j)
        keys[f"{k}.{num_layers}.weight"] = ("lm_weight", k, -1)
    return keys


def official_shape(state: dict[str, torch.Tensor], folder) -> tuple[int, int]:
    """(heads, ResBlocks per head) from the weights' keys ``{k}.{j}.linear.*`` and ``{k}.{layers}.weight``.
    The uploaded configs are not reliable: FasterDecoding/medusa-vicuna-7b-v1.3 says 2 heads while its
    medusa_lm_head.pt holds 5 (the authors' loader overrides it to 5)."""
    heads = {int(k.split(".", 1)[0]) for k in state if k.split(".", 1)[0].isdigit()}
    if not heads or heads != set(range(len(heads))):
        raise SpecbenchError(f"Medusa checkpoint {folder} has no heads numbered 0..K-1 (keys: "
                             f"{', '.join(sorted(state)[:4])}...)")
    blocks = {int(k.split(".")[1]) for k in state if k.startswith("0.") and ".linear." in k}
    return len(heads), len(blocks)


def _load_official(folder: Path, config: dict, target: Target) -> MedusaHeads:
    if "medusa_num_heads" not in config:
        raise SpecbenchError(f"{folder} is not a Medusa drafter (config.json has neither method='medusa' nor "
                             f"medusa_num_heads; {found_layout(folder)})")
    state = read_published_weights(folder, OFFICIAL_WEIGHTS, "Medusa")
    if state and all(k.startswith("medusa_head.") for k in state):  # saved from the wrapping model
        state = {k[len("medusa_head."):]: v for k, v in state.items()}
    num_heads, num_layers = official_shape(state, folder)
    key_map = official_key_map(num_heads, num_layers)
    check_keys(state, key_map, folder, "Medusa", words=MEDUSA_KEY_WORDS)
    vocab, hidden = state[f"0.{num_layers}.weight"].shape
    if "hidden_size" in config and int(config["hidden_size"]) != hidden:
        raise SpecbenchError(f"{folder}: config.json says hidden_size {config['hidden_size']} but the weights "
                             f"have {hidden}; the checkpoint is inconsistent")
    _check_sizes(folder, hidden, vocab, target)
    heads = MedusaHeads(num_heads, hidden, vocab, num_layers, shared_lm_head=False)
    params = dict(heads.named_parameters())
    with torch.no_grad():
        for key, (name, k, j) in key_map.items():
            slot = params[name][k] if j < 0 else params[name][k, j]
            if state[key].shape != slot.shape:
                raise SpecbenchError(f"{folder}: {key} has shape {tuple(state[key].shape)}, expected "
                                     f"{tuple(slot.shape)}")
            slot.copy_(state[key].float())
    return heads


# ---- static tree ----------------------------------------------------------------------------------
def resolve_choices(spec: str | Sequence[Sequence[int]]) -> list[RankPath]:
    """Rank paths from a built-in name, a JSON list string, or a list."""
    if isinstance(spec, str):
        if spec in BUILTIN_CHOICES:
            spec = BUILTIN_CHOICES[spec]
        elif spec.lstrip().startswith("["):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise SpecbenchError(f"medusa: choices is not valid JSON ({exc.msg})") from None
        else:
            raise SpecbenchError(f"medusa: unknown choices {spec!r}; use one of {', '.join(BUILTIN_CHOICES)} "
                                 "or a JSON list of rank paths such as [[0],[1],[0,0]]")
    paths = []
    for path in spec:
        if (not isinstance(path, (list, tuple)) or not path
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in path)):
            raise SpecbenchError(f"medusa: choice {path!r} must be a non-empty list of ranks >= 0")
        paths.append(tuple(path))
    return paths


@dataclass(eq=False)
class TreeSkeleton:
    """The static Medusa tree, built once: per node its head, rank and parent (topological order:
    shorter paths first, then lexicographic). Per iteration only token ids are gathered."""

    paths: list[RankPath]
    parents: torch.Tensor  # [N], -1 = child of the bonus
    depths: torch.Tensor  # [N], 1 = child of the bonus (node at depth d comes from head d-1)
    ancestors: torch.Tensor  # [N, N] bool: ancestor-or-self
    flat_index: torch.Tensor  # [N] on the heads' device: head * topk + rank into the flat [heads, topk] top-k
    path_sum: torch.Tensor  # [N, N] float on the heads' device: ancestors, to sum log-probs along paths
    num_heads: int  # heads the tree needs (= its depth)

    @classmethod
    def build(cls, choices: Sequence[RankPath], num_heads: int, topk: int,
              device: torch.device | str = "cpu") -> "TreeSkeleton":
        """Keep paths that need <= ``num_heads`` heads and ranks < ``topk``; require prefix closure."""
        paths = sorted({p for p in choices if len(p) <= num_heads and max(p) < topk}, key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(paths)}
        orphans = [list(p) for p in paths if len(p) > 1 and p[:-1] not in index]
        if orphans:
            raise SpecbenchError(f"medusa: choices are not prefix-closed: {orphans[:3]} lack their parent path")
        ancestors = torch.zeros(len(paths), len(paths), dtype=torch.bool)
        for i, p in enumerate(paths):
            ancestors[i, [index[p[:d]] for d in range(1, len(p) + 1)]] = True
        flat = [(len(p) - 1) * topk + p[-1] for p in paths]
        return cls(paths=paths,
                   parents=torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=torch.long),
                   depths=torch.tensor([len(p) for p in paths], dtype=torch.long), ancestors=ancestors,
                   flat_index=torch.tensor(flat, dtype=torch.long, device=device),
                   path_sum=ancestors.to(device, torch.float32), num_heads=max(map(len, paths), default=0))

    def __len__(self) -> int:
        return len(self.paths)

    def tree(self, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> DraftTree:
        """DraftTree from per-head top-k ids/log-probs [heads, topk]; scores = path log-probs."""
        tokens = top_ids.reshape(-1)[self.flat_index]
        scores = self.path_sum @ top_logprobs.float().reshape(-1)[self.flat_index]
        return DraftTree(tokens.cpu(), self.parents, scores=scores.cpu(), kind=SiblingKind.DETERMINISTIC).dedup()


# ---- drafter --------------------------------------------------------------------------------------
@dataclass
class MedusaOptions(drafter_weights("Heads folder", "ours or the official Medusa layout", "medusa")):
    topk: int = option(10, "Candidates per head (reference TOPK).", ge=1)
    choices: str = option("mc_sim_7b_63", "A built-in tree name or a JSON list of rank paths.")
    heads: int = option(0, "Use the first N heads; 0 = all in the checkpoint.", ge=0)
    # The published lists are ordered by estimated acceptance, and every prefix of mc_sim_7b_63 is
    # prefix-closed: smaller trees suit CPUs, where verify cost grows past ~16 nodes.
    max_nodes: int = option(0, "Keep only the first N paths of the tree; 0 = the whole list.", ge=0, tokens=True)

    def check(self, owner: str) -> None:
        resolve_choices(self.choices)  # a bad name or JSON fails before anything loads


class MedusaDrafter(Drafter):
    name = METHOD
    label = "Medusa"
    Options = MedusaOptions
    weight_options = ("path",)
    budget_option = "max_nodes"
    trainer = "methods.medusa.trainer:MedusaTrainer"
    taps = (-1,)  # the final-norm output that lm_head reads

    def __init__(self, options: MedusaOptions | None = None, heads: MedusaHeads | None = None) -> None:
        super().__init__(options)
        self.choices = resolve_choices(self.options.choices)
        if self.options.max_nodes:
            self.choices = self.choices[: self.options.max_nodes]
        self.heads = heads
        self.last_hidden: torch.Tensor | None = None

    def setup(self, target: Target) -> None:
        super().setup(target)
        heads = self.heads if self.heads is not None else load_medusa(self._folder(target), target)
        if self.options.heads:
            heads = heads.first_heads(self.options.heads)
        if heads.hidden != target.hidden_size or heads.vocab != target.vocab_size:
            raise SpecbenchError(f"medusa: heads are for hidden {heads.hidden} / vocab {heads.vocab}, target "
                                 f"{target.name!r} has {target.hidden_size} / {target.vocab_size}")
        heads.ensure_lm_head(target.model.get_output_embeddings())
        self.heads = heads.to(target.device, target.dtype).eval().requires_grad_(False)
        self.topk = min(self.options.topk, target.vocab_size)
        self.skeleton = TreeSkeleton.build(self.choices, heads.num_heads, self.topk, target.device)

    def _folder(self, target: Target) -> Path:
        shipped = shipped_drafter(target.name, METHOD)
        folder = self.resolve_weights("path", shipped, f"medusa needs trained heads for target {target.name!r}: pass "
                                      f"--opt path=FOLDER_OR_HUB_ID; {{path}} does not exist")
        if not (folder / "config.json").is_file():
            raise SpecbenchError(f"medusa needs trained heads for target {target.name!r}: pass --opt path=FOLDER "
                                 f"(our checkpoint or an official Medusa folder); {folder} has no config.json")
        return folder

    def begin(self, state: DecodeState, prefill) -> None:
        # The bonus came from the last prompt row's h, so that row seeds the first tree.
        self.last_hidden = prefill.taps[-1][-1:].clone()

    def observe(self, state: DecodeState, result: VerifyResult) -> None:
        # The last kept row (root or deepest accepted node) produced the new bonus.
        self.last_hidden = result.taps[-1][-1:].clone()

    def propose(self, state: DecodeState) -> DraftTree:
        if not len(self.skeleton):
            return DraftTree.empty()
        with torch.inference_mode(), state.timer.forward("drafter"):
            logits = self.heads(self.last_hidden, self.skeleton.num_heads)[:, 0].float()  # [K', V]
            top = torch.topk(logits, self.topk, dim=-1)
            top_lp = top.values - torch.logsumexp(logits, dim=-1, keepdim=True)
        with state.timer.phase("tree_build"):
            return self.skeleton.tree(top.indices, top_lp)

    def end(self, state: DecodeState) -> dict:
        return {"medusa_heads": self.skeleton.num_heads, "medusa_tree_nodes": len(self.skeleton)}

    # ---- batches: every request's heads in one forward -------------------------------------------
    batched_drafting = True

    def begin_batch(self, states, prefills) -> None:
        # per request, the hidden state that seeds its next tree (end_batch drops the rows that leave)
        self.row_hidden = getattr(self, "row_hidden", []) + [prefill.taps[-1][-1:].clone() for prefill in prefills]

    def observe_batch(self, states, results) -> None:
        self.row_hidden = [result.taps[-1][-1:].clone() for result in results]

    def end_batch(self, rows, states) -> list[dict]:
        gone = set(rows)
        self.row_hidden = [h for b, h in enumerate(self.row_hidden) if b not in gone]
        return [self.end(state) for state in states]

    def propose_batch(self, states) -> list[DraftTree]:
        if not len(self.skeleton):
            return [DraftTree.empty() for _ in states]
        with torch.inference_mode(), states[0].timer.forward("drafter"):
            logits = self.heads(torch.cat(self.row_hidden), self.skeleton.num_heads).float()  # [K', B, V]
            top = torch.topk(logits, self.topk, dim=-1)
            top_lp = top.values - torch.logsumexp(logits, dim=-1, keepdim=True)
        with states[0].timer.phase("tree_build"):
            return [self.skeleton.tree(top.indices[:, b], top_lp[:, b]) for b in range(len(states))]
