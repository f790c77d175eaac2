"""`finetune bench` smoke test on CPU: tiny model, 2 steps per side, both sides in one call.
Asserts that both sides trained and measured and that the report has the ratio columns;
never asserts a timing (figures on a shared CPU mean nothing)."""

from __future__ import annotations

import json

from finetune.cli import dispatch


def test_bench_runs_both_sides_and_reports_ratios(tmp_path, bundled_model_dir, capsys):
    out = tmp_path / "bench"
    code = dispatch.main(["bench", "--shape", "tiny", "--methods", "lora", "--steps", "2", "--warmup-steps", "1",
                     "--batch", "2", "--seq-len", "96", "--rounds", "1", "--in-process", "--out", str(out),
                     "--tokenizer", str(bundled_model_dir)])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["failures"] == []
    assert {r["side"] for r in report["runs"]} == {"finetune", "trl"}
    for run in report["runs"]:
        assert run["steps"] == 2 and run["trained_tokens_per_s"] > 0 and run["host_peak_rss_gib"] > 0
        assert sum(run["trained_tokens"]) > 0
    ours, trl = sorted(report["runs"], key=lambda r: r["side"])
    # Same data, same order, same initialisation: both sides trained on the same tokens.
    assert ours["trained_tokens"] == trl["trained_tokens"]
    assert abs(ours["losses"][0] - trl["losses"][0]) < 1e-3
    assert ours["padding_fraction"] == 0  # padding-free: every computed position is a real token
    row = report["summary"][0]
    assert row["ratio_trained_tokens_per_s"] > 0 and row["ratio_host_peak"] > 0
    table = (out / "report.md").read_text()
    assert "tok/s ratio (ours/TRL)" in table and "TRL SFTTrainer" in table
    assert "tok/s ratio (ours/TRL)" in capsys.readouterr().out
