"""Device handling that a CPU can check: device/dtype choice and its errors, random draws on the
generator's device, autocast on the model's device, the CPU timing path, and the tree mask built
from the parent vector on the tree's device (equal to the host-built one)."""

from __future__ import annotations

import time

import pytest
import torch

from drafters import RandomTreeDrafter, RandomTreeOptions, random_tree
from methods.sps.drafter import SpSDrafter, SpSOptions
from bench_data import needs_data
from specbench.engine.vanilla import VanillaDrafter
from specbench.engine import devices, kvcache, verify
from specbench.engine.devices import choose_dtype, resolve_device
from specbench.engine.loop import GenerationConfig, generate
from specbench.errors import SpecbenchError
from specbench.engine.target import check_attention
from specbench.engine.timing import NullTimer, PhaseTimer
from specbench.training.trainer import autocast_for
from specbench.engine.tree import verify_visibility
from specbench.engine.verify import SamplingParams
from test_cli import cli
from tiny import tiny_llama, tiny_target


def ready(drafter, target):
    drafter.setup(target)
    return drafter


# ---- --device -------------------------------------------------------------------------------------
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_auto_device_follows_cuda_availability(monkeypatch):
    no_cuda(monkeypatch)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    two_gpus(monkeypatch)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:1") == "cuda:1"


@pytest.mark.parametrize("spec,fake,message", [
    ("cuda", no_cuda, "CUDA is not available"),
    ("cuda:0", no_cuda, "CUDA is not available"),
    ("tpu", no_cuda, "unknown device 'tpu'"),
    ("mps", no_cuda, "not supported"),
    ("cuda:7", two_gpus, "has 2 CUDA device(s)"),
])
def test_unavailable_or_unknown_devices_are_one_line_errors(monkeypatch, spec, fake, message):
    fake(monkeypatch)
    with pytest.raises(SpecbenchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_device(spec)


@pytest.mark.parametrize("args,message", [
    (["run", "--device", "tpu"], "unknown device 'tpu'"),
    (["run", "--device", "cuda"], "CUDA is not available"),
    (["run", "--device", "cuda:7"], "CUDA device(s)"),
    # train reads its default prompt file (train_prompts/) first: without the bench data it stops there
    pytest.param(["train", "data", "--device", "tpu"], "unknown device 'tpu'", marks=needs_data),
    pytest.param(["train", "eagle3", "--out", "unused", "--device", "cuda"], "CUDA is not available", marks=needs_data),
])
def test_cli_refuses_bad_devices_before_loading_anything(monkeypatch, capsys, args, message):
    if "cuda:7" in args:
        two_gpus(monkeypatch)
    else:
        no_cuda(monkeypatch)
    loads = []
    monkeypatch.setattr("specbench.engine.target.load_causal_lm", lambda *a, **k: loads.append(a))
    if args[0] == "run":
        args = args + ["--method", "vanilla", "--bench", "humaneval", "--limit", "1", "--no-warmup"]
    code, _, err = cli(args, capsys)
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not loads


def test_flash_attention_choice_errors():
    with pytest.raises(SpecbenchError, match="needs a CUDA device"):
        check_attention("flash", "cpu")
    with pytest.raises(SpecbenchError, match="not supported"):
        check_attention("flash_attention_3", "cpu")
    check_attention("sdpa", "cpu")
    check_attention("eager", "cpu")


# ---- --dtype auto ---------------------------------------------------------------------------------
@pytest.mark.parametrize("device,flags,dtype,reason", [
    ("cuda", set(), "bfloat16", "cuda"),
    ("cuda:1", {"avx2"}, "bfloat16", "cuda"),
    ("cpu", {"avx2", "avx512f", "avx512_bf16"}, "bfloat16", "cpu has avx512_bf16"),
    ("cpu", {"avx2", "amx_bf16", "amx_tile"}, "bfloat16", "cpu has amx_bf16"),
    ("cpu", {"avx2", "avx512f"}, "float32", "no native bf16"),
    ("cpu", set(), "float32", "no native bf16"),
])
def test_auto_dtype_choice(device, flags, dtype, reason):
    chosen, why = choose_dtype("auto", device, flags)
    assert chosen == dtype and reason in why
    assert choose_dtype("float32", device, flags) == ("float32", "requested")


def test_auto_dtype_reads_this_machines_cpu_flags(monkeypatch):
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"sse4_2", "amx_bf16"})
    assert choose_dtype("auto", "cpu") == ("bfloat16", "cpu has amx_bf16")
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"sse4_2"})
    assert choose_dtype("auto", "cpu")[0] == "float32"


def test_training_resolves_auto_and_warns_where_bf16_is_emulated(monkeypatch, capsys):
    from specbench.training.cli import training_dtype

    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2"})  # an AVX2-only CPU
    assert devices.emulated_bf16("cpu") and training_dtype("auto", "cpu") == "float32"
    assert "no native bf16" not in capsys.readouterr().err
    assert training_dtype("bfloat16", "cpu") == "bfloat16"  # kept, with a one-line warning
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "no native bf16" in warning[0] and "--dtype auto or float32" in warning[0]
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert not devices.emulated_bf16("cpu") and training_dtype("auto", "cpu") == "bfloat16"
    assert training_dtype("bfloat16", "cpu") == "bfloat16" and not capsys.readouterr().err


# ---- random draws on the generator's device -------------------------------------------------------
def test_every_engine_draw_uses_the_generators_device(monkeypatch):
    """Rules A, B, C and the drafters' own draws: uniforms are made with device=gen.device and
    multinomials get probabilities on gen.device (on CUDA, a CPU draw with a CUDA generator fails)."""
    seen = []
    rand, multinomial = torch.rand, torch.multinomial

    def spy_rand(*args, generator=None, device=None, **kw):
        if generator is not None:
            seen.append(("rand", device, generator.device))
        return rand(*args, generator=generator, device=device, **kw)

    def spy_multinomial(probs, n, *args, generator=None, **kw):
        if generator is not None:
            seen.append(("multinomial", probs.device, generator.device))
        return multinomial(probs, n, *args, generator=generator, **kw)

    monkeypatch.setattr(torch, "rand", spy_rand)
    monkeypatch.setattr(torch, "multinomial", spy_multinomial)
    target = tiny_target(4, vocab=8, init=0.3)
    params = SamplingParams(temperature=1.0)
    from drafters import SampledTreeDrafter, SampledTreeOptions
    from specbench.engine.verify import TreeRule

    for drafter, rule in [(SpSDrafter(SpSOptions(gamma=3), model=tiny_llama(5, vocab=8, init=0.3)), None),
                          (RandomTreeDrafter(RandomTreeOptions(nodes=5, seed=3)), TreeRule.RECURSIVE_REJECTION),
                          (RandomTreeDrafter(RandomTreeOptions(nodes=5, seed=3)), None),
                          (SampledTreeDrafter(SampledTreeOptions(width=2, depth=2), model=tiny_llama(6, vocab=8)), None)]:
        config = GenerationConfig(max_new_tokens=12, sampling=params, seed=1, tree_rule=rule)
        generate(target, ready(drafter, target), [1, 4, 2], config)
    kinds = {kind for kind, _, _ in seen}
    assert kinds == {"rand", "multinomial"}
    assert all(where == gen for _, where, gen in seen), seen


def test_seeded_draws_are_unchanged_on_cpu():
    """The device-explicit draws are the same random stream as before on a CPU generator."""
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    ours = [verify.draw(probs, gen_a) for _ in range(20)] + [verify._uniform(gen_a) for _ in range(5)]
    plain = [int(torch.multinomial(probs, 1, generator=gen_b)) for _ in range(20)]
    plain += [float(torch.rand((), generator=gen_b)) for _ in range(5)]
    assert ours == plain


# ---- autocast on the model's device ---------------------------------------------------------------
def test_autocast_follows_the_model_device():
    ac = autocast_for(torch.nn.Linear(2, 2), "bfloat16")
    assert ac.device == "cpu" and ac.fast_dtype == torch.bfloat16 and ac._enabled
    assert not autocast_for(torch.nn.Linear(2, 2), "float32")._enabled
    with torch.device("meta"):
        meta = torch.nn.Linear(2, 2)
    # The device type is read off the parameters (meta has no autocast, so torch names it).
    with pytest.raises(RuntimeError, match="meta"):
        autocast_for(meta, "bfloat16")


# ---- timing (CPU path) ----------------------------------------------------------------------------
def test_cpu_phase_times_sum_within_wall_and_forwards_are_counted():
    target = tiny_target(0)
    drafter = ready(SpSDrafter(SpSOptions(gamma=3), model=tiny_llama(1)), target)
    start = time.perf_counter()
    record = generate(target, drafter, [3, 17, 5], GenerationConfig(max_new_tokens=20))
    wall = time.perf_counter() - start
    times = record.times
    assert {"prefill", "draft", "compile", "verify", "commit"} <= set(times) and all(v > 0 for v in times.values())
    top = times["prefill"] + times["draft"] + times["compile"] + times["verify"] + times["commit"]
    assert top <= wall
    assert record.forwards["target"] == record.n_verify  # decode forwards only (prefill cleared)
    assert record.forwards["drafter"] >= record.n_verify
    assert 0 < record.forward_times["target"] <= times["verify"]


def test_timer_cpu_path_is_perf_counter_and_untimed_engine_records_nothing():
    timer = PhaseTimer("cpu")
    with timer.phase("a"):
        with timer.forward("target"):
            time.sleep(0.002)
        with timer.phase("inner"):
            pass
    assert not timer._pending and timer.ns["a"] >= timer.forward_ns["target"] >= 2_000_000
    assert timer.forward_calls["target"] == 1
    target = tiny_target(0)
    record = generate(target, ready(VanillaDrafter(), target), [1, 2], GenerationConfig(max_new_tokens=5),
                      timer=NullTimer())
    assert record.times == {} and len(record.new_tokens) == 5


# ---- tree mask on the device -----------------------------------------------------------------------
def old_mask(target, tree) -> torch.Tensor:
    """The host-built mask verify used before (kept here as the reference)."""
    q = len(tree) + 1
    visible = torch.ones(q, target.length + q, dtype=torch.bool)
    visible[:, target.length:] = tree.verify_mask()
    mask = torch.zeros(q, target.length + q, dtype=target.dtype)
    mask.masked_fill_(~visible, torch.finfo(target.dtype).min)
    return mask[None, None]


@pytest.mark.parametrize("n", [1, 2, 7, 33, 64])
def test_device_built_mask_and_positions_equal_the_host_built_ones(n):
    gen = torch.Generator().manual_seed(n)
    target = tiny_target(0)
    target.prefill([1, 2, 3, 4])
    for _ in range(3):
        tree = random_tree(n, 64, gen, max_children=2 if n > 20 else 3)
        visible = verify_visibility(tree.parents)
        assert visible.device == tree.parents.device
        assert torch.equal(visible, tree.verify_mask())
        assert torch.equal(visible.sum(1) - 1, tree.position_offsets())
        assert torch.equal(target._tree_mask(visible), old_mask(target, tree))
    deep = torch.arange(n) - 1  # a chain: the deepest closure
    assert torch.equal(verify_visibility(deep)[1:, 1:], torch.ones(n, n, dtype=torch.bool).tril())


def test_mask_buffer_is_reused_across_verifies():
    target = tiny_target(1)
    drafter = ready(RandomTreeDrafter(RandomTreeOptions(nodes=6, seed=2), oracle=target.model), target)
    generate(target, drafter, [5, 6, 7], GenerationConfig(max_new_tokens=10))
    buffer = target._mask_buffer
    assert buffer is not None and buffer.device == target.device
    ptr = buffer.data_ptr()
    generate(target, drafter, [5, 6, 7], GenerationConfig(max_new_tokens=10))
    assert target._mask_buffer.data_ptr() == ptr


def test_chain_attention_switch_is_per_call_and_lossless():
    """--attn flash's mechanism (a second kernel for prefill and chains, the loaded one for trees)
    checked with eager as the chain kernel: greedy output still equals vanilla."""
    target = tiny_target(1)
    config = GenerationConfig(max_new_tokens=24)
    plain = generate(target, ready(VanillaDrafter(), target), [5, 6, 7], config).new_tokens
    used = []
    forward = target.model.forward

    def spy(*args, **kwargs):
        # the target's own forwards (not the test oracle's) pass a cache
        if kvcache.cache_keyword(type(target.model).forward) in kwargs:
            used.append((target.config._attn_implementation, kwargs.get("attention_mask") is not None))
        return forward(*args, **kwargs)

    target.model.forward = spy
    target.use_chain_attention("eager")
    tree = ready(RandomTreeDrafter(RandomTreeOptions(nodes=6, seed=2), oracle=target.model), target)
    assert generate(target, tree, [5, 6, 7], config).new_tokens == plain
    chain = ready(SpSDrafter(SpSOptions(gamma=3), model=tiny_llama(1)), target)
    assert generate(target, chain, [5, 6, 7], config).new_tokens == plain
    assert ("eager", False) in used and ("sdpa", True) in used
    assert all(impl == ("sdpa" if masked else "eager") for impl, masked in used)
    assert target.config._attn_implementation == "sdpa"


def test_chain_attention_reaches_the_attention_layers(monkeypatch):
    import transformers.models.llama.modeling_llama as llama

    calls = []
    eager = llama.eager_attention_forward
    monkeypatch.setattr(llama, "eager_attention_forward", lambda *a, **k: calls.append(1) or eager(*a, **k))
    target = tiny_target(0)
    target.prefill([1, 2, 3])
    assert not calls
    target.use_chain_attention("eager")
    target.prefill([1, 2, 3])
    assert len(calls) == target.num_layers


def test_run_header_records_resolved_device_dtype_and_reason(models, tmp_path, capsys, monkeypatch):
    import json

    no_cuda(monkeypatch)
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2"})  # a CPU without native bf16
    out = tmp_path / "run.jsonl"
    code, _, err = cli(["run", "--method", "vanilla", "--bench", "humaneval", "--target", models["target"],
                        "--max-new-tokens", "3", "--limit", "1", "--no-warmup", "--out", str(out)], capsys)
    assert code == 0, err
    meta = json.loads(out.read_text().splitlines()[0])["meta"]
    assert meta["device"] == "cpu" and meta["dtype"] == "float32"
    assert "no native bf16" in meta["dtype_reason"] and meta["cpu"]
