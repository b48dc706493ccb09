"""Self-speculation over the target's first layers (specbench/engine/split_verify.py): the split verify
equals a full forward (fp32), shallow states reach verify only as an argument, and the target
carries no state or method of its own for it."""

import warnings

import pytest
import torch

from drafters import RandomTreeDrafter, RandomTreeOptions
from methods.dvi import DVIDrafter, DVIOptions
from methods.sps import SpSDrafter, SpSOptions
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine import kvcache, split_verify
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.split_verify import ShallowStates, forward_shallow
from specbench.engine.target import Target
from specbench.engine.tree import DraftTree
from tiny import tiny_llama, tiny_target


def causal(model, ids, hidden=False):
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=hidden)


def ready(drafter, target):
    drafter.setup(target)
    return drafter


@pytest.mark.parametrize("layer", [1, 2, 3])
def test_shallow_then_split_verify_equals_full_forward(layer):
    target = tiny_target(0, layers=4)
    prompt, drafts = [3, 17, 5, 42, 8, 11], [9, 30, 2]
    target.prefill(prompt[:-1])
    states = ShallowStates(layer)
    for token in [prompt[-1]] + drafts:  # one token at a time, as a drafter feeds them
        forward_shallow(target, states, [token])
    compiled = target.compile_tree(prompt[-1], DraftTree.chain(drafts))
    assert states.covers(compiled, taps=(layer, -1))
    out = target.verify(compiled, taps=(layer, -1), shallow=states)
    ref = causal(target.model, prompt + drafts, hidden=True)
    rows = slice(len(prompt) - 1, None)
    torch.testing.assert_close(out.logits, ref.logits[0, rows], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.taps[layer], ref.hidden_states[layer][0, rows], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.taps[-1], ref.hidden_states[-1][0, rows], atol=1e-4, rtol=0)
    # commit compacts shallow and deep layers alike: the cache equals a fresh prefill.
    target.commit([0, 1])
    fresh = tiny_target(0, layers=4)
    fresh.prefill(prompt + drafts[:1])
    for ours, theirs in zip(target.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=2e-5, rtol=0)


def test_verify_of_other_tokens_discards_shallow_rows():
    target = tiny_target(1, layers=4)
    prompt = [3, 17, 5, 42]
    target.prefill(prompt[:-1])
    states = ShallowStates(2)
    forward_shallow(target, states, [prompt[-1], 7, 8])
    compiled = target.compile_tree(prompt[-1], DraftTree.chain([9]))  # not what was drafted: full forward
    out = target.verify(compiled, shallow=states)
    torch.testing.assert_close(out.logits, causal(target.model, prompt + [9]).logits[0, -2:], atol=1e-4, rtol=0)
    assert {layer.keys.shape[2] for layer in target.cache.layers} == {len(prompt) + 1}


def test_target_has_no_split_methods_or_state():
    for name in ("forward_shallow", "verify_from_layer", "check_split", "_split_parts", "_run_layers"):
        assert not hasattr(Target, name), name
    target = tiny_target(0, layers=4)
    target.prefill([1, 2, 3])
    states = ShallowStates(2)
    forward_shallow(target, states, [4, 5])
    # Nothing on the target refers to the shallow rows: they live in the caller's states object.
    assert not any(isinstance(v, ShallowStates) for v in vars(target).values())
    assert not hasattr(target, "timer")


def test_verify_without_shallow_states_never_takes_the_split_path(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("split path taken without shallow states")

    monkeypatch.setattr(split_verify, "verify_deep", refuse)
    target = tiny_target(1, layers=4)
    config = GenerationConfig(max_new_tokens=12)
    plain = generate(target, ready(RandomTreeDrafter(RandomTreeOptions(nodes=6, seed=2)), target), [5, 6, 7], config)
    chain = generate(target, ready(SpSDrafter(SpSOptions(gamma=3), model=tiny_llama(1, layers=4)), target),
                     [5, 6, 7], config)
    assert len(plain.new_tokens) == len(chain.new_tokens) == 12
    # Shallow rows written but not handed to verify: refused, not silently run on a dirty cache.
    target.prefill([1, 2, 3])
    forward_shallow(target, ShallowStates(2), [4, 5])
    with pytest.raises(ValueError, match="hand the shallow states"):
        target.verify(target.compile_tree(4, DraftTree.chain([5])))


def test_self_speculation_hands_its_states_through_the_engine(monkeypatch):
    calls = []
    real = split_verify.verify_deep
    monkeypatch.setattr(split_verify, "verify_deep", lambda *a, **k: calls.append(1) or real(*a, **k))
    target = tiny_target(2, layers=4)
    config = GenerationConfig(max_new_tokens=16)
    drafter = ready(DVIDrafter(DVIOptions(layer=2, k=3)), target)
    record = generate(target, drafter, [3, 17, 5], config)
    assert len(calls) == record.n_verify > 0  # every verify ran only the deep layers
    baseline = generate(target, ready(VanillaDrafter(), target), [3, 17, 5], config)
    assert record.new_tokens == baseline.new_tokens  # lossless
    assert record.forwards["drafter"] == record.n_verify * 4  # k drafts + the last draft's shallow pass


def test_forward_shallow_refuses_pending_rows_of_other_states():
    target = tiny_target(0, layers=4)
    target.prefill([1, 2, 3])
    forward_shallow(target, ShallowStates(2), [4])
    with pytest.raises(ValueError, match="another ShallowStates"):
        forward_shallow(target, ShallowStates(2), [4])


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
