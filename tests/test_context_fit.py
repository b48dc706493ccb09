"""The context refusals a run makes once the target is loaded (specbench/run/context_fit.py)."""

import pytest

from specbench.errors import SpecbenchError
from specbench.run.context_fit import TREE_SLACK, ContextFit


def test_a_turn_that_fits_passes_and_one_that_does_not_names_the_fix():
    fit = ContextFit(context=1000, max_new_tokens=100)
    assert fit.turn(1000 - 100 - TREE_SLACK, "b/1") is None
    with pytest.raises(SpecbenchError, match=r"needs 1001 tokens .*--max-new-tokens 99 or less") as err:
        fit.turn(1000 - 100 - TREE_SLACK + 1, "b/1")
    assert "\n" not in str(err.value)
    with pytest.raises(SpecbenchError, match="no --max-new-tokens fits it; pass --on-long-prompt skip"):
        fit.turn(1000, "b/1")  # the prompt alone is past the context: lowering --max-new-tokens cannot help


def test_skip_returns_the_line_it_prints_and_refuses_only_when_nothing_fits():
    fit = ContextFit(context=1000, max_new_tokens=100, on_long_prompt="skip")
    assert fit.turn(800, "b/7").startswith("skipped: prompt b/7 needs 1028 tokens")
    fit.check_some_prompt_fits(iter([900, 10, 950]), "b")  # one fits
    with pytest.raises(SpecbenchError, match=r"every prompt of b .*the shortest is 800 tokens.*--max-new-tokens 72 or less"):
        fit.check_some_prompt_fits([900, 800], "b")
    ContextFit(1000, 100).check_some_prompt_fits([900], "b")  # fail refuses per turn, not here


def test_max_new_tokens_past_the_context_is_refused_before_any_side():
    with pytest.raises(SpecbenchError, match="--max-new-tokens 1000 does not fit the target's context of 1000"):
        ContextFit(1000, 1000).check_answerable([])
