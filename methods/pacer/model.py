"""PACER's blockwise pre-verification layer M_B (docs/methods.md#pacer)."""

from __future__ import annotations

import copy

import torch

from specbench.engine import kvcache


class PreVerifier(torch.nn.Module):
    """One decoder layer of the draft model's architecture and width, a final norm, a learned
    draft-position embedding (row 0 = committed token, fixed at zero) and a scalar acceptance head."""

    def __init__(self, draft_config, window: int, use_pos: bool = True) -> None:
        super().__init__()
        from transformers import AutoModel

        cfg = copy.deepcopy(draft_config)
        cfg.num_hidden_layers = 1
        cfg.vocab_size = 1  # inputs are hidden states; the token embedding is never read
        cfg.pad_token_id = None
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[-1:]
        self.body = AutoModel.from_config(cfg)
        self.window, self.use_pos = window, use_pos
        self.pos = torch.nn.Embedding(window + 1, cfg.hidden_size, padding_idx=0) if use_pos else None
        if self.pos is not None:
            torch.nn.init.normal_(self.pos.weight, std=0.02)
            with torch.no_grad():
                self.pos.weight[0].zero_()
        self.head = torch.nn.Linear(cfg.hidden_size, 1)
        self.hidden_size = cfg.hidden_size

    def scale_positions_to(self, states: torch.Tensor) -> float:
        """Redraw e_1.. at the scale of the draft states they are added to (their RMS per coordinate): at
        std 0.02 beside a 0.5B draft's states (RMS 6.5) the draft position is invisible after the input norm and
        the layer scores worse than position alone. Returns the std used."""
        std = float(states.float().pow(2).mean().sqrt())
        if self.pos is not None:
            with torch.no_grad():
                self.pos.weight.normal_(0.0, std)
                self.pos.weight[0].zero_()
        return std

    def init_from_draft(self, draft_model) -> None:
        """Start from the draft model's last decoder layer and final norm (a pretrained layer of the
        right width learns faster on 200 examples than a random one)."""
        self.body.layers[0].load_state_dict(draft_model.model.layers[-1].state_dict())
        self.body.norm.load_state_dict(draft_model.model.norm.state_dict())

    def forward(self, hidden: torch.Tensor, draft_pos: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Acceptance logits [B, T] for rows ``hidden`` [B, T, H] (draft_pos 0 = committed)."""
        x = hidden.to(self.head.weight.dtype)
        if self.pos is not None:
            x = x + self.pos(draft_pos.clamp(max=self.window))
        out = self.body(inputs_embeds=x, position_ids=position_ids, attention_mask=attention_mask,
                        use_cache=cache is not None, **kvcache.cache_arg(self.body, cache))
        return self.head(out.last_hidden_state).squeeze(-1)

    def trainable_parameters(self) -> int:
        """Parameters that are used (the 1-row token embedding never is)."""
        return sum(p.numel() for n, p in self.named_parameters() if not n.startswith("body.embed_tokens"))
