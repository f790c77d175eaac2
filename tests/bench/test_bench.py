"""`finetune bench` smoke tests on CPU: tiny model, 2 steps per side, every side in one call; the
per-shape-overhead rows. Asserts that every side trained and measured, that our side is the trainer
`finetune train` runs under the precision policy asked for (read from the live objects), and that the
report has every ratio column; never asserts a timing (figures on a shared CPU mean nothing)."""

from __future__ import annotations

import json

from finetune.cli import dispatch


def test_bench_runs_ours_and_the_three_baselines_and_reports_every_ratio(tmp_path, bundled_model_dir, capsys):
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
            "--baseline",
            "plain-trainer",
            "trl-plain",
            "trl-tuned",
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
    assert set(runs) == {"finetune", "plain_trainer", "trl_plain", "trl_tuned"}
    for run in runs.values():
        assert run["steps"] == 2 and run["trained_tokens_per_s"] > 0 and run["host_peak_rss_gib"] > 0
        assert sum(run["trained_tokens"]) > 0
        assert run["device_peak_allocated_gib"] is None  # a CPU run
    ours, trainer, plain, tuned = runs["finetune"], runs["plain_trainer"], runs["trl_plain"], runs["trl_tuned"]
    # ours is what `finetune train` runs; every side under the CPU default policy, read back live
    assert (
        ours["trainer"] == "ResilientTrainer" and trainer["trainer"] == "Trainer" and plain["trainer"] == "SFTTrainer"
    )
    assert report["ours"].startswith("ResilientTrainer") and report["precision"]["policy"] == "32-true"
    for run in runs.values():
        assert run["precision"] == {
            "policy": "32-true",
            "param_dtype": "float32",
            "compute_dtype": "float32",
            "optimizer_state_dtype": "float32",
            "master_weights": False,
        }, run["precision"]
    # Same data, same order, same initialisation: every side trained on the same tokens.
    assert ours["trained_tokens"] == trainer["trained_tokens"] == plain["trained_tokens"] == tuned["trained_tokens"]
    for other in (trainer, plain, tuned):
        assert abs(ours["losses"][0] - other["losses"][0]) < 1e-3, (ours["losses"], other["losses"])
    assert ours["padding_fraction"] == 0 and tuned["padding_fraction"] == 0  # padding-free: no padding computed
    assert plain["padding_fraction"] > 0 and trainer["padding_fraction"] > 0  # padded to each batch's longest
    assert trainer["loss_impl"].startswith("the model's own")
    assert ours["loss_impl"]["resolved"] == "chunked"
    assert ours["device_peak_source"].startswith("FinetuneTrainer run peak")
    assert plain["device_peak_source"].startswith("worker tracker")
    assert plain["attention"]["sdpa_backends_policy"] == trainer["attention"]["sdpa_backends_policy"] == "torch_default"
    assert ours["attention"]["sdpa_backends_policy"] == tuned["attention"]["sdpa_backends_policy"] == "auto"
    row = report["summary"][0]
    for base in ("plain_trainer", "trl_plain", "trl_tuned"):
        assert row["ratios"][base]["trained_tokens_per_s"] > 0 and row["ratios"][base]["host_peak_rss_gib"] > 0
    table = (out / "report.md").read_text()
    assert "ours/plain Trainer tok/s" in table and "ours/TRL plain tok/s" in table and "ours/TRL tuned tok/s" in table
    assert "plain Trainer" in table and "TRL plain" in table and "TRL tuned" in table
    assert "precision policy 32-true" in table and "float32/float32" in table
    assert "Ours (`finetune`): ResilientTrainer as finetune train builds it" in table
    assert "ours/TRL tuned tok/s" in capsys.readouterr().out


def test_bench_help_names_the_baselines_and_the_precision_policy(capsys):
    import pytest

    with pytest.raises(SystemExit):
        dispatch.main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--baseline {plain-trainer,trl-plain,trl-tuned}" in out, out
    assert "plain-trainer (transformers.Trainer" in out and "trl-tuned (TRL's" in out
    assert (
        "--precision {auto,bf16-mixed,bf16-true,16-mixed,32-true}" in out and "bf16-mixed (fp32 master weights" in out
    )
    assert "ResilientTrainer" in out


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


def test_summary_gives_medians_ranges_and_each_rounds_ratio():
    """Two rounds (order alternating, so each round's ratio shares that round's machine load): the
    medians' ratio, each round's own ratio and the range, counted here by hand."""
    from finetune.bench import report

    def run(side, rnd, tps):
        return {
            "side": side,
            "method": "lora",
            "round": rnd,
            "trained_tokens_per_s": tps,
            "input_tokens_per_s": tps,
            "mfu": None,
            "median_step_s": 1.0,
            "device_peak_allocated_gib": None,
            "host_peak_rss_gib": 1.0,
            "padding_fraction": 0.0,
            "trained_tokens": [1, 1],
            "warmup_steps_excluded": 1,
        }

    results = [run("finetune", 0, 10.0), run("plain_trainer", 0, 5.0), run("plain_trainer", 1, 40.0)]
    results.append(run("finetune", 1, 20.0))
    row = report.summarize(results, ["lora"])[0]
    assert row["finetune"]["trained_tokens_per_s"] == 15.0 and row["finetune"]["trained_tokens_per_s_range"] == [10, 20]
    ratio = row["ratios"]["plain_trainer"]
    assert ratio["trained_tokens_per_s"] == 15.0 / 22.5 and ratio["trained_tokens_per_s_per_round"] == [2.0, 0.5]
    assert row["ratios"]["trl_plain"]["trained_tokens_per_s"] is None  # a side that did not run
    assert "| lora | finetune | n/a | 15.0 (10.0-20.0) |" in report.markdown_table([row])
    assert "| 0.67 (0.50-2.00) |" in report.markdown_table([row])
