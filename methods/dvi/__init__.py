"""DVI (Draft, Verify & Improve): self-speculation with a draft head that learns while serving; the drafter
(``drafter.py``), its options, losses and schedule (``options.py``, ``objectives.py``), the LoRA head
(``head.py``) and the replay buffer (``replay.py``)."""

from methods.dvi.drafter import DVICEDrafter, DVIDrafter, DVIKLDrafter, DVIPGDrafter
from methods.dvi.head import HEAD_FILE, DraftHead
from methods.dvi.objectives import Weights, kl_to, reinforce, reward_masked_ce, schedule
from methods.dvi.options import DVICEOptions, DVIKLOptions, DVIOptions, DVIPGOptions, Objective
from methods.dvi.replay import ReplayBuffer

__all__ = ["DVICEDrafter", "DVIDrafter", "DVIKLDrafter", "DVIPGDrafter", "HEAD_FILE", "DraftHead", "Weights", "kl_to",
           "reinforce", "reward_masked_ce", "schedule", "DVICEOptions", "DVIKLOptions", "DVIOptions", "DVIPGOptions",
           "Objective", "ReplayBuffer"]
