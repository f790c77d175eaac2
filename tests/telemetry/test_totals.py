"""Whole-run totals of a resumed run (finetune/telemetry/formulas.py and the record assembly in
finetune/training/run.py): an earlier segment's kept steps[] entries plus this launch's steps,
with every expected value worked out here by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from finetune.telemetry import formulas


def _entry(step, loss, trained, inputs, step_s, mfu=None, window=1, world=2, examples=4):
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "trained_tokens": trained,
        "input_tokens": inputs,
        "examples": examples,
        "window_steps": window,
        "world_size": world,
        "step_s": step_s,
        "data_loading_s": 0.0,
        "data_loading_share": 0.0,
        "mfu": mfu,
        "host_peak_rss_gib": 1.0,
        "device_peak_allocated_gib": None,
    }


EARLIER = [_entry(1, 3.0, 10, 20, 5.0, 0.1), _entry(2, 2.0, 12, 22, 1.0, 0.2), _entry(3, 1.0, 14, 24, 2.0, 0.3)]


def record_figures(rec, *args, **kwargs) -> None:
    """The figures after training into `rec`, as finetune/training/run.py record_end hands them over."""
    from finetune.training import endings

    summary, sections = endings.figures(rec.view, *args, **kwargs)
    rec.update("summary", **summary)
    for name, value in sections.items():
        rec.set(name, value)


def test_totals_cover_every_segment():
    """Issue 15 item 7: summary totals covered only the last segment while steps[] covered the run."""
    summary, stretches, excluded = formulas.whole_run(
        EARLIER, [0, 3], warmup=1, steps=2, trained=30, inputs=50, train_loss=0.5
    )
    assert summary["total_trained_tokens"] == 10 + 12 + 14 + 30
    assert summary["total_input_tokens"] == 20 + 22 + 24 + 50
    assert summary["steps_counted"] == 5
    assert summary["train_loss"] == pytest.approx((3.0 + 2.0 + 1.0 + 0.5 * 2) / 5)  # mean per optimizer step
    assert excluded == 1  # step 1: the earlier segment's warm-up
    assert [(s.steps, s.seconds, s.trained, s.devices) for s in stretches] == [(1, 1.0, 12, 2), (1, 2.0, 14, 2)]
    assert stretches[0].peak_seconds == pytest.approx(0.2 * 1.0 * 2)  # mfu x time x devices


def test_windows_of_several_steps_a_gap_and_entries_without_window_steps():
    """Logs every 2 steps; the earlier segment crashed after step 3 and resumed from checkpoint-3:
    step 3 was never logged, so 4 of the 5 steps are counted, and said so."""
    old = [dict(_entry(2, 2.5, 22, 42, 3.0), window_steps=None)]  # written before window_steps existed
    summary, stretches, excluded = formulas.whole_run(
        old, [0, 3], warmup=1, steps=2, trained=30, inputs=50, train_loss=1.0
    )
    assert summary["steps_counted"] == 4 and summary["total_trained_tokens"] == 52
    assert summary["train_loss"] == pytest.approx((2.5 * 2 + 1.0 * 2) / 4)
    assert excluded == 2 and stretches == []  # the window holds the warm-up step: left out whole
    three = [_entry(2, 2.0, 20, 40, 1.0, window=2), _entry(4, 1.0, 20, 40, 1.5, window=2)]
    _, stretches, excluded = formulas.whole_run(three, [0, 4], warmup=1, steps=0, trained=0, inputs=0, train_loss=None)
    assert excluded == 2 and [(s.steps, s.seconds) for s in stretches] == [(2, 3.0)]


def test_not_resumed_means_no_earlier_entries():
    assert formulas.earlier_entries(EARLIER, None) == []
    assert formulas.earlier_entries(EARLIER + [_entry(5, 1.0, 1, 1, 1.0)], 3) == EARLIER


def test_the_record_of_a_resumed_run_is_whole_run(tmp_path, tiny_model_dir):
    """The record assembly (finetune/training/run.py) on a record continued from checkpoint-3: the
    summary and throughput cover steps 1-5, and say what throughput covers."""
    from transformers import AutoModelForCausalLM

    from finetune.telemetry.record import RunRecord

    rec = RunRecord(tmp_path / "run.json", run_name="r", recipe="demo", config={})
    rec.set("steps", EARLIER + [_entry(4, 0.6, 15, 25, 9.0), _entry(5, 0.4, 15, 25, 1.0)])  # this launch's logs too
    rec.set(
        "batch",
        {
            "per_device": 4,
            "grad_accum": 1,
            "data_parallel_size": 2,
            "effective": 8,
            "input_tokens_per_step": None,
            "trained_tokens_per_step": None,
        },
    )
    rec.update(
        "summary",
        resumed_from="checkpoint-3",
        resumed_at_step=3,
        resumes=1,
        resume_history=[
            {"from": "checkpoint-3", "step": 3, "at": "now", "previous_status": "interrupted", "steps_discarded": 0}
        ],
    )
    measured = {
        "step_s": [9.0, 1.0],
        "input_tokens": [25, 25],
        "trained_tokens": [15, 15],
        "samples": [4, 4],
        "sum_sq_lengths": [200, 200],
        "host_lifetime_peak_gib": 1.0,
        "memory": {"per_rank": [], "max": {}, "host_peak_method": "vmhwm", "loading": {"per_rank": [], "max": {}}},
    }
    cfg = SimpleNamespace(training=SimpleNamespace(throughput_warmup_steps=1), method=SimpleNamespace(name="lora"))
    record_figures(rec, measured, AutoModelForCausalLM.from_pretrained(tiny_model_dir), cfg, world=2, train_loss=0.5)
    s, tp = rec.view.data["summary"], rec.view.data["throughput"]
    assert s["total_trained_tokens"] == 10 + 12 + 14 + 30 and s["total_input_tokens"] == 20 + 22 + 24 + 50
    assert s["steps_counted"] == 5 and s["train_loss"] == pytest.approx(7.0 / 5)
    # measured: earlier steps 2, 3 and this launch's step 5 (steps 1 and 4 are their segments' warm-up)
    assert tp["steps_measured"] == 3 and tp["warmup_steps_excluded"] == 2
    assert tp["trained_tokens_per_s"] == pytest.approx((12 + 14 + 15) / (1.0 + 2.0 + 1.0), abs=1e-3)
    assert tp["trained_tokens_per_s_per_device"] == pytest.approx((12 + 14 + 15) / (2 * 4.0), abs=1e-3)
    assert tp["samples_per_s"] == pytest.approx(12 / 4.0, abs=1e-4)
    if rec.view.get("hardware", "device_type") == "cpu":
        assert tp["mfu"] is None and "not in the peak-FLOPS table" in tp["mfu_note"]
    assert "earlier segments" in tp["scope"] and "excludes data loading" in tp["scope"]
    assert formulas.throughput([], excluded=0)["steps_measured"] == 0


def test_a_figure_error_after_training_leaves_the_run_completed_with_the_reason(tmp_path, tiny_model_dir, capsys):
    """Issue 15 item 2: an error in the figures after training turned a completed run into `failed`."""
    from transformers import AutoModelForCausalLM

    from finetune.telemetry.record import RunRecord
    from finetune.telemetry.summary import print_summary

    rec = RunRecord(tmp_path / "run.json", run_name="r", recipe="demo", config={})
    rec.update("summary", status="completed", steps=2, wall_s=3.0, train_s=2.0)
    broken = {"step_s": [1.0, 1.0], "input_tokens": [5, 5], "trained_tokens": [2, 2]}  # no memory, no lengths
    cfg = SimpleNamespace(training=SimpleNamespace(throughput_warmup_steps=1), method=SimpleNamespace(name="full"))
    record_figures(rec, broken, AutoModelForCausalLM.from_pretrained(tiny_model_dir), cfg, world=1, train_loss=1.0)
    data = rec.view.data
    assert data["summary"]["status"] == "completed" and data["memory"] is None
    assert data["throughput"]["mfu"] is None and data["throughput"]["mfu_note"].startswith(
        "figures not computed: KeyError"
    )
    rec.set(
        "batch",
        {
            "per_device": 1,
            "grad_accum": 1,
            "data_parallel_size": 1,
            "effective": 1,
            "input_tokens_per_step": None,
            "trained_tokens_per_step": None,
        },
    )
    rec.set("lr", {"base": 1e-3, "rule": "none", "reference_batch": 1, "factor": 1.0, "applied": 1e-3})
    rec.set("strategy", {"name": "single", "distributed_type": "NO"})
    print_summary(rec.view, tmp_path, None, "full")  # the end-of-run table does not fail on the nulls
    assert "run r completed" in capsys.readouterr().out
