"""Methods whose authors' code cannot give a parity row, registered so the table says why instead of
leaving them out silently. ``specbench parity ROW`` refuses them with the reason; ``--all`` skips them."""

from __future__ import annotations


class DVIAuthorsRepository:
    name = "dvi"
    reference = "the first author's working repository (github.com/shrenikbhansali/DVI)"
    unavailable = (
        "the only public code is the first author's working repository, github.com/shrenikbhansali/DVI (main @ "
        "d34e3b320a96, a fork of Equationliu/Kangaroo), with no licence file in any commit and a transformers 4.33 "
        "pin. Run once from outside the project, in a separate virtual environment (torch 2.13.0+cpu, transformers "
        "4.33.3, peft 0.6.2; nothing of theirs edited, only a 4.33-readable copy of the target's config and "
        "tokenizer), its decode loop (training/spec_decode.py generate_with_dvi_spec) and its online KL->RL update "
        "loop run on a CPU on SmolLM2-135M split at layer 15 of 30, but its text equals greedy decoding on 0 of 2 "
        "HumanEval prompts: the loop feeds the last committed token in a second time after the prefill and after every "
        "rejected draft (emulating that double feed with the plain model reproduces its 48 + 48 tokens exactly), and "
        "the drafter's LoRA on the shallow layers also feeds the verifier, so a trained drafter changes the verifier. "
        "It is not lossless, so it cannot be a reference for a lossless DVI; its acceptance was 0 with the head "
        "untrained and 0.04 tokens per block after 10 online steps, at 0.5-0.9 tok/s against 4-6 tok/s for plain "
        "greedy (verification and the prefill run one token at a time). The paper's numbers are compared instead.")


class PacerNoCode:
    name = "pacer"
    reference = "none published"
    unavailable = ("no public code of PACER was found (the paper promises none); the report compares our PACER with "
                   "the paper's own numbers instead.")
