"""The activation arithmetic (finetune/planning/activations.py) against what autograd actually saves,
to the byte, for every dtype flow the planner knows: 16-bit and fp32 full fine-tuning, autocast over
fp32 weights, LoRA with fp32 and bf16 adapters with and without autocast, QLoRA's fp32 stream, a
padding mask and packed rows (masked SDPA with repeated k/v), eager attention, Qwen3's q/k norms and
LoRA dropout; and the other families' blocks: Phi-3's fused qkv and gate/up, Gemma 2 (four norms, eager
attention with soft-capping, soft-capped logits) and Gemma 3 (q/k norms, a sliding-window layer whose mask
the full-attention layer does not get). The count (tests/planning/mechanism.py saved_per_layer) is independent of the planner:
the unique storages the saved-tensor hooks see while each decoder layer runs.

Tiny Llama with Llama-3.2-1B's ratios, 2 layers, b=2 x s=96 (192 tokens, not equal to any weight
dimension). On CPU the kernel CUDA would pick is forced (mem-efficient attention is CUDA-only; CPU
flash takes the same inputs and saves the same tensors)."""

from __future__ import annotations

import pytest

from finetune.planning import activations as act
from finetune.planning import shapes
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
    "eager_bf16_kv1": ("bf16_true_full", {"attn": "eager"}),  # repeat_kv's view, copied by matmul's reshape
}
# Gemma 3 at a window shorter than the rows: layer 0 slides (masked), layer 1 attends to everything
GEMMA3 = {"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]}
FAMILY_REGIMES = {
    "bf16_true": ("bf16_true_full", {}),
    "fp32": ("fp32_full", {}),
    "bf16_mixed_autocast": ("bf16_mixed_full", {}),
    "lora_bf16_mixed_autocast": ("lora_mixed", {}),
    "lora_fp32_adapters": ("lora_legacy", {}),
    "qlora_bf16_mixed_autocast": ("qlora_mixed", {}),
    "padding_mask_kv2": ("bf16_true_full", {"pad": 5, "kv": 2}),
    "lora_dropout": ("lora_legacy", {"dropout": 0.1}),
}
for family, extra in [("phi3", {}), ("gemma2", {}), ("gemma3_text", GEMMA3)]:
    for name, (regime, opt) in FAMILY_REGIMES.items():
        CASES[f"{family}_{name}"] = (regime, {**opt, "model_type": family, "config": extra})


def measure_and_predict(regime: str, opt: dict):
    kind, attn = opt.get("model_type", "llama"), opt.get("attn", "sdpa")
    # Gemma 2 has no SDPA: the run loads it with eager (finetune/modeling/attention.py), the plan follows
    loaded = "eager" if kind in shapes.NO_SDPA else attn
    cfg = mech.config(kind, attn=loaded, num_key_value_heads=opt.get("kv", 1), pad_token_id=0, **opt.get("config", {}))
    model = mech.build(regime, cfg, lora_dropout=opt.get("dropout", 0.0))
    inputs = mech.batch(cfg.vocab_size, B, S, pad=opt.get("pad", 0), packed=opt.get("packed", False))
    layout = "packed" if opt.get("packed") else "padded"
    w = mech.workload(
        regime,
        B,
        S,
        attn_implementation=attn,
        layout=layout,
        masked=bool(opt.get("pad")),
        lora_dropout=opt.get("dropout", 0.0),
    )
    p = mech.REGIMES[regime][3]
    A = act.activations(shape_of(cfg), w, p)
    measured = mech.saved_per_layer(model, inputs, regime, A["layer_kinds"])
    return measured, A, w, cfg


@pytest.mark.parametrize("case", list(CASES))
def test_saved_tensors_per_layer_are_the_formula_to_the_byte(case):
    regime, opt = CASES[case]
    measured, A, w, cfg = measure_and_predict(regime, opt)
    T = w.tokens
    cpu = cpu_only(regime, opt, w, cfg, shares_output=A["parts"]["o_input"] == 0)
    for k in range(cfg.num_hidden_layers):
        # autocast's bf16 weight copies are saved inside the layer that reads them; the first layer of each
        # rotary table's users saves the table (cos, sin); LoRA's layer 0 saves nothing for its input norm nor
        # q/k/v's weight copies (the frozen embedding's output needs no grad)
        casts = A["weight_casts_first"] if k == 0 else A["weight_casts_layer"]
        rotary = A["rotary_layers"].get(k, 0)
        assert measured[f"layer{k}"] == A["layers"][k] + rotary + casts + cpu["first" if k == 0 else "layer"], (
            k,
            A["parts"],
        )
    assert sum(A["rotary_layers"].values()) == A["rotary"]
    # outside the layers: the final norm and the head's input (when it trains) or weight copy (autocast),
    # the loss's fp32 log-softmax (T x V), targets and nll_loss's total_weight (an fp32 scalar); a trained
    # embedding saves the batch's input_ids (the batch itself, counted as such by the planner) and Gemma's
    # embedding scale (a 0-dim tensor in the weights' dtype, by the mul that applies it)
    full = mech.REGIMES[regime][0] == "full"
    head_cast = A["weight_casts"] - A["weight_casts_layer"] * (cfg.num_hidden_layers - 1) - A["weight_casts_first"]
    scale = mech.REGIMES[regime][1].itemsize if full and cfg.model_type in shapes.GEMMA else 0
    assert measured["outside"] == (
        A["final"] + A["indices"] + A["logit_softcap"] + F32 * T * cfg.vocab_size + F32 + head_cast + scale
    ) + (8 * T if full else 0)


def cpu_only(regime: str, opt: dict, w, cfg, *, shares_output: bool) -> int:
    """Per-layer bytes the CPU saves where CUDA does not (the planner counts CUDA), each from a line of code:
    * lora_dropout: at::dropout on CPU multiplies by a bernoulli noise tensor of the input's dtype and saves
      it (aten/src/ATen/native/Dropout.cpp _dropout_impl); CUDA's fused native_dropout saves a bool mask;
    * QLoRA under autocast: peft lora/bnb.py Linear4bit.forward skips its input cast when
      torch.is_autocast_enabled() (CUDA's autocast state) is true; under CPU autocast it casts o_proj's
      bf16 input to fp32 and autocast casts it back: a copy where CUDA shares the attention output
      (`shares_output`; phi3 and eager attention give o_proj a copy on both)."""
    T, h, q = w.tokens, cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    sh = shape_of(cfg)
    if opt.get("dropout"):  # every linear's input features; layer 0's q/k/v keep no noise: their input needs
        # no grad (nor, on CUDA, a mask: the planner's first layer has none)
        every = sum(n_in for _, n_in, _ in sh.linears)
        return {"layer": (F32 - 1) * T * every, "first": (F32 - 1) * T * (every - h * len(sh.readers("attn")))}
    if regime == "qlora_mixed" and shares_output:
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


def test_the_families_without_sdpa_are_transformers_own():
    """The plan takes Gemma 2's sdpa request as eager because the run loads it so (its causal-LM class has no
    SDPA); the list must follow transformers' own flag for every family the planner follows."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    lacking = {k for k in shapes.BLOCK_MECHANISM if not getattr(transformers, CAUSAL[k])._supports_sdpa}
    assert lacking == set(shapes.NO_SDPA)


@pytest.mark.parametrize("family", ["phi3", "gemma2", "gemma3_text"])
def test_control_the_llama_block_misses_the_other_families(family):
    """What the plan did not follow before: the Llama block's arithmetic at the same sizes misses each
    family's layer by more than 5% in bf16 (phi3: the fused output kept by v, o_proj's copy; Gemma: four norms,
    eager soft-capped attention, q/k norms), so the byte-exact test above can fail."""
    regime, opt = CASES[f"{family}_bf16_true"]
    measured, A, w, cfg = measure_and_predict(regime, opt)
    llama = mech.config("llama", num_key_value_heads=1)
    as_llama = act.activations(shape_of(llama), w, mech.REGIMES[regime][3])
    assert abs(as_llama["per_layer"] - measured["layer1"]) / measured["layer1"] > 0.05
