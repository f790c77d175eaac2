"""The SDPA backend policy (finetune/modeling/attention.py): choosing a backend does not change the
loss, and the choice really engaged.

The CPU has two SDPA kernels, FLASH (aten::_scaled_dot_product_flash_attention_for_cpu) and MATH
(aten::_scaled_dot_product_attention_math). The same fp32 model and batch run under each; the
profiler names the kernel that ran (the control that the switch engaged: a policy that changed
nothing would show the same kernel twice), and loss and every gradient agree at atol 1e-5. Seen:
differences ~1e-7. Padded rows (attention mask) and padding-free rows (the block-diagonal mask
transformers builds from position_ids) both.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from finetune.config.sections import SDPA_BACKENDS
from finetune.modeling import attention
from tests.modeling.test_loss import assert_same, examples, flat, padded, run, tiny

KERNELS = {
    "flash": "aten::_scaled_dot_product_flash_attention_for_cpu",
    "math": "aten::_scaled_dot_product_attention_math",
}


@pytest.fixture(autouse=True)
def restore_flags():
    with attention.flags_restored():  # the setters are process-global: never leak into later tests
        yield


def run_under(policy: list[str], model, batch):
    attention.apply(policy, "cpu")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = run(model, batch)
    return result, {e.name for e in prof.events()}


@pytest.mark.parametrize("layout", ["padded", "padding_free"])
def test_backend_choice_keeps_loss_and_gradients(layout):
    model = tiny()
    batch = (padded if layout == "padded" else flat)(examples())
    with_flash, seen_flash = run_under(["flash"], model, batch)
    with_math, seen_math = run_under(["math"], model, batch)
    assert KERNELS["flash"] in seen_flash and KERNELS["math"] not in seen_flash
    assert KERNELS["math"] in seen_math and KERNELS["flash"] not in seen_math
    assert_same(with_flash, with_math)


def test_policy_resolution_validation_and_record():
    assert tuple(attention.BACKENDS) == SDPA_BACKENDS
    assert attention.resolve("auto", "cuda") == ("flash", "efficient", "math")  # no cuDNN
    assert attention.resolve("auto", "cpu") is None and attention.resolve("torch_default", "cuda") is None
    assert attention.problems(["cudnn", "efficient"], "cpu") and not attention.problems(["cudnn", "efficient"], "cuda")
    assert "allowed: auto, torch_default" in attention.problems(["fast"])[0]
    assert attention.problems("fastest")
    rec = attention.apply(["math"], "cpu", "sdpa")
    assert rec["sdpa_backends_enabled"] == ["math"] and rec["sdpa_backends_policy"] == ["math"]
    assert not torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.cudnn_sdp_enabled()
    rec = attention.apply(list(attention.AUTO_CUDA), "cpu", "sdpa")  # the flags auto sets on CUDA
    assert rec["sdpa_backends_enabled"] == ["flash", "efficient", "math"] and "cudnn" in rec["sdpa_priority"]
    assert attention.apply("auto", "cpu", "eager")["sdpa_backends_enabled"] is None  # not applicable


def test_flags_are_restored():
    before = attention.enabled()
    with attention.flags_restored():
        attention.set_enabled(["math"])
        assert attention.enabled() == ["math"]
    assert attention.enabled() == before
