"""Fused q/k/v and gate/up projections (layers.FusedProjections): the fused tensors hold the weights once, the
official-name parameters are views of their rows, and the fused matmul never reads stale weights after any way
this project builds, converts, loads or copies a model."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from serving.model.checkpoint import write_checkpoint
from serving.model.config import TransformerConfig
from serving.model.layers import MLP, Attention, DecoderLayer, DecoderStack, KVCache
from serving.model.tts import Qwen3TTS
from serving.model.weights import init_dummy_, load_safetensors_, materialize, safetensors_files


def _cfg(bias: bool) -> TransformerConfig:
    # head_dim * heads != hidden and GQA, as in the real checkpoints
    return TransformerConfig(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                             max_position_embeddings=16, vocab_size=32, attention_bias=bias)


def _owners(module: torch.nn.Module):
    return [m for m in module.modules() if isinstance(m, (Attention, MLP))]


def _assert_views(module: torch.nn.Module) -> None:
    """Every official q/k/v and gate/up parameter is a view of its rows of the owner's fused tensor."""
    owners = _owners(module)
    assert owners
    for owner in owners:
        parts = [getattr(owner, name) for name in owner.fused_names]
        for attr, fused in (("weight", owner.fused_weight), ("bias", owner.fused_bias)):
            if parts[0].bias is None and attr == "bias":
                assert fused is None
                continue
            offset = 0
            for p in parts:
                t = getattr(p, attr)
                assert t.dtype == fused.dtype and t.device == fused.device
                assert t.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
                assert t.data_ptr() == fused[offset:].data_ptr() and t.shape == fused[offset: offset + t.shape[0]].shape
                offset += t.shape[0]
            assert offset == fused.shape[0]


def _assert_fused(module: torch.nn.Module) -> None:
    """Views intact, the projections the forward computes equal F.linear over the official-name weights, and an
    in-place write into an official parameter reaches the fused tensor."""
    _assert_views(module)
    for owner in _owners(module):
        parts = [getattr(owner, name) for name in owner.fused_names]
        x = torch.randn(3, parts[0].in_features, dtype=owner.fused_weight.dtype, device=owner.fused_weight.device)
        for got, p in zip(owner.project(x), parts, strict=True):
            torch.testing.assert_close(got, F.linear(x, p.weight, p.bias), rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            saved = parts[-1].weight.clone()
            parts[-1].weight.mul_(2)
            assert torch.equal(owner.fused_weight[-saved.shape[0]:], saved * 2)
            parts[-1].weight.copy_(saved)


def _fill(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))


@pytest.mark.parametrize("bias", [False, True])
def test_split_outputs_equal_separate_matmuls_fp32(bias):
    layer = DecoderLayer(_cfg(bias))
    _fill(layer, 0)
    x = torch.randn(2, 5, 24)
    q, k, v = layer.self_attn.project(x)
    gate, up = layer.mlp.project(x)
    for got, lin in ((q, layer.self_attn.q_proj), (k, layer.self_attn.k_proj), (v, layer.self_attn.v_proj),
                     (gate, layer.mlp.gate_proj), (up, layer.mlp.up_proj)):
        torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-6, atol=1e-6)


def test_stack_output_equals_unfused_reference_fp32():
    """The whole stack through the fused path equals one computed with separate F.linear calls."""
    cfg = _cfg(True)
    stack = DecoderStack(cfg, max_positions=16)
    _fill(stack, 1)
    with torch.no_grad():
        for layer in stack.layers:
            layer.input_layernorm.weight.add_(1.0)
    x, positions = torch.randn(2, 6, 24), torch.arange(6).expand(2, 6)

    def run():
        cache = KVCache.for_stack(cfg, 2, 8, torch.float32, "cpu")
        return stack(x, positions, cache, positions, kv_len=6, mask=None)

    fused = run()

    def separate_projections(attn):
        def project(h):
            return tuple(F.linear(h, getattr(attn, n).weight, getattr(attn, n).bias) for n in attn.fused_names)
        return project

    for layer in stack.layers:
        layer.self_attn.project = separate_projections(layer.self_attn)
        layer.mlp.project = separate_projections(layer.mlp)
    torch.testing.assert_close(fused, run(), rtol=1e-5, atol=1e-5)


def test_no_doubled_memory_and_official_names():
    layer = DecoderLayer(_cfg(True))
    names = dict(layer.named_parameters())
    assert {"self_attn.q_proj.weight", "self_attn.k_proj.bias", "mlp.gate_proj.weight", "mlp.up_proj.weight"} \
        <= set(names)
    assert set(layer.state_dict()) == set(names)  # fused tensors are not state
    assert not any("fused" in n for n, _ in layer.named_buffers())
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in layer.parameters()}
    assert sum(storages.values()) == sum(p.numel() * p.element_size() for p in layer.parameters())
    # q/k/v weights share one storage, their biases another, gate/up a third: 3 + the unfused tensors
    fused = ("q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj.")
    assert len(storages) == 3 + len([n for n in names if not any(f in n for f in fused)])
    assert layer.self_attn.q_proj.weight.shape == (32, 24) and layer.self_attn.k_proj.weight.shape == (16, 24)


def test_meta_materialize_then_dummy_and_safetensors_load(tmp_path):
    with torch.device("meta"):
        stack = DecoderStack(_cfg(True), max_positions=16)
    stack = materialize(stack, torch.float32, "cpu")
    init_dummy_(stack, seed=3)
    _assert_fused(stack)

    reference = DecoderStack(_cfg(True), max_positions=16)
    _fill(reference, 4)
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(tmp_path / "model.safetensors"))
    load_safetensors_(stack, safetensors_files(tmp_path))
    _assert_fused(stack)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(stack.state_dict()[name], tensor), name
    assert torch.equal(stack.layers[1].self_attn.fused_weight, torch.cat(
        [reference.state_dict()[f"layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]))


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.float64), lambda m: m.half(),
                                     lambda m: m.to("cpu", torch.bfloat16), lambda m: m.to_empty(device="cpu"),
                                     lambda m: m.float()], ids=["to_f64", "half", "to_cpu_bf16", "to_empty", "float"])
def test_conversions_keep_views(convert):
    """Module._apply replaces each parameter's data on its own; the owners re-fuse, so in-place writes after the
    conversion still reach the matmul."""
    stack = DecoderStack(_cfg(True), max_positions=16)
    _fill(stack, 5)
    before = {k: v.clone() for k, v in stack.state_dict().items()}
    stack = convert(stack)
    _assert_views(stack)
    if stack.layers[0].self_attn.fused_weight.dtype == torch.float64:
        for k, v in stack.state_dict().items():
            assert torch.equal(v, before[k].double()), k
    _fill(stack, 6)  # weights copied in by a test after .to()
    _assert_fused(stack)


def test_build_on_cpu_then_convert_then_load_then_convert_again(tmp_path):
    reference = DecoderStack(_cfg(False), max_positions=16)
    _fill(reference, 7)
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(tmp_path / "model.safetensors"))
    stack = DecoderStack(_cfg(False), max_positions=16).to(torch.bfloat16)
    load_safetensors_(stack, safetensors_files(tmp_path))
    _assert_fused(stack)
    stack = stack.to(torch.float32)
    _assert_fused(stack)
    with torch.no_grad():
        stack.layers[0].self_attn.q_proj.weight.copy_(reference.layers[0].self_attn.q_proj.weight)
    assert torch.equal(stack.layers[0].self_attn.fused_weight[:32], reference.layers[0].self_attn.q_proj.weight)


def test_no_op_conversion_keeps_the_fused_tensor():
    attn = Attention(_cfg(False))
    fused = attn.fused_weight
    attn.to(torch.float32)
    assert attn.fused_weight is fused


def test_swap_module_params_on_conversion():
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        stack = DecoderStack(_cfg(True), max_positions=16).to(torch.float64)
        _fill(stack, 8)
        _assert_fused(stack)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def test_load_state_dict_copies_into_views():
    source, target = DecoderStack(_cfg(True), max_positions=16), DecoderStack(_cfg(True), max_positions=16)
    _fill(source, 9)
    target.load_state_dict(source.state_dict())
    _assert_fused(target)
    assert torch.equal(target.layers[0].mlp.fused_weight[40:], source.layers[0].mlp.up_proj.weight)


def test_deepcopy_and_pickle_refuse():
    layer = DecoderLayer(_cfg(True))
    _fill(layer, 10)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        _assert_fused(clone)
        assert clone.self_attn.fused_weight.data_ptr() != layer.self_attn.fused_weight.data_ptr()
        assert torch.equal(clone.self_attn.fused_weight, layer.self_attn.fused_weight)


def test_ways_to_cut_a_view_loose_raise():
    attn = Attention(_cfg(True))
    with pytest.raises(RuntimeError, match="convert the owning"):
        attn.q_proj.half()
    with pytest.raises(RuntimeError, match="convert the owning"):
        attn.k_proj.to_empty(device="cpu")
    with pytest.raises(AttributeError, match="copy into it in place"):
        attn.v_proj.weight = torch.nn.Parameter(torch.zeros(16, 24))
    with pytest.raises(RuntimeError, match="copy into it in place"):  # load_state_dict wraps the AttributeError
        attn.load_state_dict(attn.state_dict(), assign=True)
    with pytest.raises(AttributeError, match="cannot replace q_proj"):
        attn.q_proj = torch.nn.Linear(24, 32)
    _assert_fused(attn)


def test_loaded_checkpoint_is_fused(tmp_path):
    """The offline API's load path (meta, materialize, safetensors) on a real tiny checkpoint, then .to()."""
    tts = Qwen3TTS.load(write_checkpoint(tmp_path / "cv", "tiny", "custom_voice", seed=1), dtype="float32")
    _assert_fused(tts.model.talker)
    assert len(_owners(tts.model.talker)) == 2 * (2 + 2)  # talker and code predictor, 2 layers each
    _assert_fused(tts.model.talker.to(torch.bfloat16))


def test_compiled_layer_sees_in_place_writes_and_refused_tensors():
    """The engine torch.compiles each layer: the fused tensors are plain attributes, which dynamo reads as
    guarded inputs, so in-place loads and re-fusing after .to() reach compiled code. (Backend "eager": dynamo's
    tracing and guards, as under inductor, without a minute of CPU code generation.)"""
    cfg = _cfg(True)
    layer = DecoderLayer(cfg)
    _fill(layer, 11)
    with torch.no_grad():
        layer.input_layernorm.weight.add_(1.0)
    x, positions = torch.randn(2, 3, 24), torch.arange(3).expand(2, 3)

    def run(module):
        dtype = layer.self_attn.fused_weight.dtype
        cos, sin = DecoderStack(cfg, 16).rotary(positions, dtype)
        cache = KVCache.for_stack(cfg, 2, 4, dtype, "cpu")
        return module(x.to(dtype), cos, sin, cache.k[0], cache.v[0], positions, 3, None)

    compiled = torch.compile(layer, backend="eager", dynamic=True)
    torch.testing.assert_close(run(compiled), run(layer))
    with torch.no_grad():
        layer.self_attn.v_proj.weight.mul_(3)
        layer.mlp.up_proj.weight.mul_(0.5)
    torch.testing.assert_close(run(compiled), run(layer))
    layer.to(torch.float64)
    _fill(layer, 12)
    torch.testing.assert_close(run(compiled), run(layer))
