"""Speculative sampling (SpS): ``drafter`` (``sps``: a draft model's chain), ``confidence``
(``sps-confidence``: assisted generation's adaptive length), ``student`` (a distilled draft model and
`specbench train sps-student`) and ``report`` (its verify cost across γ, a note under the cost table)."""
