"""The meter (finetune/telemetry/meter.py): its counting rule per batch layout, its per-log window
and its reset, with expected values worked out here from the batches and times given."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from finetune.data.collate import REAL_TOKENS_KEY
from finetune.telemetry import formulas
from finetune.telemetry.meter import Meter, token_counts

ONE_RANK = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))


def test_token_counts_per_layout():
    ids = torch.ones(2, 5, dtype=torch.long)
    labels = torch.tensor([[-100, -100, 3, 4, -100], [-100, 7, 8, 9, -100]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    n_input, n_trained = token_counts(ids, mask, labels, None)  # padded: the mask's ones
    assert (int(n_input), int(n_trained)) == (9, 5)
    n_input, _ = token_counts(ids, None, labels, torch.tensor(7))  # packed: the stated count
    assert int(n_input) == 7
    n_input, _ = token_counts(ids, None, labels, None)  # padding-free: every position
    assert int(n_input) == 10


def test_window_counts_rates_and_reset():
    meter = Meter(flops_per_token=lambda seq_len: 1000.0 * seq_len, peak_flops=1e6)
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.tensor([[-100, 1, 1, 1]] * 2),
             REAL_TOKENS_KEY: torch.tensor(6)}
    meter.count_batch(batch)
    assert REAL_TOKENS_KEY not in batch  # taken out before the forward pass
    meter.count_batch({"input_ids": torch.ones(1, 3, dtype=torch.long), "labels": torch.tensor([[1, 1, -100]]),
                       "attention_mask": torch.tensor([[1, 1, 1]])})
    meter.record_step(2.0)  # one optimizer step of two micro-batches
    meter.record_step(1.0)  # one without counted batches
    assert meter.steps == [(2.0, 9, 8, 3), (1.0, 0, 0, 0)]
    logs = {"loss": 1.5, "learning_rate": 1e-3}
    entry = meter.log_window(logs, ONE_RANK, global_step=2)
    assert logs["tokens/input"] == 9 and logs["tokens/trained"] == 8
    assert logs["perf/step_s"] == 1.5 and logs["perf/trained_tokens_per_s"] == round(8 / 3.0, 2)
    assert logs["perf/samples_per_s"] == 1.0
    # MFU: 3 input tokens/s x (1000 x 3 tokens per row) FLOPs per token / 1e6 peak
    assert logs["perf/mfu"] == pytest.approx(round(3 * 3000 / 1e6, 4))
    assert logs["memory/max_host_peak_rss_gib"] > 0
    assert entry == {**entry, "step": 2, "loss": 1.5, "lr": 1e-3, "trained_tokens": 8, "input_tokens": 9}
    # the counters start again after a log
    meter.record_step(4.0)
    logs = {"loss": 1.0}
    meter.log_window(logs, ONE_RANK, global_step=3)
    assert logs["tokens/input"] == 0 and logs["perf/step_s"] == 4.0


def test_rates_exclude_warmup_and_mfu_needs_a_peak():
    r = formulas.rates([5.0, 1.0, 3.0], [50, 10, 30], [100, 20, 60], [4, 2, 2], warmup=1)
    assert (r["excluded"], r["steps"], r["seconds"]) == (1, 2, 4.0)
    assert r["trained_tokens_per_s"] == 40 / 4 and r["input_tokens_per_s"] == 80 / 4 and r["median_step_s"] == 2.0
    assert formulas.rates([2.0], [1], [1], [1], warmup=1)["excluded"] == 0  # no more steps than the warm-up
    assert formulas.rates([0.0], [1], [1], [1], warmup=0)["trained_tokens_per_s"] is None
    assert formulas.mfu(20.0, 1e3, None) is None and formulas.mfu(20.0, 1e3, 1e5, devices=2) == 20 * 1e3 / 2e5


def test_run_peak_survives_the_per_log_resets(monkeypatch):
    """The meter resets torch's peak counters after every log window and keeps the max over windows
    (what `finetune bench` now reads for our side). A fake allocator: window peaks of 10 then 3 GiB.
    Control: reading the global counter afterwards, as the benchmark used to, gives 3."""
    from finetune.units import GIB

    class FakeAllocator:
        def __init__(self):
            self.peak = 0

        def stats(self):
            return {"allocated_bytes.all.peak": self.peak, "reserved_bytes.all.peak": self.peak,
                    "active_bytes.all.peak": self.peak, "num_alloc_retries": 0, "num_ooms": 0}

        def reset(self):
            self.peak = 0

    fake = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", fake.stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset)
    meter = Meter()
    meter.start_training(ONE_RANK)
    for step, window_peak in ((1, 10 * GIB), (2, 3 * GIB)):
        meter.record_step(1.0)
        fake.peak = window_peak
        logs = {"loss": 1.0}
        meter.log_window(logs, ONE_RANK, global_step=step)
        assert logs["memory/max_device_peak_allocated_gib"] == window_peak / GIB
    fake.peak = 3 * GIB  # the tail after the last log
    assert meter.memory.snapshot()["device_peak_allocated_gib"] == 3.0  # the old read: the tail only
    assert meter.final(ONE_RANK)["memory"]["max"]["device_peak_allocated_gib"] == 10.0
