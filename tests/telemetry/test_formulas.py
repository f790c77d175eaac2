"""Throughput, FLOPs and peak tables (finetune/telemetry/formulas.py) against independent computations."""

from __future__ import annotations

import statistics

import pytest

from finetune.telemetry import formulas, meter


@pytest.mark.parametrize("name, label", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA L4", "L4"),
    ("Tesla T4", "T4 (fp16)"),
])
def test_known_devices_have_their_datasheet_peak(name, label):
    assert formulas.peak_flops(name)[0] == label


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA GeForce GTX 1080", "x86_64", None])
def test_unknown_devices_get_no_peak_rather_than_a_guess(name):
    assert formulas.peak_flops(name) is None


def test_flops_per_token_counts_every_matmul_weight(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = model.config
    # Independent N: every parameter that is a matmul weight = all 2-D weights except the
    # embedding table, plus the LM head (tied here, so it is the embedding matrix again).
    n = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in name)
    if cfg.tie_word_embeddings:
        n += model.get_input_embeddings().weight.numel()
    seq = 100.0
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * seq
    full, conv_full = formulas.flops_per_token(cfg, "full", seq)
    lora, conv_lora = formulas.flops_per_token(cfg, "lora", seq)
    assert full == pytest.approx(6 * n + attention)
    assert lora == pytest.approx(4 * n + attention)
    assert "PaLM" in conv_full and "4N" in conv_lora


def test_throughput_excludes_warmup_and_sums_tokens():
    step_s = [5.0, 1.0, 2.0, 3.0]
    trained = [100, 10, 20, 30]
    inputs = [500, 50, 100, 150]
    samples = [8, 8, 8, 8]
    tp = formulas.throughput(step_s, trained, inputs, samples, world_size=2, warmup=1,
                            flops_token=1e9, peak=1e12, devices=2)
    assert tp["warmup_steps_excluded"] == 1 and tp["steps_measured"] == 3
    assert tp["trained_tokens_per_s"] == pytest.approx(60 / 6)
    assert tp["trained_tokens_per_s_per_device"] == pytest.approx(60 / 6 / 2)
    assert tp["input_tokens_per_s"] == pytest.approx(300 / 6)
    assert tp["samples_per_s"] == pytest.approx(24 / 6)
    assert tp["median_step_s"] == statistics.median([1.0, 2.0, 3.0])
    assert tp["mfu"] == pytest.approx((300 / 6) * 1e9 / (1e12 * 2), abs=1e-4)


def test_throughput_of_a_run_no_longer_than_its_warmup_keeps_all_steps_and_says_so():
    tp = formulas.throughput([2.0], [10], [20], [1], world_size=1, warmup=1, flops_token=None, peak=None, devices=1)
    assert tp["warmup_steps_excluded"] == 0 and tp["trained_tokens_per_s"] == 5.0 and tp["mfu"] is None


def test_max_over_ranks_ignores_missing_values():
    per_rank = [{"rank": 0, "host_peak_rss_gib": 1.5, "device_peak_allocated_gib": None},
                {"rank": 1, "host_peak_rss_gib": 2.5, "device_peak_allocated_gib": None}]
    assert formulas.max_over_ranks(per_rank) == {"host_peak_rss_gib": 2.5, "device_peak_allocated_gib": None}


def test_memory_tracker_sees_a_host_allocation():
    tracker = meter.MemoryTracker()
    tracker.reset()
    before = tracker.snapshot()["host_peak_rss_gib"]
    block = bytearray(300 * 2**20)  # 300 MiB, touched so the pages are resident
    for i in range(0, len(block), 4096):
        block[i] = 1
    after = tracker.snapshot()["host_peak_rss_gib"]
    del block
    assert after - before > 0.25
