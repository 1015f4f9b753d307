"""The Megatron <-> HF Llama converter (``miles_fsm.drivers.megatron.convert``).

The layout rules and the refusals run here, on plain tensors. Against real
megatron-core (CPU, gloo, 2 ranks in real processes, ``convert_ranks``): a
Megatron GPT's logits equal ``transformers``' ``LlamaForCausalLM`` loaded
with the converted weights; deliberately wrong conversions miss by far; TP = 2
gathers the same HF weights as TP = 1; HF weights loaded into TP = 1 and 2
give HF's logits and read back bit for bit.
"""

from __future__ import annotations

import functools
import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from convert_ranks import SHAPE, TOKENS, random_hf_state, rank_convert
from megatron_cpu import megatron_available
from miles_fsm.drivers.errors import NotLlamaShapedError, WeightLayoutError
from miles_fsm.drivers.megatron.convert import (
    Mistake,
    TpSplit,
    gather_shards,
    hf_shapes,
    hf_to_megatron,
    megatron_shapes,
    megatron_to_hf,
    shard_of,
    tp_split,
)
from miles_fsm.drivers.megatron.llama import LlamaShape
from miles_fsm.launch.local import run_ranks

_SKIP = megatron_available()
if _SKIP is None and importlib.util.find_spec("transformers") is None:  # the test extra has it on Python 3.11+
    _SKIP = "transformers is not installed; install the 'test' extra on Python 3.11+"
#: fp32 on both sides; the logits span about +-6 and differ by up to 1e-5 (softmax and reduction order,
#: more at TP 2), while a wrong or lost weight moves them by 1 or more (a norm left at ones: 1.4).
_ATOL = 5e-5


def test_hf_to_megatron_to_hf_is_bit_exact_and_so_is_the_other_way():
    """HF -> Megatron -> HF gives back every tensor bit for bit (the embedding and output padded with zero
    rows to the padded vocab on the way), and Megatron -> HF -> Megatron too, padding rows aside."""
    hf = random_hf_state()
    mg = hf_to_megatron(hf, SHAPE)
    assert {n: tuple(t.shape) for n, t in mg.items()} == megatron_shapes(SHAPE)
    assert not mg["output_layer.weight"][SHAPE.vocab :].any()
    back = megatron_to_hf(mg, SHAPE)
    assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf)
    again = hf_to_megatron(back, SHAPE)
    assert all(torch.equal(again[n], mg[n]) for n in mg)


def test_linear_qkv_is_split_per_query_group_and_fc1_is_gate_then_up():
    """Rows labelled by (group, slot) land where megatron's attention reads them: per group, its query
    heads, then its key head, then its value head; ``linear_fc1``'s first half is the gate."""
    s, hpg = SHAPE, SHAPE.heads_per_group
    mg = hf_to_megatron(random_hf_state(), s)
    label = torch.arange(s.query_groups * (hpg + 2), dtype=torch.float32)  # group * (hpg + 2) + slot
    mg["decoder.layers.0.self_attention.linear_qkv.weight"] = label.repeat_interleave(s.head_dim)[:, None].expand(
        -1, s.hidden).contiguous()  # fmt: skip
    fc1 = mg["decoder.layers.0.mlp.linear_fc1.weight"]
    hf = megatron_to_hf(mg, s)
    attn = "model.layers.0.self_attn."
    heads = {p: hf[f"{attn}{p}_proj.weight"][:: s.head_dim, 0].tolist() for p in "qkv"}
    assert heads["q"] == [g * (hpg + 2) + h for g in range(s.query_groups) for h in range(hpg)]
    assert heads["k"] == [g * (hpg + 2) + hpg for g in range(s.query_groups)]
    assert heads["v"] == [g * (hpg + 2) + hpg + 1 for g in range(s.query_groups)]
    assert torch.equal(hf["model.layers.0.mlp.gate_proj.weight"], fc1[: s.ffn_hidden])
    assert torch.equal(hf["model.layers.0.mlp.up_proj.weight"], fc1[s.ffn_hidden :])


@pytest.mark.parametrize(
    ("mistake", "changed"),
    [(Mistake.QK_SWAPPED, {"self_attn.q_proj.weight", "self_attn.k_proj.weight"}),
     (Mistake.GATE_UP_SWAPPED, {"mlp.gate_proj.weight", "mlp.up_proj.weight"})],
)  # fmt: skip
def test_a_mistake_changes_only_what_it_names_and_keeps_every_shape(mistake, changed):
    """A deliberately wrong conversion still loads (same names, same shapes) and differs from the right
    one in exactly the tensors it names, in every layer."""
    mg = hf_to_megatron(random_hf_state(), SHAPE)
    right, wrong = megatron_to_hf(mg, SHAPE), megatron_to_hf(mg, SHAPE, mistake=mistake)
    assert {n: t.shape for n, t in wrong.items()} == {n: t.shape for n, t in right.items()}
    differ = {n for n in right if not torch.equal(right[n], wrong[n])}
    assert differ == {f"model.layers.{i}.{c}" for i in range(SHAPE.layers) for c in changed}


def test_tp_shards_gather_back_and_linear_fc1_is_strided():
    """``shard_of`` and ``gather_shards`` invert each other for every split weight at TP 2 and 4; a TP
    rank's ``linear_fc1`` holds its slice of the gate, then its slice of up (stride 2)."""
    mg = hf_to_megatron(random_hf_state(), SHAPE)
    for name, full in mg.items():
        split = tp_split(name)
        if split is None:
            continue
        for size in (2, 4):
            shards = [shard_of(full, split, r, size) for r in range(size)]
            assert torch.equal(gather_shards(shards, split), full), (name, size)
    fc1 = mg["decoder.layers.1.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    rank1 = shard_of(fc1, tp_split("decoder.layers.1.mlp.linear_fc1.weight"), 1, 2)
    assert torch.equal(rank1, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    assert tp_split("decoder.layers.0.self_attention.linear_proj.weight") == TpSplit(1)
    assert tp_split("decoder.final_layernorm.weight") is None
    with pytest.raises(WeightLayoutError, match="does not split into 2 x 5 TP parts"):
        shard_of(fc1, TpSplit(0, 2), 0, 5)


def test_unknown_missing_and_misshapen_weights_are_refused_all_at_once():
    """Names the shape does not have, names it lacks, and wrong shapes: one ``WeightLayoutError`` listing
    each, before anything is converted."""
    mg = hf_to_megatron(random_hf_state(), SHAPE)
    mg["module.decoder.final_layernorm.weight"] = mg.pop("decoder.final_layernorm.weight")  # a wrapper's prefix
    mg["decoder.layers.1.mlp.linear_fc2.weight"] = torch.zeros(64, 95)
    with pytest.raises(WeightLayoutError) as info:
        megatron_to_hf(mg, SHAPE)
    e = info.value
    assert (e.side, e.unknown, e.missing) == ("megatron", ("module.decoder.final_layernorm.weight",),
                                              ("decoder.final_layernorm.weight",))  # fmt: skip
    assert e.mismatched == ("decoder.layers.1.mlp.linear_fc2.weight (64, 95) != (64, 96)",)
    hf = random_hf_state()
    del hf["lm_head.weight"]  # what a tied checkpoint holds
    with pytest.raises(WeightLayoutError) as info:
        hf_to_megatron(hf, SHAPE)
    assert info.value.missing == ("lm_head.weight",) and "Nothing was converted" in str(info.value)


def test_transformer_engine_norm_names_are_refused_as_not_llama_shaped():
    """A TE-spec state dict (norms fused into ``linear_qkv``/``linear_fc1``) is named as such, with the
    local spec as the way out, not reported as a pile of unknown names."""
    mg = hf_to_megatron(random_hf_state(), SHAPE)
    mg["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"] = mg.pop(
        "decoder.layers.0.input_layernorm.weight")  # fmt: skip
    with pytest.raises(NotLlamaShapedError) as info:
        megatron_to_hf(mg, SHAPE)
    assert "TransformerEngine" in info.value.problems[0] and "get_gpt_layer_local_spec" in str(info.value)


def _gpt(**config):
    """What ``LlamaShape.from_megatron`` reads of a GPTModel, Llama-shaped unless ``config`` says otherwise."""
    llama = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                 add_bias_linear=False, add_qkv_bias=False, rotary_interleaved=False, qk_layernorm=False,
                 num_moe_experts=None, multi_latent_attention=False, num_layers=2, hidden_size=64,
                 num_attention_heads=4, num_query_groups=2, kv_channels=24, ffn_hidden_size=96,
                 layernorm_epsilon=1e-6)  # fmt: skip
    tied = config.pop("tied", False)
    gpt = SimpleNamespace(config=SimpleNamespace(**{**llama, **config}), share_embeddings_and_output_weights=tied,
                          position_embedding_type="rope", vocab_size=128, max_sequence_length=32, rotary_base=500,
                          embedding=None, decoder=None, modules=lambda: [])  # fmt: skip
    return SimpleNamespace(module=SimpleNamespace(module=gpt))  # DDP(Float16Module(gpt))


def test_a_gpt_that_is_not_llama_shaped_is_refused_with_every_reason():
    """Tied embeddings, LayerNorm, a plain GELU MLP, biases: each named, in one error, with what to build."""
    shape = LlamaShape.from_megatron(_gpt(), vocab=100)
    assert (shape.query_groups, shape.head_dim, shape.padded_vocab, shape.vocab, shape.eps) == (2, 24, 128, 100, 1e-6)
    bad = _gpt(tied=True, normalization="LayerNorm", gated_linear_unit=False, add_bias_linear=True)
    with pytest.raises(NotLlamaShapedError) as info:
        LlamaShape.from_megatron(bad)
    problems = " | ".join(info.value.problems)
    assert len(info.value.problems) == 4
    for words in ("tied", "'LayerNorm'", "SwiGLU", "biases"):
        assert words in problems
    assert "share_embeddings_and_output_weights=False" in str(info.value)
    with pytest.raises(NotLlamaShapedError, match="holds no GPTModel"):
        LlamaShape.from_megatron(SimpleNamespace(module=None))
    with pytest.raises(NotLlamaShapedError) as info:
        LlamaShape(layers=1, hidden=8, heads=3, query_groups=2, head_dim=4, ffn_hidden=8, vocab=10, padded_vocab=8)
    assert len(info.value.problems) == 2


# --------------------------------------------------------------------------- real megatron-core, 2 ranks


@functools.cache
def _ranks() -> tuple[dict, ...]:
    """One 2-rank run (TP = 2, then TP = 1), shared by the tests below: it costs seconds."""
    outcomes = run_ranks(rank_convert, 2, timeout_s=120)
    for o in outcomes:
        assert o.ok, f"rank {o.rank} failed: {o.error.traceback if o.error else f'exit code {o.exitcode}'}"
    return tuple(o.result for o in outcomes)


def _tensors(arrays):
    return {n: torch.from_numpy(a) for n, a in arrays.items()}


@functools.cache
def _hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_dict(SHAPE.hf_config())
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config).eval()


def _hf_logits(state):
    model = _hf_model()
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(TOKENS).logits


def _delta(megatron_logits, hf_logits) -> float:
    return float((torch.from_numpy(megatron_logits)[..., : SHAPE.vocab] - hf_logits).abs().max())


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
@pytest.mark.usefixtures("assert_no_leftovers")
@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_megatron_logits_equal_hf_logits_with_the_converted_weights(tp):
    """A seeded Megatron GPT (random norms, a non-default RoPE base) and ``LlamaForCausalLM`` loaded with
    its converted weights give the same fp32 logits, to 5e-5."""
    r = _ranks()[0][tp]
    assert _delta(r["seeded_logits"], _hf_logits(_tensors(r["seeded_hf"]))) < _ATOL


@pytest.mark.parametrize("mistake", list(Mistake), ids=lambda m: m.value)
@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_a_wrong_conversion_misses_megatrons_logits_by_far(mistake):
    """q/k swapped, or gate/up swapped: the HF model's logits miss Megatron's by more than 0.5 (the logits
    span about +-6), 10,000 times the tolerance the right conversion meets: the check can fail."""
    r = _ranks()[0]["tp1"]
    wrong = megatron_to_hf(hf_to_megatron(_tensors(r["seeded_hf"]), SHAPE), SHAPE, mistake=mistake)
    assert _delta(r["seeded_logits"], _hf_logits(wrong)) > 0.5


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_a_gpt_of_another_tp_size_than_megatrons_state_is_refused():
    """Asked for TP = 1 while megatron's state is 2-way, ``build_llama_gpt`` refuses, saying how to mend it,
    rather than split the model over a group of the wrong size."""
    for r in _ranks():
        assert "2-way tensor parallel, not tp=1" in r["tp1_over_tp2_refused"], r["tp1_over_tp2_refused"]
        assert "destroy_model_parallel()" in r["tp1_over_tp2_refused"]


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_tp2_gathers_the_same_hf_weights_as_tp1():
    """One seed, TP = 2 and TP = 1: the gathered HF state dicts are equal bit for bit, on both ranks, so
    the gather undoes megatron's own split (whole query groups, strided ``linear_fc1``, vocab rows)."""
    ranks = _ranks()
    ref = ranks[0]["tp1"]["seeded_hf"]
    for r in ranks:
        for tp in ("tp1", "tp2"):
            got = r[tp]["seeded_hf"]
            assert got.keys() == ref.keys() and all(np.array_equal(got[n], ref[n]) for n in ref), tp


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_hf_weights_loaded_into_megatron_give_hf_logits_and_read_back_bit_exact():
    """``load_hf_weights`` at TP = 1 and 2 (each rank its shard: half the ``linear_qkv`` rows at TP = 2):
    Megatron's logits equal HF's on the same weights, and ``iter_hf_weights`` reads them back bit for bit."""
    source = random_hf_state()
    hf_logits = _hf_logits(source)
    r = _ranks()[1]
    for tp in ("tp1", "tp2"):
        assert _delta(r[tp]["loaded_logits"], hf_logits) < _ATOL, tp
        back = r[tp]["loaded_back"]
        assert back.keys() == source.keys() and all(np.array_equal(back[n], source[n].numpy()) for n in source)
    assert r["tp2"]["local_qkv_rows"] * 2 == r["tp1"]["local_qkv_rows"]


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_the_drivers_bf16_gpt_in_llama_shape_converts_through_its_wrappers():
    """``build_tiny_gpt(GptConfig(llama=...))``, bf16 under ``Float16Module`` and DDP, after a train step
    on each rank's own data: every HF weight comes out, in bf16, and the two DP ranks agree bit for bit."""
    ranks = _ranks()
    hf = [r["trainer"]["hf"] for r in ranks]
    assert ranks[0]["trainer"]["dtypes"] == ["torch.bfloat16"]
    assert {n: a.shape for n, a in hf[0].items()} == hf_shapes(SHAPE)
    assert all(np.array_equal(hf[0][n], hf[1][n]) for n in hf[0])
