"""The activation arithmetic (finetune/planning/activations.py) against what autograd actually saves,
to the byte, for every dtype flow the planner knows: 16-bit and fp32 full fine-tuning, autocast over
fp32 weights, LoRA with fp32 and bf16 adapters with and without autocast, QLoRA's fp32 stream, a
padding mask and packed rows (masked SDPA with repeated k/v), eager attention, Qwen3's q/k norms and
LoRA dropout. The count (tests/planning/mechanism.py saved_per_layer) is independent of the planner:
the unique storages the saved-tensor hooks see while each decoder layer runs.

Tiny Llama with Llama-3.2-1B's ratios, 2 layers, b=2 x s=96 (192 tokens, not equal to any weight
dimension). On CPU the kernel CUDA would pick is forced (mem-efficient attention is CUDA-only; CPU
flash takes the same inputs and saves the same tensors)."""

from __future__ import annotations

import pytest

from finetune.planning import activations as act
from finetune.planning.shapes import shape_of
from tests.planning import mechanism as mech

B, S = 2, 96
F32 = 4

CASES = {  # id: (regime, options)
    "bf16_true_full": ("bf16_true_full", {}),
    "fp32_full_math": ("fp32_full", {}),
    "bf16_mixed_full_autocast": ("bf16_mixed_full", {}),
    "lora_fp32_adapters_no_autocast": ("lora_legacy", {}),
    "lora_bf16_mixed_autocast": ("lora_mixed", {}),
    "lora_bf16_true": ("lora_bf16_true", {}),
    "qlora_fp32_stream_math": ("qlora_legacy", {}),
    "qlora_bf16_mixed_autocast": ("qlora_mixed", {}),
    "padding_mask_kv2": ("bf16_true_full", {"pad": 5, "kv": 2}),
    "packed_rows_kv2": ("bf16_true_full", {"packed": True, "kv": 2}),
    "eager_fp32_kv2": ("fp32_full", {"attn": "eager", "kv": 2}),
    "eager_bf16_kv2": ("bf16_true_full", {"attn": "eager", "kv": 2}),
    "qwen3_qk_norms": ("bf16_true_full", {"model_type": "qwen3"}),
    "lora_dropout": ("lora_legacy", {"dropout": 0.1}),
}


def measure_and_predict(regime: str, opt: dict):
    cfg = mech.config(
        opt.get("model_type", "llama"), attn=opt.get("attn", "sdpa"), num_key_value_heads=opt.get("kv", 1)
    )
    model = mech.build(regime, cfg, lora_dropout=opt.get("dropout", 0.0))
    inputs = mech.batch(cfg.vocab_size, B, S, pad=opt.get("pad", 0), packed=opt.get("packed", False))
    layout = "packed" if opt.get("packed") else "padded"
    w = mech.workload(
        regime,
        B,
        S,
        attn_implementation=opt.get("attn", "sdpa"),
        layout=layout,
        masked=bool(opt.get("pad")),
        lora_dropout=opt.get("dropout", 0.0),
    )
    p = mech.REGIMES[regime][3]
    A = act.activations(shape_of(cfg), w, p)
    measured = mech.saved_per_layer(model, inputs, regime, A["attn_kind"])
    return measured, A, w, cfg


@pytest.mark.parametrize("case", list(CASES))
def test_saved_tensors_per_layer_are_the_formula_to_the_byte(case):
    regime, opt = CASES[case]
    measured, A, w, cfg = measure_and_predict(regime, opt)
    T = w.tokens
    cpu = cpu_only(regime, opt, w, cfg)
    casts = A["weight_casts_layer"]  # autocast's bf16 weight copies, saved inside the layer that reads them
    assert measured["layer1"] == A["per_layer"] + casts + cpu["layer"], A["parts"]
    # layer 0 also saves the rotary tables every layer shares (first saved there); LoRA's layer 0 saves
    # nothing for its input norm nor q/k/v's weight copies (the frozen embedding's output needs no grad)
    assert measured["layer0"] == A["first_layer"] + A["rotary"] + A["weight_casts_first"] + cpu["first"]
    # outside the layers: the final norm and the head's input (when it trains) or weight copy (autocast),
    # the loss's fp32 log-softmax (T x V), targets and nll_loss's total_weight (an fp32 scalar); a trained
    # embedding saves the batch's input_ids (the batch itself, counted as such by the planner)
    full = mech.REGIMES[regime][0] == "full"
    head_cast = A["weight_casts"] - casts - A["weight_casts_first"]
    assert measured["outside"] == (
        A["final"] + A["indices"] + F32 * T * cfg.vocab_size + F32 + head_cast + (8 * T if full else 0)
    )


def cpu_only(regime: str, opt: dict, w, cfg) -> int:
    """Per-layer bytes the CPU saves where CUDA does not (the planner counts CUDA), each from a line of code:
    * lora_dropout: at::dropout on CPU multiplies by a bernoulli noise tensor of the input's dtype and saves
      it (aten/src/ATen/native/Dropout.cpp _dropout_impl); CUDA's fused native_dropout saves a bool mask;
    * QLoRA under autocast: peft lora/bnb.py Linear4bit.forward skips its input cast when
      torch.is_autocast_enabled() (CUDA's autocast state) is true; under CPU autocast it casts o_proj's
      bf16 input to fp32 and autocast casts it back: a copy where CUDA shares the attention output."""
    T, h, i, q = w.tokens, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    if opt.get("dropout"):  # q, k, v, gate, up read h; o reads q; down reads i. Layer 0's q/k/v keep no
        # noise: their input needs no grad (nor, on CUDA, a mask: the planner's first layer has none)
        return {"layer": (F32 - 1) * T * (5 * h + q + i), "first": (F32 - 1) * T * (2 * h + q + i)}
    if regime == "qlora_mixed":
        return {"layer": 2 * T * q, "first": 2 * T * q}
    return {"layer": 0, "first": 0}


def test_the_kernel_rule():
    """What the byte counts above assume CUDA runs (torch sdp_utils: flash/cuDNN need 16-bit and no mask,
    mem-efficient takes masks but not enable_gqa; transformers passes enable_gqa only without a mask).
    A rule, not a measurement: CPU has no mem-efficient kernel; the GPU check in docs/planning.md."""

    def kind(dtype_bytes, **kw):
        return act.attention_kind(mech.workload("bf16_true_full", B, S, **kw), dtype_bytes)

    assert (kind(2), kind(4), kind(2, masked=True), kind(4, layout="packed")) == (
        "flash",
        "math",
        "efficient",
        "efficient",
    )
    assert (
        kind(4, attn_implementation="eager") == "eager" and kind(4, attn_implementation="flash_attention_2") == "flash"
    )


def test_control_the_previous_formula_misses_16_bit_layers():
    """The formula the planner had, a·s·b·(6h + 2q + 2kv + 4i + 2) + 4·b·heads·s, was checked in fp32 only;
    in bf16 the norms' fp32 copies make it 8% short: the byte-exact test above would catch it."""
    measured, A, w, cfg = measure_and_predict("bf16_true_full", {})
    h, i, H, hd, kvh = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.head_dim, 1
    old = 2 * S * B * (6 * h + 2 * H * hd + 2 * kvh * hd + 4 * i + 2) + 4 * B * H * S
    assert abs(old - measured["layer1"]) / measured["layer1"] > 0.05
