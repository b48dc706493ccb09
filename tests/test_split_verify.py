"""The layer hook for self-speculation (``Target.run_layers``, specbench/engine/split_verify.py): the
split verify equals a full forward (fp32), rows not verified as run are dropped, and neither the draft
tree nor ``verify``'s signature carries anything of one method."""

import inspect
import warnings

import pytest
import torch

from drafters import RandomTreeDrafter, RandomTreeOptions
from methods.dvi import DVIDrafter, DVIOptions
from methods.sps.drafter import SpSDrafter, SpSOptions
from specbench.engine import kvcache, split_verify
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.target import Target
from specbench.engine.tree import DraftTree
from specbench.engine.vanilla import VanillaDrafter
from tiny import tiny_llama, tiny_target


def causal(model, ids, hidden=False):
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=hidden)


def ready(drafter, target):
    drafter.setup(target)
    return drafter


@pytest.mark.parametrize("layer", [1, 2, 3])
def test_run_layers_then_verify_equals_full_forward(layer):
    target = tiny_target(0, layers=4)
    prompt, drafts = [3, 17, 5, 42, 8, 11], [9, 30, 2]
    target.prefill(prompt[:-1])
    for token in [prompt[-1]] + drafts:  # one token at a time, as a drafter feeds them
        hidden = target.run_layers([token], layer)
    compiled = target.compile_tree(prompt[-1], DraftTree.chain(drafts))
    assert target.pending_layers.covers(compiled.root, compiled.tree, taps=(layer, -1))
    out = target.verify(compiled, taps=(layer, -1))
    assert target.pending_layers is None
    ref = causal(target.model, prompt + drafts, hidden=True)
    rows = slice(len(prompt) - 1, None)
    torch.testing.assert_close(hidden, ref.hidden_states[layer][0, -1:], atol=1e-4, rtol=0)  # the hook's answer
    torch.testing.assert_close(out.logits, ref.logits[0, rows], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.taps[layer], ref.hidden_states[layer][0, rows], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.taps[-1], ref.hidden_states[-1][0, rows], atol=1e-4, rtol=0)
    # commit compacts shallow and deep layers alike: the cache equals a fresh prefill.
    target.commit([0, 1])
    fresh = tiny_target(0, layers=4)
    fresh.prefill(prompt + drafts[:1])
    for ours, theirs in zip(target.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=2e-5, rtol=0)


def test_verify_of_other_tokens_drops_the_pending_rows():
    target = tiny_target(1, layers=4)
    prompt = [3, 17, 5, 42]
    target.prefill(prompt[:-1])
    target.run_layers([prompt[-1], 7, 8], 2)
    compiled = target.compile_tree(prompt[-1], DraftTree.chain([9]))  # not what was drafted: full forward
    out = target.verify(compiled)
    torch.testing.assert_close(out.logits, causal(target.model, prompt + [9]).logits[0, -2:], atol=1e-4, rtol=0)
    assert {layer.keys.shape[2] for layer in target.cache.layers} == {len(prompt) + 1}


def test_the_protocol_carries_no_method_field():
    # One general hook on the target; the tree and verify know nothing of who used it.
    assert "shallow" not in DraftTree.__dataclass_fields__
    assert list(inspect.signature(Target.verify).parameters) == ["self", "compiled", "taps", "timer"]
    assert list(inspect.signature(DraftTree.chain).parameters) == ["tokens", "q", "kind"]
    target = tiny_target(0, layers=4)
    target.prefill([1, 2, 3])
    target.run_layers([4, 5], 2)
    assert not hasattr(target, "timer")
    target.prefill([1, 2, 3])  # a new prompt drops the rows run for the last one
    assert target.pending_layers is None and target.cache_length() == 3


def test_verify_without_run_layers_never_takes_the_split_path(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("split path taken without rows run through the first layers")

    monkeypatch.setattr(split_verify, "finish", refuse)
    target = tiny_target(1, layers=4)
    config = GenerationConfig(max_new_tokens=12)
    plain = generate(target, ready(RandomTreeDrafter(RandomTreeOptions(nodes=6, seed=2)), target), [5, 6, 7], config)
    chain = generate(target, ready(SpSDrafter(SpSOptions(gamma=3), model=tiny_llama(1, layers=4)), target),
                     [5, 6, 7], config)
    assert len(plain.new_tokens) == len(chain.new_tokens) == 12


def test_self_speculation_runs_only_the_deep_layers_at_verify(monkeypatch):
    calls = []
    real = split_verify.finish
    monkeypatch.setattr(split_verify, "finish", lambda *a, **k: calls.append(1) or real(*a, **k))
    target = tiny_target(2, layers=4)
    config = GenerationConfig(max_new_tokens=16)
    drafter = ready(DVIDrafter(DVIOptions(layer=2, k=3)), target)
    record = generate(target, drafter, [3, 17, 5], config)
    assert len(calls) == record.n_verify > 0  # every verify ran only the deep layers
    baseline = generate(target, ready(VanillaDrafter(), target), [3, 17, 5], config)
    assert record.new_tokens == baseline.new_tokens  # lossless
    assert record.forwards["drafter"] == record.n_verify * 4  # k drafts + the last draft's first-layers pass


def test_run_layers_refuses_another_layer_while_rows_are_pending():
    target = tiny_target(0, layers=4)
    target.prefill([1, 2, 3])
    target.run_layers([4], 2)
    with pytest.raises(ValueError, match="pending"):
        target.run_layers([5], 3)


def test_cache_is_passed_by_the_keyword_the_installed_transformers_takes():
    """Newer transformers renamed ``past_key_values`` to ``cache`` and warn on the old name; once the
    old name is dropped a forward would ignore the cache. Neither the target's forwards nor the split
    layers' nor a draft model's may trigger that warning, and the keyword follows the signature."""
    assert kvcache.cache_keyword(lambda x, cache=None: x) == "cache"
    assert kvcache.cache_keyword(lambda x, past_key_values=None: x) == "past_key_values"
    target = tiny_target(2, layers=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for drafter in (DVIDrafter(DVIOptions(layer=2, k=3)), SpSDrafter(SpSOptions(gamma=3), model=tiny_llama(1))):
            generate(target, ready(drafter, target), [3, 17, 5], GenerationConfig(max_new_tokens=8))
    assert not [w for w in caught if "past_key_values" in str(w.message)]
