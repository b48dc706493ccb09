"""A drafter's own causal LM over one request's tokens, in the run's engine (SpS's draft model, PACER's).

``DraftLM.forward(ids, start)`` runs tokens at positions start.. after the first ``start`` cached ones and
returns the last one's logits (and every hidden state when asked); ``truncate(n)`` keeps the first n. With the eager
engine the model runs over a ``DynamicCache``; with the compiled engine over ``CompiledForward`` (a static cache
and graphs per row bucket), the target's own treatment, so a draft model is never the slow side of a fast engine.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch

from specbench.engine import kvcache
from specbench.engine.compiled_forward import CompiledForward
from specbench.engine.timing import NULL_TIMER, PhaseTimer


class DraftLM:
    def __init__(self, model, engine: str = "eager", max_context: int | None = None) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        context = max_context or getattr(model.config, "max_position_embeddings", None) or 2048
        self.static = CompiledForward(model, 1, context) if engine == "compiled" else None
        self.reset()

    def reset(self) -> None:
        """An empty cache for a new request."""
        if self.static is not None:
            self.static.cache.rows = 0
        else:
            from transformers import DynamicCache

            self.cache = DynamicCache()

    def fresh(self) -> "DraftLM":
        """This model with an empty cache for a new request: eagerly a cache of its own (each fork of a batch
        keeps one), compiled the same static one (the compiled engine decodes one request at a time)."""
        twin = copy.copy(self)
        twin.reset()
        return twin

    def __len__(self) -> int:
        """Positions cached."""
        return self.static.cache.rows if self.static is not None else kvcache.seq_length(self.cache)

    def reserve(self, tokens: int) -> None:
        if self.static is not None:
            self.static.reserve(tokens)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` cached positions."""
        if self.static is not None:
            self.static.cache.rows = min(self.static.cache.rows, n)
        else:
            kvcache.truncate(self.cache, n)

    def forward(self, ids: Sequence[int], start: int, hidden: bool = False, timer: PhaseTimer = NULL_TIMER
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """The last row's logits [1, V] of ``ids`` at positions start.. (cached after the first ``start``), and with
        ``hidden`` every hidden state of every row [n, H] (HF order). ``timer``: the clock graph builds are taken
        out of."""
        x = torch.tensor(list(ids), dtype=torch.long, device=self.device)
        if self.static is not None:
            return self.static.run_causal(x, start, hidden, timer)
        positions = torch.arange(start, start + len(x), device=self.device)[None]
        with torch.inference_mode():
            out = self.model(input_ids=x[None], position_ids=positions, use_cache=True, output_hidden_states=hidden,
                             **kvcache.cache_arg(self.model, self.cache))
        return out.logits[0, -1:], (tuple(h[0] for h in out.hidden_states) if hidden else None)
