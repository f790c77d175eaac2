"""`finetune bench` smoke tests on CPU: tiny model, 2 steps per side, every side in one call; the
per-shape-overhead rows. Asserts that every side trained and measured, that our side is the trainer
`finetune train` runs under the precision policy asked for (read from the live objects), and that the
report has every ratio column; never asserts a timing (figures on a shared CPU mean nothing)."""

from __future__ import annotations

import json

import pytest

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
    # every TrainingArguments setting that differs, read from the live arguments, each with why
    diffs = {(d["side"], d["setting"]): d for d in report["settings_differences"]}
    for side in ("plain_trainer", "trl_plain", "trl_tuned"):
        assert diffs[(side, "logging_nan_inf_filter")]["ours"] is False
        assert diffs[(side, "logging_nan_inf_filter")]["theirs"] is True
        assert (side, "learning_rate") not in diffs and (side, "output_dir") in diffs  # the workload is shared
    assert all(d["why"] for d in diffs.values()), [k for k, d in diffs.items() if not d["why"]]
    assert "| plain Trainer | `logging_nan_inf_filter` | False | True | lora | ours off: the step guard" in table
    assert "as its users run it" in table and "unexplained" not in table


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


@pytest.mark.parametrize(
    "option, said",
    [
        (["--warmup-steps", "-1"], "--warmup-steps must be >= 0, got -1"),  # measured the last step alone
        (["--prompt-median", "0"], "--prompt-median must be a number > 0, got 0.0"),  # math domain error
        (["--response-median", "nan"], "--response-median must be a number > 0, got nan"),
        (["--run-timeout", "-5"], "--run-timeout must be a number > 0, got -5.0"),  # every run failed, timed out
        (["--seq-len", "8"], "--seq-len must be >= 16, got 8"),
        # before: accepted; every run of our side then failed in its worker (attention.resolve: ValueError)
        (["--sdpa-backends", ",,"], "--sdpa-backends ',,': allowed: auto, torch_default, or a comma-separated list"),
        (["--sdpa-backends", "flash,nosuch"], "--sdpa-backends 'flash,nosuch': allowed: auto, torch_default, or"),
    ],
)
def test_bench_refuses_a_number_out_of_range_before_anything_runs(tmp_path, capsys, monkeypatch, option, said):
    """Before: --prompt-median 0 ended in a traceback, --warmup-steps -1 gave figures of the last step alone, and
    --run-timeout -5 ran every side into a timeout; now exit 2 naming the option, its bound and the value."""
    from finetune.bench import main as bench_main

    monkeypatch.setattr(bench_main, "run", lambda args: pytest.fail(f"the benchmark ran: {option} was not refused"))
    with pytest.raises(SystemExit) as e:
        dispatch.main(["bench", "--out", str(tmp_path / "b"), *option])
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and "Traceback" not in err, err
    assert not (tmp_path / "b").exists()


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


def run(side, rnd, tps, method="lora", **extra):
    """One side's result as worker.run returns it, with the figures given."""
    return {
        "side": side,
        "method": method,
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
        "losses": [1.0],
        "trainer": "Trainer",
        "precision": {"param_dtype": "float32", "compute_dtype": "float32"},
        **extra,
    }


def test_summary_gives_medians_ranges_each_rounds_ratio_and_its_verdict():
    """Three rounds: the medians' ratio, each round's own ratio and its range, counted here by hand; a
    range that crosses 1.0 is not significant, one above it is a verdict, two rounds are too few."""
    from finetune.bench import report

    ours, plain, trl = (10.0, 20.0, 30.0), (5.0, 40.0, 20.0), (4.0, 8.0, 12.0)
    results = [run(side, r, tps[r]) for r in range(3) for side, tps in zip(SIDES3, (ours, plain, trl))]
    row = report.summarize(results, ["lora"])[0]
    assert row["finetune"]["trained_tokens_per_s"] == 20.0 and row["finetune"]["trained_tokens_per_s_range"] == [10, 30]
    ratio = row["ratios"]["plain_trainer"]
    assert ratio["trained_tokens_per_s"] == 20.0 / 20.0 and ratio["trained_tokens_per_s_per_round"] == [2.0, 0.5, 1.5]
    assert ratio["trained_tokens_per_s_verdict"] == "not significant"  # 0.5-2.0 crosses 1.0
    assert row["ratios"]["trl_plain"]["trained_tokens_per_s_per_round"] == [2.5, 2.5, 2.5]
    assert row["ratios"]["trl_plain"]["trained_tokens_per_s_verdict"] is None  # above 1.0 in every round
    assert row["ratios"]["trl_tuned"]["trained_tokens_per_s"] is None  # a side that did not run
    table = report.markdown_table([row])
    assert "| lora | finetune | float32/float32 | 20.0 (10.0-30.0) |" in table
    assert "| 1.00 (0.50-2.00) not significant | 2.50 (2.50-2.50) |" in table
    two = report.summarize([r for r in results if r["round"] < 2], ["lora"])[0]["ratios"]["trl_plain"]
    assert two["trained_tokens_per_s_verdict"] == "2 round(s): no verdict"


SIDES3 = ("finetune", "plain_trainer", "trl_plain")


def fake_bench(monkeypatch, tmp_path, bundled_model_dir, *extra):
    """`finetune bench` through its real loop and report, each side's training replaced by a result
    whose live TrainingArguments differ from ours in logging_nan_inf_filter unless ours were copied."""
    from finetune.bench import main

    specs = []

    def fake(spec):
        specs.append(spec)
        theirs = {"logging_nan_inf_filter": spec["side"] != "finetune", "learning_rate": 1e-4}
        args = {**theirs, **{k: v for k, v in spec.get("ours_args", {}).items()}}
        return run(spec["side"], spec["round"], 10.0, spec["method"], training_args=args)

    monkeypatch.setattr(main, "_run_in_process", fake)
    out = tmp_path / "bench"
    argv = ["bench", "--methods", "lora", "full", "--rounds", "3", "--in-process", "--out", str(out)]
    argv += ["--baseline", "plain-trainer", "trl-plain", "--tokenizer", str(bundled_model_dir), *extra]
    assert dispatch.main(argv) == 0
    return specs, json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def test_rounds_interleave_the_sides(monkeypatch, tmp_path, bundled_model_dir):
    specs, report, table = fake_bench(monkeypatch, tmp_path, bundled_model_dir)
    order = [(s["method"], s["round"], s["side"]) for s in specs]
    assert order == [(m, r, side) for m in ("lora", "full") for r in range(3) for side in SIDES3]  # A B C, A B C, ...
    assert not any("ours_args" in s for s in specs)  # as users run them
    assert all(len(r["load_1min"]) == 2 for r in report["runs"]) and "1-minute load average" in table


def test_baseline_like_ours_hands_the_baselines_our_live_settings(monkeypatch, tmp_path, bundled_model_dir):
    specs, report, table = fake_bench(monkeypatch, tmp_path, bundled_model_dir, "--baseline-like-ours")
    baselines = [s for s in specs if s["side"] != "finetune"]
    assert baselines and all(s["ours_args"]["logging_nan_inf_filter"] is False for s in baselines)
    assert report["settings_differences"] == [] and "the baselines ran with ours" in table


def test_like_ours_sets_the_baselines_differing_arguments_to_ours(tmp_path):
    """What a baseline side builds from the spec `--baseline-like-ours` gives it: every setting that
    differs from ours set to ours, its own output directory and name kept."""
    from finetune import precision
    from finetune.bench import baselines
    from finetune.training import arguments

    spec = {
        "output_dir": str(tmp_path / "theirs"),
        "steps": 2,
        "batch": 2,
        "learning_rate": 1e-4,
        "gradient_checkpointing": False,
        "seed": 0,
    }
    theirs = arguments.build(**baselines.baseline_args(spec, False, precision.get("32-true")))
    assert theirs.logging_nan_inf_filter is True and theirs.num_train_epochs == 3.0  # Trainer's defaults
    ours = {**json.loads(theirs.to_json_string()), "logging_nan_inf_filter": False, "num_train_epochs": 1.0}
    ours.update(output_dir=str(tmp_path / "ours"), run_name="bench-lora")
    like = baselines.like_ours(theirs, {**spec, "ours_args": ours})
    assert like.logging_nan_inf_filter is False and like.num_train_epochs == 1.0
    assert like.output_dir == str(tmp_path / "theirs") and like.run_name != "bench-lora"
    assert baselines.like_ours(theirs, spec) is theirs  # without the switch: as users run it


@pytest.mark.integration
def test_the_prepared_gpu_session_runs_end_to_end_at_cpu_sizes(tmp_path, bundled_model_dir):
    """tests/bench/gpu_session.py, the script a session lent a GPU runs (issue 47 item 4), proven here with --tiny:
    every step ran, and its figures are read from what each run recorded."""
    from tests.bench import gpu_session

    code = gpu_session.main(["--out", str(tmp_path), "--tiny", "--tokenizer", str(bundled_model_dir)])
    session = json.loads((tmp_path / "session.json").read_text())
    steps = session["steps"]
    assert code == 0 and [s for s in steps.values() if s["status"] == "failed"] == [], steps
    lora = steps["lora_8b_auto"]
    assert lora["trained_tokens_per_s"] > 0 and lora["precision"] == "32-true" and lora["mfu"] is None  # no CPU peak
    assert set(lora["levers"]) == {
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "gradient_checkpointing",
    }
    assert lora["plan_predicted_gib"] > 0 and lora["export_check"]["passed"] is True  # the run's defaults: save checked
    record = json.loads((tmp_path / "runs" / "lora_8b_auto" / "run.json").read_text())
    assert lora["trained_tokens_per_s"] == record["throughput"]["trained_tokens_per_s"]
    assert record["plan"]["auto"] == ["per_device_train_batch_size", "gradient_checkpointing"], record["plan"]
    packed = steps["full_1.5b_packed"]
    assert packed["failures"] == [] and packed["finetune"]["trained_tokens_per_s"] > 0, packed
    assert packed["plain_trainer"]["trained_tokens_per_s"] > 0
    assert all(steps[z]["status"] == "ok" and steps[z]["trained_tokens_per_s"] > 0 for z in ("zero2", "zero3")), steps
    assert steps["doctor"]["status"] == "ok" and "| lora_8b_auto | ok |" in (tmp_path / "session.md").read_text()
