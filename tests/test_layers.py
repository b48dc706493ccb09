"""The shared drafter blocks (methods/layers.py) and checkpoint key checks (methods/checkpoints.py):
cached attention equals attention over all rows at once, masks in every accepted shape mean the
same, published parameter names, and key errors in one line that name the keys."""

from __future__ import annotations

import pytest
import torch

from methods.checkpoints import check_keys, load_checked
from methods.layers import DecoderLayer, LayerShapes, Rotary, official_layer_shapes, rope_of
from specbench.errors import SpecbenchError

SHAPES = LayerShapes(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4, intermediate_size=24,
                     rms_norm_eps=1e-6, vocab_size=50)


def layer(seed: int = 0, **kwargs) -> DecoderLayer:
    torch.manual_seed(seed)
    out = DecoderLayer(SHAPES, **kwargs)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms away from 1, so q/k norm weights matter
    return out.eval()


def rotary(n: int):
    return Rotary(SHAPES)(torch.arange(n)[None], torch.float32)


@pytest.mark.parametrize("kwargs", [{}, {"qk_norm": True}], ids=["llama", "qk-norm"])
def test_cached_rows_equal_one_causal_pass(kwargs):
    block = layer(**kwargs)
    x = torch.randn(1, 7, 16)
    cos, sin = rotary(7)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    full, (k, v) = block(x, cos, sin, causal)
    first, past = block(x[:, :4], cos[:, :, :4], sin[:, :, :4], causal[:4, :4])
    rest, _ = block(x[:, 4:], cos[:, :, 4:], sin[:, :, 4:], causal[4:], past=past)
    assert torch.allclose(torch.cat([first, rest], 1), full, atol=1e-5)
    assert k.shape == v.shape == (1, 2, 7, 4)  # the new rows' keys/values, kv heads only (GQA)


def test_mask_shapes_mean_the_same():
    block = layer()
    x = torch.randn(2, 5, 16)
    cos, sin = rotary(5)
    mask = torch.rand(5, 5) < 0.5
    mask |= torch.eye(5, dtype=torch.bool)
    expected, _ = block(x, cos, sin, mask)
    for shaped in (mask.expand(2, 5, 5), mask.expand(2, 1, 5, 5)):
        assert torch.equal(block(x, cos, sin, shaped)[0], expected)
    everything = torch.ones(5, 5, dtype=torch.bool)
    assert torch.allclose(block(x, cos, sin, None)[0], block(x, cos, sin, everything)[0], atol=1e-6)


def test_fused_input_reads_embedding_and_hidden():
    block = layer(fused_input=True)
    assert block.self_attn.q_proj.in_features == 32 and block.hidden_norm.weight.shape == (16,)
    x, emb = torch.randn(1, 3, 16), torch.randn(1, 3, 16)
    cos, sin = rotary(3)
    out, _ = block(x, cos, sin, torch.ones(3, 3, dtype=torch.bool).tril(), embedding=emb)
    changed, _ = block(x, cos, sin, torch.ones(3, 3, dtype=torch.bool).tril(), embedding=emb + 1)
    assert out.shape == (1, 3, 16) and not torch.allclose(out, changed)


def test_parameter_names_are_the_published_ones():
    names = set(layer(qk_norm=True).state_dict())
    assert names == {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                     "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                     "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                     "mlp.up_proj.weight", "mlp.down_proj.weight"}
    assert "self_attn.q_norm.weight" not in layer().state_dict()


def test_rope_parameters_read_like_rope_theta_and_scaling():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    old = {"rope_theta": 500000, "rope_scaling": dict(scaling)}
    new = {"rope_parameters": {"rope_theta": 500000, **scaling}}
    assert rope_of(old) == rope_of(new) == (500000.0, scaling)
    assert rope_of({"rope_scaling": {"rope_type": "default"}}) == (10000.0, None)
    raw = {"hidden_size": 16, "num_attention_heads": 4, "intermediate_size": 24, "vocab_size": 50, **new}
    assert official_layer_shapes(raw, "x/config.json", "EAGLE-3")["rope_scaling"] == scaling


def test_missing_config_keys_are_named_in_one_line(tmp_path):
    with pytest.raises(SpecbenchError, match="lacks vocab_size, num_hidden_layers, extra.mask; it is not a DFlash") as err:
        official_layer_shapes({"hidden_size": 16, "num_attention_heads": 4, "intermediate_size": 24},
                              str(tmp_path / "config.json"), "DFlash", required=("num_hidden_layers",),
                              missing=("extra.mask",))
    assert "\n" not in str(err.value)


def test_key_checks_name_the_keys_in_one_line(tmp_path):
    block = layer()
    state = dict(block.state_dict())
    with pytest.raises(SpecbenchError, match=r"Test checkpoint .* lacks keys: mlp\.up_proj\.weight \(no file\?\)$"):
        load_checked(layer(), {k: v for k, v in state.items() if k != "mlp.up_proj.weight"}, tmp_path, "Test",
                     hint=" (no file?)")
    extra = {**state, **{f"odd.{i:02d}": torch.zeros(1) for i in range(10)}, "rotary_emb.inv_freq": torch.zeros(2)}
    with pytest.raises(SpecbenchError, match=r"does not map: odd\.00, .*odd\.07 \(\+2 more\)$") as err:
        load_checked(layer(), extra, tmp_path, "Test", ignored=("*rotary_emb.inv_freq",))
    assert "\n" not in str(err.value) and "inv_freq" not in str(err.value)
    with pytest.raises(SpecbenchError, match="map to nothing: odd.00"):
        check_keys(extra, state, tmp_path, "Test", words=("is missing", "has keys that map to nothing:"))
    # Ignored keys are dropped; the rest loads exactly, in the checkpoint's dtype.
    doubled = {**{k: v.double() for k, v in state.items()}, "x.rotary_emb.inv_freq": torch.zeros(2)}
    loaded = load_checked(layer(seed=1), doubled, tmp_path, "Test", ignored=("*rotary_emb.inv_freq",))
    for key, value in loaded.state_dict().items():
        assert value.dtype == torch.float64 and torch.equal(value, state[key].double()), key
