"""The loss's bytes (finetune/planning/activations.py loss_buffers) against the CPU allocator events of
the loss alone (torch profiler, profile_memory=True): transformers' ForCausalLMLoss in bf16 and fp32,
and issue 14's chunked cross-entropy (finetune/modeling/loss.py)."""

from __future__ import annotations

import pytest
import torch

from finetune.planning import activations as act
from finetune.planning import regimes
from finetune.planning.shapes import Workload, shape_of
from tests.planning import mechanism as mech

T, H, V = 512, 256, 8192


def peak_of(fn) -> int:
    """Peak of bytes created minus bytes freed while fn runs (CPU allocator events)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for _, action, (key, _), size in MemoryProfile(prof.profiler.kineto_results).timeline:
        if key.device.type == "cpu":
            live += size if action == Action.CREATE else (-size if action == Action.DESTROY else 0)
            peak = max(peak, live)
    return peak


def plan(dtype, loss_impl: str, chunk: int = 0, head_trains: bool = True) -> dict:
    policy = "bf16-true" if dtype == torch.bfloat16 else "32-true"
    w = Workload(
        method="full" if head_trains else "lora", micro_batch=1, seq_len=T, precision=policy, loss_impl=loss_impl
    )
    cfg = mech.config(vocab_size=V, hidden_size=H)
    return act.loss_buffers(shape_of(cfg), w, regimes.policy_regime(policy, w.method, "single"), chunk)


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    return hidden, weight, torch.randint(0, V, (T,), generator=g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_standard_loss_forward_and_backward(dtype):
    """Forward: the logits, their fp32 copy and the saved log-softmax (10 bytes per logit from 16-bit, 8 from
    fp32); backward start: saved log-softmax + nll's grad + log-softmax's grad, 12 bytes per logit."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    hidden, weight, labels = inputs(dtype)
    state = {}

    def forward():
        logits = hidden @ weight.t()  # what lm_head returns; Trainer keeps only the loss
        state["loss"] = ForCausalLMLoss(logits[None], labels[None], V, num_items_in_batch=torch.tensor(T))

    fwd = peak_of(forward)
    bwd = peak_of(lambda: state["loss"].backward())
    expected = plan(dtype, "standard")
    assert fwd == pytest.approx(expected["forward"], rel=0.001)
    saved_log_softmax = 4 * T * V  # made in the forward, alive when the backward starts
    # the backward ends with the head's grads (T x H, V x H) beside the log-softmax grad: not the peak here
    assert bwd + saved_log_softmax == pytest.approx(expected["backward"], rel=0.001)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_chunked_loss_of_issue_14(dtype):
    """One chunk's logits at a time (plus the fp32 log-sum-exp per token); the backward's grad_h, fp32 grad_w
    accumulator and one recomputed chunk. On CPU its fp32 accumulation also copies the chunk's grads and
    inputs to fp32 (finetune/modeling/loss.py _addmm_fp32: `acc.addmm_(a.float(), b.float())`; CUDA adds in
    an fp32 output directly): that is added to the planner's CUDA figure here, by name."""
    from finetune.modeling import loss

    hidden, weight, labels = inputs(dtype)
    chunk = 128
    state = {}
    fwd = peak_of(
        lambda: state.__setitem__(
            "loss", loss.ChunkedLinearCrossEntropy.apply(hidden, weight, None, labels, chunk, dtype)
        )
    )
    bwd = peak_of(lambda: state["loss"].backward())
    expected = plan(dtype, "chunked", chunk)
    a = 2 if dtype == torch.bfloat16 else 4
    hidden_bytes = a * T * H  # the input, made before: saved by reference, not a new allocation
    assert fwd == pytest.approx(expected["forward"] - hidden_bytes, rel=0.01)
    cpu_fp32_copies = (4 * chunk * V + 4 * chunk * H) if dtype == torch.bfloat16 else 0
    assert bwd + 4 * T == pytest.approx(expected["backward"] - hidden_bytes + cpu_fp32_copies, rel=0.01)


@pytest.mark.parametrize("tokens, want", [(64, "standard"), (T, "chunked")])
def test_auto_picks_the_loss_that_measures_smaller(tokens, want):
    """`auto` (finetune/modeling/loss_choice.py) weighs the standard loss's fp32 logit tensors against the
    chunked loss's fp32 head-gradient accumulator when the head trains. Measured here, fp32, head
    training: at 64 tokens (h 256, V 8192) the standard loss's backward holds less, at 512 the chunked
    one; the rule must pick the smaller both times (either direction alone would pass a constant rule)."""
    from finetune.modeling import loss, loss_choice

    g = torch.Generator().manual_seed(0)
    measured = {}
    for impl in ("standard", "chunked"):
        hidden = torch.randn(tokens, H, generator=g).requires_grad_()
        weight = torch.randn(V, H, generator=g).requires_grad_()
        labels = torch.randint(0, V, (tokens,), generator=g)
        state = {}
        if impl == "standard":
            from transformers.loss.loss_utils import ForCausalLMLoss

            def forward():
                state["loss"] = ForCausalLMLoss(
                    (hidden @ weight.t())[None],
                    labels[None],
                    V,
                    num_items_in_batch=torch.tensor(tokens),
                )
        else:

            def forward():
                state["loss"] = loss.ChunkedLinearCrossEntropy.apply(hidden, weight, None, labels, 128, torch.float32)

        peak_of(forward)
        measured[impl] = peak_of(lambda: state["loss"].backward())
    got, why = loss_choice.auto_choice(tokens=tokens, vocab=V, hidden=H, head_trains=True, chunk=128)
    assert min(measured, key=measured.get) == want, measured  # the shapes really sit on both sides
    assert got == want, (why, measured)
    # a frozen head (LoRA) has no accumulator: chunked at any length
    assert loss_choice.auto_choice(tokens=tokens, vocab=V, hidden=H, head_trains=False, chunk=128)[0] == "chunked"
