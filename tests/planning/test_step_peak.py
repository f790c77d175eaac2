"""The phase model (finetune/planning/memory.py) against the peak of a whole training step on CPU,
counted from the allocator events the torch profiler records (tests/planning/mechanism.py step_peak):
forward with transformers' loss, backward, clipping, fused AdamW, zero_grad, after a first step made
the optimizer states. Checks the moment of the peak (the op running then) as well as its size.

Shapes: "logits" (V 16,384, 4 x 128 tokens) is loss-dominated like the H200 records, where the
model is exact; "grads" (1 x 16 tokens) puts the peak at the end of backward; "block" (V 512, 4 x 256)
and "ckpt" (the same with checkpointing) put it inside a block's forward or backward, where the
temporaries are derived op by op but not to the byte (docs/planning.md: within 3% here).
Cases chosen for the suite's time (each profiled step costs seconds); more regimes were run the same
way while building the model (docs/planning.md "CPU evidence")."""

from __future__ import annotations

import functools

import pytest

from finetune.planning import memory
from finetune.planning.shapes import shape_of
from tests.planning import mechanism as mech

SHAPES = {
    "logits": dict(vocab=16384, b=4, s=128),
    "grads": dict(vocab=4096, b=1, s=16),
    "block": dict(vocab=512, b=4, s=256),
    "ckpt": dict(vocab=512, b=4, s=256, ckpt=True),
}
EXACT, BLOCK = 0.005, 0.03

CASES = [  # (regime, shape, predicted phase, op at the measured peak (None: not asserted), tolerance)
    ("bf16_true_full", "logits", "backward_start", "aten::_log_softmax_backward_data", EXACT),
    ("bf16_mixed_full", "logits", "backward_start", "aten::_log_softmax_backward_data", EXACT),
    ("bf16_true_full", "grads", "backward_end", "aten::add", EXACT),  # the tied embedding's two grads added
    ("fp32_full", "block", "last_block_backward", "aten::mul", BLOCK),
    ("lora_legacy", "block", "last_block_forward", "aten::add", BLOCK),  # peft's adapter sum in the forward
    ("bf16_mixed_full", "ckpt", "first_block_backward", "aten::mul", BLOCK),
]


@functools.cache  # the control reuses a measurement of the cases
def measure(regime: str, shape: str) -> dict:
    sp = SHAPES[shape]
    cfg = mech.config(vocab_size=sp["vocab"])
    model = mech.build(regime, cfg, ckpt=sp.get("ckpt", False))
    kind = memory.peak(
        shape_of(cfg), mech.workload(regime, sp["b"], sp["s"]), mech.REGIMES[regime][3], "single", 1, sm=None
    )["attn_kind"]
    return mech.step_peak(model, mech.batch(sp["vocab"], sp["b"], sp["s"]), regime, kind)


def run(regime: str, shape: str, loss_backward_bytes_per_element: int | None = None):
    sp = SHAPES[shape]
    cfg = mech.config(vocab_size=sp["vocab"])
    w = mech.workload(regime, sp["b"], sp["s"], gradient_checkpointing=sp.get("ckpt", False))
    pred = memory.peak(shape_of(cfg), w, mech.REGIMES[regime][3], "single", 1, sm=None)
    measured = measure(regime, shape)
    # the batch is made before the measured step here (the planner counts it among the states)
    persistent = sum(v for k, v in pred["persistent"].items() if k != "batch")
    above_states = pred["allocated"] - persistent - pred["persistent"]["batch"]
    if loss_backward_bytes_per_element is not None:  # the control's alternative loss accounting
        assert pred["phase"] == "backward_start"
        above_states += (loss_backward_bytes_per_element - 12) * w.tokens * sp["vocab"]
    return measured, persistent, above_states, pred


@pytest.mark.parametrize("regime, shape, phase, op, tolerance", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_the_step_peak_and_its_moment(regime, shape, phase, op, tolerance):
    measured, persistent, predicted, pred = run(regime, shape)
    assert pred["phase"] == phase, pred["phases"]
    if op is not None:
        assert measured["op"] == op
    # the model states themselves (parameters, buffers, AdamW states) as the planner counts them; QLoRA's
    # quantization state and the rotary buffer are the 1%
    assert measured["states"] == pytest.approx(persistent, rel=0.01)
    assert predicted == pytest.approx(measured["peak"], rel=tolerance)


def test_control_four_fp32_loss_buffers_at_once_miss_the_logits_peak():
    """The previous planner counted logits + fp32 copy + log-softmax + its grad at once (16 bytes per
    logit in 16-bit, beside activations); the live set at the loss's backward holds 12. With 16 the
    loss-dominated peak is off by far more than the tolerance above: the comparison can fail."""
    measured, _, predicted, _ = run("bf16_true_full", "logits", loss_backward_bytes_per_element=16)
    assert abs(predicted - measured["peak"]) / measured["peak"] > 10 * EXACT


@pytest.mark.parametrize("shape, phase", [("logits", "backward_start"), ("block", "final_norm_backward")])
def test_the_step_peak_with_issue_14s_chunked_loss(shape, phase):
    """bf16-mixed full fine-tuning with the chunked loss installed (finetune/modeling/loss.py):
    the loss keeps the head's input itself and casts the head's weight with autocast off, so no lm_head
    input or autocast copy of the head is saved; one 128-token chunk at a time. With a small vocabulary the
    peak moves to the final norm's backward. On CPU the loss's fp32 accumulation copies the chunk's grads
    and inputs to fp32 (its _addmm_fp32: `a.float(), b.float()`; CUDA adds into fp32 directly): added to the
    planner's CUDA figure here, by name, where the loss holds the peak."""
    from finetune.modeling import loss

    regime, sp, chunk = "bf16_mixed_full", SHAPES[shape], 128
    cfg = mech.config(vocab_size=sp["vocab"])
    model = mech.build(regime, cfg)
    loss.install(model, "chunked", chunk=chunk, device_type="cpu")
    w = mech.workload(regime, sp["b"], sp["s"], loss_impl="chunked", loss_chunk_tokens=chunk)
    pred = memory.peak(shape_of(cfg), w, mech.REGIMES[regime][3], "single", 1, sm=None)
    measured = mech.step_peak(model, mech.batch(sp["vocab"], sp["b"], sp["s"]), regime, pred["attn_kind"])
    above_states = pred["allocated"] - sum(pred["persistent"].values())
    cpu_fp32_copies = 4 * chunk * (sp["vocab"] + cfg.hidden_size) if phase == "backward_start" else 0
    assert pred["phase"] == phase
    assert above_states + cpu_fp32_copies == pytest.approx(measured["peak"], rel=EXACT)
