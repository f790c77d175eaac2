"""`finetune bench` smoke tests on CPU: tiny model, 2 steps per side, every side in one call; the
per-shape-overhead rows. Asserts that every side trained and measured and that the report has both
ratio columns; never asserts a timing (figures on a shared CPU mean nothing)."""

from __future__ import annotations

import json

from finetune.cli import dispatch


def test_bench_runs_all_three_sides_and_reports_both_ratios(tmp_path, bundled_model_dir, capsys):
    out = tmp_path / "bench"
    code = dispatch.main(
        [
            "bench",
            "--shape",
            "tiny",
            "--methods",
            "lora",
            "--steps",
            "2",
            "--warmup-steps",
            "1",
            "--batch",
            "2",
            "--seq-len",
            "96",
            "--rounds",
            "1",
            "--in-process",
            "--out",
            str(out),
            "--trl",
            "both",
            "--prompt-median",
            "8",
            "--response-median",
            "24",  # lengths < 96 vary
            "--tokenizer",
            str(bundled_model_dir),
        ]
    )
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["failures"] == []
    runs = {r["side"]: r for r in report["runs"]}
    assert set(runs) == {"finetune", "trl_plain", "trl_tuned"}
    for run in runs.values():
        assert run["steps"] == 2 and run["trained_tokens_per_s"] > 0 and run["host_peak_rss_gib"] > 0
        assert sum(run["trained_tokens"]) > 0
        assert run["device_peak_allocated_gib"] is None  # a CPU run
    ours, plain, tuned = runs["finetune"], runs["trl_plain"], runs["trl_tuned"]
    # Same data, same order, same initialisation: every side trained on the same tokens.
    assert ours["trained_tokens"] == plain["trained_tokens"] == tuned["trained_tokens"]
    assert abs(ours["losses"][0] - plain["losses"][0]) < 1e-3 and abs(ours["losses"][0] - tuned["losses"][0]) < 1e-3
    assert ours["padding_fraction"] == 0 and tuned["padding_fraction"] == 0  # padding-free: no padding computed
    assert plain["padding_fraction"] > 0  # TRL's defaults pad each batch to its longest example
    assert ours["loss_impl"]["resolved"] == "chunked"
    assert ours["device_peak_source"].startswith("FinetuneTrainer run peak")
    assert plain["device_peak_source"].startswith("worker tracker")
    assert plain["attention"]["sdpa_backends_policy"] == "torch_default"
    assert ours["attention"]["sdpa_backends_policy"] == tuned["attention"]["sdpa_backends_policy"] == "auto"
    row = report["summary"][0]
    for trl in ("trl_plain", "trl_tuned"):
        assert row["ratios"][trl]["trained_tokens_per_s"] > 0 and row["ratios"][trl]["host_peak_rss_gib"] > 0
    table = (out / "report.md").read_text()
    assert "ours/TRL plain tok/s" in table and "ours/TRL tuned tok/s" in table
    assert "TRL plain" in table and "TRL tuned" in table
    assert "ours/TRL tuned tok/s" in capsys.readouterr().out


def test_shape_overhead_rows(tmp_path, bundled_model_dir):
    out = tmp_path / "shapes"
    code = dispatch.main(
        [
            "bench",
            "--shape",
            "tiny",
            "--shape-overhead",
            "--steps",
            "1",
            "--warmup-steps",
            "0",
            "--seq-len",
            "32",
            "--out",
            str(out),
            "--tokenizer",
            str(bundled_model_dir),
        ]
    )
    assert code == 0
    report = json.loads((out / "shapes.json").read_text())
    rows = {r["row"]: r for r in report["rows"]}
    assert len(rows) == 6 and report["shape"] == "tiny"
    assert rows["fixed shape 8 x 300 tokens"]["median_ms"] > 0 and rows["variable, bucket 256 tokens"]["steps"] == 1
    assert rows["variable, auto (cuDNN off)"]["median_ms"] is None  # no cuDNN on CPU: n/a, not a duplicate
    assert "n/a: no cuDNN on CPU" in (out / "shapes.md").read_text()
