"""The meter (finetune/telemetry/meter.py): its counting rule per batch layout, its per-log window
and its reset, with expected values worked out here from the batches and times given."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from finetune.data import collate, pack
from finetune.data.collate import REAL_TOKENS_KEY
from finetune.data.render import Example
from finetune.telemetry import formulas, meter
from finetune.telemetry.meter import Meter, batch_counts, token_counts
from finetune.telemetry.model_flops import ModelFlops

ONE_RANK = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))
# Examples whose first label is trained (train_on_prompt, plain text): the shifted loss never
# scores it, so the layouts must not count it either.
EXAMPLES = [
    Example(list(range(10, 15)), [10, 11, -100, 13, 14]),
    Example(list(range(20, 29)), list(range(20, 29))),
    Example([30, 31, 32], [30, -100, 32]),
    Example(list(range(40, 47)), [-100] * 3 + [43, 44, 45, 46]),
]


def _config(**data):
    return SimpleNamespace(padding_free=data.get("padding_free", False), packing=data.get("packing", False))


def _layouts() -> dict[str, list[dict]]:
    """The same four examples as the three layouts' collators batch them (two batches each)."""
    features = [{"input_ids": e.input_ids, "labels": e.labels} for e in EXAMPLES]
    model = SimpleNamespace(attn_implementation="sdpa")
    padded = collate.make_collator(_config(), model, 0)
    flat = collate.make_collator(_config(padding_free=True), model, 0)
    packed = collate.make_collator(_config(packing=True), model, 0)
    rows = pack.pack(EXAMPLES, max_length=10, seed=0)  # best-fit decreasing: [9], [7 + 3], [5]
    assert len(rows) == 3 and len({len(r["input_ids"]) for r in rows}) > 1  # several examples in a row, and padding
    return {
        "padded": [padded(features[:2]), padded(features[2:])],
        "padding_free": [flat(features[:2]), flat(features[2:])],
        "packed": [packed(rows[:2]), packed(rows[2:])],
    }


def test_layouts_agree_on_tokens_examples_and_squared_lengths():
    """Issue 15 items 1 and 8: a padding-free or packed row counts the examples it holds (from its
    position_ids restarts), not one; trained tokens are labels[..., 1:] != -100 in every layout.
    Expected values from the examples themselves."""
    want = [
        sum(len(e.input_ids) for e in EXAMPLES),
        sum(sum(1 for x in e.labels[1:] if x != -100) for e in EXAMPLES),
        len(EXAMPLES),
        sum(len(e.input_ids) ** 2 for e in EXAMPLES),
    ]
    for layout, batches in _layouts().items():
        got = sum(batch_counts(b) for b in batches).tolist()
        assert got == want, (layout, got, want)


def test_packed_padding_is_no_example():
    """A packed row's padding restarts position_ids at 0 (its own pseudo-sequence); it is not counted."""
    batch = collate.count_real_tokens(
        collate.collate(
            [
                {"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, 3, 4, 5], "position_ids": [0, 1, 2, 0, 1]},
                {"input_ids": [6, 7], "labels": [6, 7], "position_ids": [0, 1]},
            ],
            pad_token_id=0,
        ),
        [{"input_ids": [1] * 5}, {"input_ids": [6] * 2}],
    )
    assert batch["position_ids"][1].tolist() == [0, 1, 0, 1, 2]  # the padding's own restart
    assert batch_counts(batch).tolist() == [7, 5, 3, 3 * 3 + 2 * 2 + 2 * 2]


def test_token_counts_per_layout():
    ids = torch.ones(2, 5, dtype=torch.long)
    labels = torch.tensor([[5, -100, 3, 4, -100], [-100, 7, 8, 9, -100]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    n_input, n_trained = token_counts(ids, mask, labels, None)  # padded: the mask's ones
    assert (int(n_input), int(n_trained)) == (9, 5)  # label 5 at position 0 is never scored
    n_input, _ = token_counts(ids, None, labels, torch.tensor([4, 3]))  # packed: the stated count per row
    assert int(n_input) == 7
    n_input, _ = token_counts(ids, None, labels, None)  # padding-free: every position
    assert int(n_input) == 10


def test_window_counts_rates_mfu_data_loading_and_reset():
    flops = ModelFlops(matmul_params=100, weight_factor=6, attention_coeff=10, convention="test")
    m = Meter(model_flops=flops, peak_flops=1e6)
    m.start_training(ONE_RANK)
    batch = {
        "input_ids": torch.ones(2, 4, dtype=torch.long),
        "labels": torch.tensor([[-100, 1, 1, 1]] * 2),
        "position_ids": torch.tensor([[0, 1, 2, 0], [0, 1, 2, 3]]),
        REAL_TOKENS_KEY: torch.tensor([4, 2]),
    }
    m.count_batch(batch)
    assert REAL_TOKENS_KEY not in batch  # taken out before the forward pass
    m.count_batch(
        {
            "input_ids": torch.ones(1, 3, dtype=torch.long),
            "labels": torch.tensor([[1, 1, -100]]),
            "attention_mask": torch.tensor([[1, 1, 1]]),
        }
    )
    m.data_loading(0.5)
    m._window_t0 -= 10.0  # the window began 10 s ago (wall clock), so the share is ~0.5 / 10
    m.record_step(2.0)  # one optimizer step of two micro-batches
    m.record_step(1.0)  # one without counted batches
    # row 1: examples of 3 and 1 tokens; row 2: 2 real tokens, 1 example; batch 2: 1 example of 3
    assert m.steps == [(2.0, 9, 7, 4, 9 + 1 + 4 + 9), (1.0, 0, 0, 0, 0)]
    logs = {"loss": 1.5, "learning_rate": 1e-3}
    entry = m.log_window(logs, ONE_RANK, global_step=2)
    assert logs["tokens/input"] == 9 and logs["tokens/trained"] == 7  # 3 + 3 + 1: labels[..., 1:] only
    assert logs["perf/step_s"] == 1.5 and logs["perf/trained_tokens_per_s"] == round(7 / 3.0, 2)
    assert logs["perf/samples_per_s"] == round(4 / 3.0, 3)
    # MFU: (6 x 100 FLOPs x 9 tokens + 10 x 23 squared lengths) / 3 s / 1e6 peak
    assert logs["perf/mfu"] == pytest.approx(round((6 * 100 * 9 + 10 * 23) / 3.0 / 1e6, 4))
    assert logs["perf/data_loading_s"] == 0.5 and 0.04 < logs["perf/data_loading_share"] <= 0.05
    assert logs["memory/max_host_peak_rss_gib"] > 0
    assert entry == {
        **entry,
        "step": 2,
        "loss": 1.5,
        "lr": 1e-3,
        "trained_tokens": 7,
        "input_tokens": 9,
        "examples": 4,
        "window_steps": 2,
        "world_size": 1,
        "data_loading_s": 0.5,
    }
    # the counters start again after a log
    m.record_step(4.0)
    logs = {"loss": 1.0}
    m.log_window(logs, ONE_RANK, global_step=3)
    assert logs["tokens/input"] == 0 and logs["perf/step_s"] == 4.0 and logs["perf/data_loading_s"] == 0.0
    assert m.tail_window(ONE_RANK, 3) is None  # nothing after the last log
    m.record_step(1.0)
    tail = m.tail_window(ONE_RANK, 4)
    assert tail["step"] == 4 and tail["window_steps"] == 1 and tail["loss"] is None


def test_run_figures_mfu_over_measured_steps_and_the_reasons_there_is_none():
    flops = ModelFlops(matmul_params=1000, weight_factor=6, attention_coeff=12, convention="test")
    measured = {
        "step_s": [5.0, 1.0, 2.0],
        "input_tokens": [10, 20, 30],
        "trained_tokens": [5, 10, 15],
        "samples": [2, 2, 2],
        "sum_sq_lengths": [50, 200, 450],
        "memory": {},
    }
    gpu = {"device_type": "cuda", "device_name": "NVIDIA H100 80GB HBM3"}
    fig = meter.run_figures(measured, hardware=gpu, model_flops=flops, flops_reason=None, world_size=1, warmup=1)
    tp = fig["throughput"]
    want = (6 * 1000 * 50 + 12 * 650) / 3.0 / 989.4e12
    assert tp["mfu"] == round(want, 4) and tp["peak_device"] == "H100 SXM" and tp["mfu_note"] is None
    assert tp["flops_per_token"] == round((6 * 1000 * 50 + 12 * 650) / 50, 1)
    assert "excludes data loading" in tp["scope"] and tp["steps_measured"] == 2
    mig = dict(gpu, device_name="NVIDIA A100-SXM4-40GB MIG 1g.5gb")
    tp = meter.run_figures(measured, hardware=mig, model_flops=flops, flops_reason=None, world_size=1, warmup=1)[
        "throughput"
    ]
    assert tp["mfu"] is None and "MIG" in tp["mfu_note"]
    tp = meter.run_figures(
        measured, hardware=gpu, model_flops=None, flops_reason="no attention shape", world_size=1, warmup=1
    )["throughput"]
    assert tp["mfu"] is None and tp["mfu_note"] == "no MFU: no attention shape"
    assert tp["trained_tokens_per_s"] == pytest.approx(25 / 3, abs=1e-3)


def test_rates_exclude_warmup_and_mfu_needs_a_peak():
    r = formulas.rates([5.0, 1.0, 3.0], [50, 10, 30], [100, 20, 60], [4, 2, 2], warmup=1)
    assert (r["excluded"], r["steps"], r["seconds"]) == (1, 2, 4.0)
    assert r["trained_tokens_per_s"] == 40 / 4 and r["input_tokens_per_s"] == 80 / 4 and r["median_step_s"] == 2.0
    assert formulas.rates([2.0], [1], [1], [1], warmup=1)["excluded"] == 0  # no more steps than the warm-up
    assert formulas.rates([0.0], [1], [1], [1], warmup=0)["trained_tokens_per_s"] is None
    # 2e4 model FLOPs in 1 s on 2 devices of 1e5 FLOP/s peak: 10%; no peak, no FLOPs or no time: no MFU
    assert formulas.mfu(2e4, 1.0, 1e5, devices=2) == pytest.approx(0.1)
    assert formulas.mfu(2e4, 1.0, None) is None and formulas.mfu(None, 1.0, 1e5) is None
    assert formulas.mfu(2e4, 0.0, 1e5) is None


def test_run_peak_survives_the_per_log_resets(monkeypatch):
    """The meter resets torch's peak counters after every log window and keeps the max over windows
    (what `finetune bench` now reads for our side). A fake allocator: window peaks of 10 then 3 GiB.
    Control: reading the global counter afterwards, as the benchmark used to, gives 3."""
    from finetune.units import GIB

    class FakeAllocator:
        def __init__(self):
            self.peak = 0

        def stats(self):
            return {
                "allocated_bytes.all.peak": self.peak,
                "reserved_bytes.all.peak": self.peak,
                "active_bytes.all.peak": self.peak,
                "num_alloc_retries": 0,
                "num_ooms": 0,
            }

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


def test_count_batch_takes_the_hosts_counts_and_a_peer_rank_adds_nothing():
    """The collator's counts (Python ints, counted on the CPU batch) are what the meter adds; a rank
    whose tensor/context-parallel peers count the batch adds zeros; a batch without them (Ulysses)
    is counted on the device. Control: the step's total is 2x the batch, not 3x (the peer's zeros)."""
    from finetune.data.collate import COUNTS_KEY
    from finetune.telemetry.meter import BatchShare, counting

    batch = {
        "input_ids": torch.arange(8).reshape(1, 8),
        "attention_mask": torch.ones(1, 8, dtype=torch.long),
        "labels": torch.tensor([[-100, -100, 2, 3, 4, 5, 6, 7]]),
    }
    collate_and_count = counting(lambda features: dict(batch))
    m = Meter()
    on_host = collate_and_count([])
    assert COUNTS_KEY in on_host
    counted = m.count_batch(on_host)
    assert COUNTS_KEY not in on_host and all(type(c) is int for c in counted)
    assert counted == tuple(batch_counts(batch).tolist()) == (8, 6, 1, 64)  # trained: labels[..., 1:] != -100
    m.share = BatchShare(counted=False)
    assert m.count_batch(collate_and_count([])) == (0, 0, 0, 0)
    assert m.count_batch(dict(batch)).tolist() == [0, 0, 0, 0]  # on the device: a tensor, zero as well
    m.share = None
    assert m.count_batch(dict(batch)).tolist() == [8, 6, 1, 64]
    m.record_step(1.0)
    assert m.steps == [(1.0, 16, 12, 2, 128)]
