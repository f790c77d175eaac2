"""W&B with no account and no network: a real offline wandb run, read back from its own files."""

from __future__ import annotations

import os

import pytest

from finetune.telemetry import wandb_logging
from tests.wandb_records import read_records, summarize


@pytest.mark.integration
def test_offline_run_holds_config_steps_summary_and_artifact(tmp_path, tiny_model_dir, launch):
    env = {"HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}  # no ~/.netrc, no API key: must go offline by itself
    run_dir = tmp_path / "runs" / "wb"
    args = [
        "--recipe",
        "demo",
        f"--model.name_or_path={tiny_model_dir}",
        "--data.demo_train_size=32",
        "--eval.exact_match=false",
        "--training.max_steps=3",
        "--training.logging_steps=1",
        "--training.per_device_train_batch_size=4",
        "--logging.report_to=[wandb]",
        "--run.name=wb",
    ]
    res = launch(args, run_dir=run_dir, cwd=tmp_path, env=env, unset_env_prefix="WANDB_")
    assert res.returncode == 0, res.explain()
    rec = res.record
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, list((run_dir / "wandb").rglob("*"))
    wb = summarize(read_records(files[0]))

    assert wb["run"].display_name == "wb" and wb["run"].run_group == "demo"
    assert {"single", "lora"} <= set(wb["run"].tags)
    assert wb["config"]["effective_batch_size"] == rec["batch"]["effective"] == 4
    assert wb["config"]["lr_applied"] == rec["lr"]["applied"]
    assert wb["config"]["finetune"]["lr"]["rule"] == rec["lr"]["rule"]
    assert wb["config"]["precision"] == rec["precision"]["policy"] == "32-true"  # the CPU default (auto)
    assert wb["config"]["finetune"]["precision"] == rec["precision"]  # as read from the live run, at the end

    steps = [h for h in wb["history"] if "train/loss" in h]
    assert len(steps) == 3
    for h in steps:
        for key in (
            "train/perf/trained_tokens_per_s",
            "train/perf/step_s",
            "train/memory/max_host_peak_rss_gib",
            "train/tokens/trained",
            "train/learning_rate",
        ):
            assert key in h, f"{key} missing from logged step {sorted(h)}"
    assert sum(h["train/tokens/trained"] for h in steps) == rec["summary"]["total_trained_tokens"]
    assert [h["train/loss"] for h in steps] == pytest.approx([s["loss"] for s in rec["steps"]], rel=1e-6)

    summary = wb["summary"]
    assert summary["memory/max_host_peak_rss_gib"] == rec["memory"]["max"]["host_peak_rss_gib"]
    assert summary["perf/trained_tokens_per_s"] == rec["throughput"]["trained_tokens_per_s"]
    assert summary["status"] == "completed"

    (artifact,) = wb["artifacts"]
    assert artifact.type == "run-record"
    assert {"run.json", "config.yaml"} <= {entry.path for entry in artifact.manifest.contents}


def test_offline_unless_a_key_is_configured_and_explicit_mode_respected(tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_DIR", "WANDB_LOG_MODEL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert wandb_logging.configure_environment("p", tmp_path) == "offline"
    assert os.environ["WANDB_DIR"] == str(tmp_path) and os.environ["WANDB_PROJECT"] == "p"

    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_logging.configure_environment("p", tmp_path) == "online"
    assert "WANDB_MODE" not in os.environ

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.delenv("WANDB_API_KEY")
    assert wandb_logging.configure_environment("p", tmp_path) == "disabled"

    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / ".netrc").write_text("machine api.example-wandb.test\n  login user\n  password k\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert wandb_logging.has_api_key()
