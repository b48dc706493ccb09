"""Hub ids for targets and drafters, served offline from a local HF cache laid out as
huggingface_hub writes it (models--org--name/{blobs,refs,snapshots/<sha>}); every published drafter
layout loads by hub id; resolved commit shas and the prompt format reach the results header; bad
references are one-line errors (exit 2, nothing written)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from methods.dflash.drafter import DFlashDrafter, DFlashOptions
from methods.eagle3.drafter import Eagle3Drafter, Eagle3Options, eagle3_taps
from methods.medusa.drafter import MedusaDrafter, MedusaOptions
from methods.specblock.drafter import SpecBlockDrafter, SpecBlockOptions
from specbench.engine import hub
from specbench.engine.loop import GenerationConfig, generate
from specbench.errors import SpecbenchError
from specbench.engine.prompts import ChatFormat, parse_template_kwargs, render_chat, vicuna_v1_1
from specbench.training.vocab import build_vocab_mapping
from test_cli import base_args, cli, read
from test_eagle3 import published_config, published_weights, write_published
from test_lossless import baseline, ready
from tiny import tiny_target

LAYERS, VOCAB = 8, 64
SHA = "a" * 40


def publish(cache: Path, repo_id: str, folder: Path, sha: str = SHA, refs: tuple[str, ...] = ("main",)) -> Path:
    """Put ``folder``'s files into ``cache`` the way huggingface_hub does: content in blobs/, the
    commit's files as symlinks under snapshots/<sha>/, refs/<branch or tag> holding the sha."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / sha
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in folder.rglob("*"):
        if file.is_file():
            blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
            shutil.copyfile(file, blob)
            link = snapshot / file.relative_to(folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path("../" * (len(file.relative_to(folder).parts) + 1)) / "blobs" / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(sha)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hf-cache"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


@pytest.fixture(scope="module")
def target():
    return tiny_target(0, layers=LAYERS, init=0.5)


def matches_baseline(target, drafter, n: int = 16) -> None:
    config = GenerationConfig(max_new_tokens=n)
    record = generate(target, drafter, [3, 17, 5, 42, 8], config)
    assert record.new_tokens == baseline(target, [3, 17, 5, 42, 8], config)


# ---- references --------------------------------------------------------------------------------
def test_local_paths_and_hub_ids_resolve_offline(cache, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    publish(cache, "org/drafter", src, SHA, refs=("main",))
    publish(cache, "org/drafter", src, "b" * 40, refs=("v1",))
    assert hub.resolve(str(src)).sha is None and hub.resolve(str(src)).path == src
    main = hub.resolve("org/drafter")
    assert (main.repo_id, main.revision, main.sha) == ("org/drafter", None, SHA)
    assert (main.path / "config.json").read_text() == "{}"
    assert hub.resolve("org/drafter@v1").sha == "b" * 40 == hub.resolve("org/drafter", "v1").sha
    assert hub.resolve("org/drafter", SHA).sha == SHA


@pytest.mark.parametrize("spec,revision,match", [
    ("org/absent", None, "not in the local HF cache.*HF_HUB_OFFLINE"),
    ("org/drafter@v9", None, "no revision 'v9'.*cached: main"),
    ("org/drafter@v1", "v2", "keep one"),
    ("./no/such/folder", None, "does not exist"),
    ("not a hub id/x", None, "neither an existing folder nor a hub id"),
])
def test_bad_references_are_one_line(cache, tmp_path, spec, revision, match):
    (tmp_path / "src").mkdir()
    publish(cache, "org/drafter", tmp_path / "src")
    with pytest.raises(SpecbenchError, match=match) as err:
        hub.resolve(spec, revision)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("error,status,match", [
    ("GatedRepoError", 401, "gated repo.*HF_TOKEN"),
    ("RevisionNotFoundError", 404, "has no revision 'v9'"),
    ("RepositoryNotFoundError", 404, "not found on the Hub.*HF_TOKEN"),
])
def test_online_hub_errors_are_one_line(monkeypatch, error, status, match):
    """What the Hub answers (gated repo without a token, unknown revision, unknown repo), as one line."""
    import httpx2 as httpx
    import huggingface_hub
    from huggingface_hub import errors

    def answer(*args, **kwargs):
        request = httpx.Request("GET", "https://huggingface.co/api/models/meta-llama/Llama-3.1-8B-Instruct")
        raise getattr(errors, error)(f"{status}", response=httpx.Response(status, request=request))

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", answer)
    with pytest.raises(SpecbenchError, match=match) as err:
        hub.resolve("meta-llama/Llama-3.1-8B-Instruct@v9", what="target")
    assert "\n" not in str(err.value)


# ---- EAGLE-3 layouts -----------------------------------------------------------------------------
def eagle3_folder(folder: Path, target, *, draft_vocab: int = 48, mapping: bool = True, hidden: int | None = None,
                  aux_ids: list[int] | None = None, fc_norm: bool = False, fc_norm_keys: bool = False,
                  fmt: str = "bin") -> dict[str, torch.Tensor]:
    """An EAGLE-3 drafter as published: yuhuili/EAGLE3-* (pytorch_model.bin, d2t/t2d) or a SpecForge
    export (model.safetensors, eagle_config, optional target_hidden_size / fc_norm, no d2t/t2d for a
    full-vocabulary drafter)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = target.config
    t, h = cfg.hidden_size, hidden or cfg.hidden_size
    gen = torch.Generator().manual_seed(1)
    rand = lambda *shape: 0.2 * torch.randn(*shape, generator=gen)  # noqa: E731
    taps = len(aux_ids) if aux_ids else 3
    state = {**published_weights(rand, cfg, h, taps * t, draft_vocab), "embed_tokens.weight": rand(VOCAB, h)}
    if mapping:
        d2t, t2d, _ = build_vocab_mapping(torch.randint(0, 100, (VOCAB,), generator=gen), draft_vocab)
        state.update(d2t=d2t, t2d=t2d)
    if fc_norm_keys:
        state.update({f"fc_norm.{i}.weight": 1 + rand(t) for i in range(taps)})
    config = published_config(target.config, h, draft_vocab)
    if aux_ids:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids}
    if hidden:
        config["target_hidden_size"] = t
    if fc_norm:
        config["fc_norm"] = True
    return write_published(folder, config, state, fmt)


def eagle3_by_id(cache, tmp_path, target, repo="yuhuili/EAGLE3-Tiny", **layout) -> tuple[Eagle3Drafter, dict]:
    state = eagle3_folder(tmp_path / "build", target, **layout)
    publish(cache, repo, tmp_path / "build")
    drafter = ready(Eagle3Drafter(Eagle3Options(path=repo, top_k=4, depth=3, total_tokens=16)), target)
    assert drafter.sources["path"].sha == SHA
    return drafter, state


def test_eagle3_official_bin_with_reduced_vocab(cache, tmp_path, target):
    drafter, state = eagle3_by_id(cache, tmp_path, target)
    assert torch.equal(drafter.model.d2t, state["d2t"]) and drafter.model.config.draft_vocab_size == 48
    assert drafter.model.taps == eagle3_taps(LAYERS)
    matches_baseline(target, drafter)


def test_eagle3_full_vocabulary_without_d2t(cache, tmp_path, target):
    drafter, _ = eagle3_by_id(cache, tmp_path, target, repo="org/EAGLE3-full", draft_vocab=VOCAB, mapping=False,
                              fmt="safetensors")
    ids = torch.arange(VOCAB)
    assert torch.equal(drafter.model.to_target_ids(ids), ids) and bool(drafter.model.t2d.all())
    matches_baseline(target, drafter)


def test_eagle3_aux_layer_ids_and_wider_drafter(cache, tmp_path, target):
    """SpecForge export: taps from eagle_config (layer i's output = hidden_states[i + 1]), drafter
    hidden 48 over taps of the 32-wide target (fc 3x32 -> 48) with its own embedding."""
    drafter, state = eagle3_by_id(cache, tmp_path, target, repo="org/EAGLE3-wide", aux_ids=[0, 3, 5], hidden=48,
                                  fmt="safetensors")
    model = drafter.model
    assert model.taps == (1, 4, 6) and drafter.taps == (1, 4, 6)
    assert tuple(model.fc.weight.shape) == (48, 96) and torch.equal(model.embed_tokens.weight, state["embed_tokens.weight"])
    matches_baseline(target, drafter)


def test_eagle3_fc_norm_is_applied_per_tap(cache, tmp_path, target):
    drafter, state = eagle3_by_id(cache, tmp_path, target, repo="org/EAGLE3-fcnorm", fc_norm=True, fc_norm_keys=True,
                                  fmt="safetensors")
    model = drafter.model
    x = torch.randn(2, 3 * target.hidden_size)
    normed = [c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * state[f"fc_norm.{i}.weight"]
              for i, c in enumerate(x.chunk(3, -1))]
    assert torch.allclose(model.fuse(x), torch.cat(normed, -1) @ state["fc.weight"].T, atol=1e-5)
    matches_baseline(target, drafter)


def test_eagle3_unknown_keys_are_refused_by_name(cache, tmp_path, target):
    eagle3_folder(tmp_path / "build", target, fc_norm_keys=True)  # fc_norm weights without config.fc_norm
    publish(cache, "org/EAGLE3-odd", tmp_path / "build")
    with pytest.raises(SpecbenchError, match="does not map: fc_norm.0.weight, fc_norm.1.weight, fc_norm.2.weight"):
        ready(Eagle3Drafter(Eagle3Options(path="org/EAGLE3-odd")), target)


# ---- Medusa, DFlash, SpecBlock ---------------------------------------------------------------------
def test_medusa_heads_counted_from_the_weights(cache, tmp_path, target):
    """FasterDecoding/medusa-vicuna-7b-v1.3: config.json says 2 heads, medusa_lm_head.pt holds 5."""
    build = tmp_path / "build"
    build.mkdir()
    gen = torch.Generator().manual_seed(0)
    state = {}
    for k in range(5):
        state[f"{k}.0.linear.weight"] = 0.1 * torch.randn(32, 32, generator=gen)
        state[f"{k}.0.linear.bias"] = 0.1 * torch.randn(32, generator=gen)
        state[f"{k}.1.weight"] = torch.randn(VOCAB, 32, generator=gen)
    torch.save(state, build / "medusa_lm_head.pt")
    (build / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                   "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}))
    publish(cache, "FasterDecoding/medusa-tiny", build)
    drafter = ready(MedusaDrafter(MedusaOptions(path="FasterDecoding/medusa-tiny", topk=4, max_nodes=15)), target)
    assert drafter.heads.num_heads == 5 and drafter.heads.num_layers == 1
    assert drafter.sources["path"].sha == SHA
    matches_baseline(target, drafter)


def test_dflash_published_layout_by_hub_id(cache, tmp_path):
    from test_dflash import LAYERS as DLAYERS, published_checkpoint

    dtarget = tiny_target(0, layers=DLAYERS, init=0.5)
    (tmp_path / "build").mkdir()
    reference = published_checkpoint(tmp_path / "build", dtarget)
    publish(cache, "z-lab/Tiny-DFlash-b5", tmp_path / "build")
    drafter = ready(DFlashDrafter(DFlashOptions(path="z-lab/Tiny-DFlash-b5")), dtarget)
    for key, value in reference.state_dict().items():
        assert torch.equal(drafter.model.state_dict()[key], value), key
    matches_baseline(dtarget, drafter)


def test_specblock_published_layout_by_hub_id(cache, tmp_path, target):
    from test_specblock import fresh, published_checkpoint

    model = fresh(target)
    (tmp_path / "build").mkdir()
    published_checkpoint(tmp_path / "build", target, model)
    publish(cache, "weijiezz/SpecBlock-Tiny", tmp_path / "build")
    drafter = ready(SpecBlockDrafter(SpecBlockOptions(path="weijiezz/SpecBlock-Tiny", budget=12, beam_width=4)), target)
    for key, value in model.state_dict().items():
        assert torch.equal(drafter.model.state_dict()[key], value), key
    assert drafter.sources["path"].repo_id == "weijiezz/SpecBlock-Tiny"
    matches_baseline(target, drafter)


def test_unknown_layout_names_what_was_found(cache, tmp_path, target):
    build = tmp_path / "build"
    build.mkdir()
    (build / "config.json").write_text(json.dumps({"architectures": ["MysteryDrafter"], "model_type": "mystery"}))
    save_file({"w": torch.zeros(2)}, str(build / "weights.safetensors"))
    publish(cache, "org/mystery", build)
    for drafter in (Eagle3Drafter(Eagle3Options(path="org/mystery")), MedusaDrafter(MedusaOptions(path="org/mystery")),
                    DFlashDrafter(DFlashOptions(path="org/mystery"))):
        with pytest.raises(SpecbenchError, match=r"found config.json, weights.safetensors.*MysteryDrafter") as err:
            ready(drafter, target)
        assert "\n" not in str(err.value)


# ---- chat templates ----------------------------------------------------------------------------
def test_vicuna_v1_1_matches_fastchat():
    text = vicuna_v1_1([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                        {"role": "user", "content": "Bye"}])
    assert text == ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                    "helpful, detailed, and polite answers to the user's questions. USER: Hi ASSISTANT: Hello.</s>"
                    "USER: Bye ASSISTANT:")


def test_template_choice_and_kwargs():
    assert parse_template_kwargs(["enable_thinking=false", "n=3", "x=y"]) == {"enable_thinking": False, "n": 3, "x": "y"}

    class NoTemplate:
        chat_template = None

    assert ChatFormat().resolve(NoTemplate(), "lmsys/vicuna-7b-v1.3").template == "vicuna_v1.1"
    assert ChatFormat().resolve(NoTemplate(), "gpt2").template == "plain"
    with pytest.raises(SpecbenchError, match="kwargs"):
        ChatFormat("auto", {"enable_thinking": False}).resolve(NoTemplate(), "lmsys/vicuna-7b-v1.3")
    with pytest.raises(SpecbenchError, match="unknown --chat-template"):
        ChatFormat("chatml")


def test_template_kwargs_reach_apply_chat_template():
    seen = {}

    class Tok:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, **kwargs):
            seen.update(kwargs)
            return [1, 2]

    assert render_chat(Tok(), [{"role": "user", "content": "q"}], chat=ChatFormat("auto", {"enable_thinking": False})) \
        == [1, 2]
    assert seen["enable_thinking"] is False and seen["add_generation_prompt"] is True


# ---- end to end --------------------------------------------------------------------------------
def test_run_by_hub_ids_records_shas_and_prompt_format(models, cache, tmp_path, capsys):
    publish(cache, "tiny-org/target", Path(models["target"]), SHA)
    publish(cache, "tiny-org/draft", Path(models["draft"]), "c" * 40, refs=("v1",))
    out = tmp_path / "r.jsonl"
    args = base_args(models, out, "--chat-template-kwargs", "enable_thinking=false")
    args[args.index("--target") + 1] = "tiny-org/target"
    args[args.index(f"draft={models['draft']}")] = "draft=tiny-org/draft@v1"
    args[args.index("--limit") + 1] = "1"
    code, _, err = cli(args, capsys)
    assert code == 0, err
    meta = read(out)[0]["meta"]
    assert meta["weights"]["target"]["sha"] == SHA and meta["weights"]["target"]["repo_id"] == "tiny-org/target"
    draft = meta["weights"]["drafters"]["sps"]["draft"]
    assert (draft["sha"], draft["revision"]) == ("c" * 40, "v1")
    assert meta["prompt_format"]["template"] == "tokenizer" and meta["prompt_format"]["kwargs"] == {
        "enable_thinking": False} and len(meta["prompt_format"]["sha256"]) == 16
    assert meta["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("change,needle", [
    (("--target", "tiny-org/absent"), "not in the local HF cache"),
    (("--target-revision", "v9"), "no revision 'v9'"),
    (("--opt", "draft=tiny-org/draft@nope"), "no revision 'nope'"),
    (("--opt", "revision=v1"), "applies to hub ids only"),
], ids=["unreachable-target", "missing-target-revision", "missing-drafter-revision", "revision-on-a-folder"])
def test_bad_hub_input_is_exit_2_and_writes_nothing(models, cache, tmp_path, capsys, change, needle):
    publish(cache, "tiny-org/target", Path(models["target"]))
    publish(cache, "tiny-org/draft", Path(models["draft"]))
    out = tmp_path / "r.jsonl"
    args = base_args(models, out)
    args[args.index("--target") + 1] = "tiny-org/target"
    flag, value = change
    if flag == "--target":
        args[args.index("--target") + 1] = value
    elif value.startswith("draft="):
        args[args.index(f"draft={models['draft']}")] = value
    else:
        args += [flag, value]
    code, _, err = cli(args, capsys)
    assert code == 2 and needle in err and "Traceback" not in err, err
    assert not out.exists()


def test_unknown_drafter_layout_is_exit_2_and_writes_nothing(models, cache, tmp_path, capsys):
    build = tmp_path / "build"
    build.mkdir()
    (build / "config.json").write_text(json.dumps({"architectures": ["MysteryDrafter"]}))
    publish(cache, "org/mystery", build)
    out = tmp_path / "r.jsonl"
    args = ["run", "--method", "eagle3", "--bench", "humaneval", "--target", models["deep"], "--dtype", "float32",
            "--opt", "path=org/mystery", "--limit", "1", "--out", str(out), "--no-warmup"]
    code, _, err = cli(args, capsys)
    assert code == 2 and "MysteryDrafter" in err and "Traceback" not in err, err
    assert not out.exists()


def test_resume_refuses_other_weights(models, cache, tmp_path, capsys):
    """A table must come from one set of weights: resuming after main moved to another commit fails."""
    publish(cache, "tiny-org/target", Path(models["target"]), SHA)
    out = tmp_path / "r.jsonl"
    args = base_args(models, out)
    args[args.index("--target") + 1] = "tiny-org/target"
    args[args.index("--limit") + 1] = "1"
    assert cli(args, capsys)[0] == 0
    publish(cache, "tiny-org/target", Path(models["target"]), "d" * 40)  # main now points elsewhere
    args[args.index("--limit") + 1] = "2"
    code, _, err = cli(args + ["--resume"], capsys)
    assert code == 2 and "other weights (target" in err, err
    assert len(read(out)) == 3  # header + the first prompt's two records, untouched


def test_also_sides_take_hub_revisions():
    """An '@' separates two options only where `key=` follows it, so a hub id's @REVISION stays in its value
    (no special case); an '@' followed by no option is part of the value, which the option's type then judges."""
    from specbench.engine.registry import method_class, parse_options
    from specbench.sides import parse_spec

    side = parse_spec("eagle3@path=yuhuili/EAGLE3-LLaMA3.1-Instruct-8B@v1@top_k=4")
    assert side.options == {"path": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B@v1", "top_k": "4"}
    stray = parse_spec("eagle3@top_k=4@oops")
    assert stray.options == {"top_k": "4@oops"}
    with pytest.raises(SpecbenchError, match="option top_k expects a whole number"):
        parse_options(method_class("eagle3"), stray.options)
    with pytest.raises(SpecbenchError, match="--also expects"):
        parse_spec("eagle3@oops")


def test_dflash_published_logit_and_embedding_knobs(cache, tmp_path):
    """dflash_config's input_embedding_scale, output_multiplier and final_logit_softcapping act as in
    z-lab's model.py; causal block attention is refused in one line."""
    from test_dflash import LAYERS as DLAYERS, published_checkpoint

    dtarget = tiny_target(0, layers=DLAYERS, init=0.5)
    build = tmp_path / "build"
    build.mkdir()
    published_checkpoint(build, dtarget)
    raw = json.loads((build / "config.json").read_text())
    raw["dflash_config"].update(input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=3.0)
    (build / "config.json").write_text(json.dumps(raw))
    publish(cache, "z-lab/Tiny-DFlash-knobs", build)
    model = ready(DFlashDrafter(DFlashOptions(path="z-lab/Tiny-DFlash-knobs")), dtarget).model
    h = torch.randn(3, dtarget.hidden_size)
    plain = torch.nn.functional.linear(model.norm(h), dtarget.model.get_output_embeddings().weight)
    assert torch.allclose(model.logits(h), torch.tanh(plain * 0.5 / 3.0) * 3.0, atol=1e-5)
    ids = torch.tensor([1, 2])
    assert torch.allclose(model.embed(ids), 2.0 * dtarget.model.get_input_embeddings()(ids))
    # is_causal: z-lab's attention reads the config attribute, not dflash_config, so only a top-level one
    # makes every layer causal (tests/test_dflash_layouts.py checks the masks themselves).
    raw["dflash_config"]["is_causal"] = True
    (build / "config.json").write_text(json.dumps(raw))
    publish(cache, "z-lab/Tiny-DFlash-causal-ignored", build)
    model = ready(DFlashDrafter(DFlashOptions(path="z-lab/Tiny-DFlash-causal-ignored")), dtarget).model
    assert model.config.layer_attention(0) == (False, 0)
    raw["is_causal"] = True
    (build / "config.json").write_text(json.dumps(raw))
    publish(cache, "z-lab/Tiny-DFlash-causal", build)
    model = ready(DFlashDrafter(DFlashOptions(path="z-lab/Tiny-DFlash-causal")), dtarget).model
    assert model.config.layer_attention(0) == (True, 0)


def test_vicuna_target_without_template_renders_fastchat(models, tmp_path):
    from transformers import AutoTokenizer

    from conftest import save_tiny
    from specbench.engine.target import Target

    tok = AutoTokenizer.from_pretrained(models["target"])
    tok.chat_template = None
    target = Target.load(save_tiny(tmp_path / "tiny-vicuna-v1.3", tok, 0), "float32")
    assert target.chat.template == "vicuna_v1.1"
    ids = render_chat(target.tokenizer, [{"role": "user", "content": "Hi"}], chat=target.chat)
    assert ids == tok(vicuna_v1_1([{"role": "user", "content": "Hi"}]))["input_ids"]
    assert tok.decode(ids).endswith("USER: Hi ASSISTANT:")
