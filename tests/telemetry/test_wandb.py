"""W&B with no account and no network: a real offline wandb run, read back from its own files."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from finetune.telemetry import wandb_logging
from tests.conftest import REPO
from tests.wandb_records import read_records, summarize


def readme_keys() -> dict[str, tuple[str, str]]:
    """docs/usage.md "W&B keys": key -> (history | summary, when)."""
    section = (REPO / "docs" / "usage.md").read_text().split("### W&B keys", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1] in ("history", "summary"):
            for key in re.findall(r"`([^`]+)`", cells[0]):
                out[key] = (cells[1], cells[2])
    return out


def test_the_readme_documents_each_meaning_under_one_name():
    keys = readme_keys()
    assert len(keys) > 30 and {when for _, when in keys.values()} == {"always", "GPU", "MFU", "exact match"}
    history = {k for k, (where, _) in keys.items() if where == "history"}
    summary = {k for k, (where, _) in keys.items() if where == "summary"}
    assert history and summary and not history & summary
    # a whole-run figure and a log window's never share a name (issue 27 item 9: both were perf/...)
    assert all(k.startswith("train/") for k in history)
    assert not {k.split("/", 1)[1] for k in history} & {k.split("/", 1)[1] for k in summary if "/" in k}


@pytest.mark.integration
def test_offline_run_logs_the_keys_the_readme_documents_and_stages_its_artifact(tmp_path, tiny_model_dir, launch):
    env = {"HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}  # no ~/.netrc, no API key: must go offline by itself
    env["FINETUNE_SAMPLE_TRACE"] = str(tmp_path / "trace")  # what the rank imported by its first step
    run_dir = tmp_path / "runs" / "wb"
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(
        "".join(json.dumps({"instruction": f"Add {i} and 1.", "output": str(i + 1)}) + "\n" for i in range(4))
    )
    args = [
        "--recipe",
        "demo",
        f"--model.name_or_path={tiny_model_dir}",
        "--data.demo_train_size=32",
        "--eval.exact_match=true",
        f"--eval.heldout_path={heldout}",
        "--eval.samples=4",
        "--eval.max_new_tokens=2",
        "--training.max_steps=3",
        "--training.logging_steps=1",
        "--training.per_device_train_batch_size=4",
        "--logging.report_to=[wandb]",
        "--logging.print_config=true",
        "--run.name=wb",
    ]
    res = launch(args, run_dir=run_dir, cwd=tmp_path, env=env, unset_env_prefix="WANDB_")
    assert res.returncode == 0, res.explain()
    # W&B imported where reported to (the control of tests/training/test_strategies.py's runs, which import none)
    loaded = json.loads((tmp_path / "trace" / "rank0.imports.json").read_text())["packages"]
    assert "wandb" in loaded and "bitsandbytes" not in loaded and "deepspeed" not in loaded, loaded
    rec = res.record
    assert "saved to" in res.stderr and "\nmodel:\n  name_or_path:" in res.stderr  # --logging.print_config=true
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

    # the keys, against docs/usage.md's table (a CPU run: no GPU or MFU keys; exact match on)
    documented = readme_keys()
    expected = {where: {k for k, (w, when) in documented.items() if w == where and when in ("always", "exact match")}
                for where in ("history", "summary")}  # fmt: skip
    logged = {k for h in wb["history"] for k in h if not k.startswith("_")}
    assert logged == expected["history"], (sorted(logged - expected["history"]), sorted(expected["history"] - logged))
    summary = {k for k in wb["summary"] if not k.startswith("_")} - logged  # W&B keeps each history key's last value
    assert summary == expected["summary"], (
        sorted(summary - expected["summary"]),
        sorted(expected["summary"] - summary),
    )

    steps = [h for h in wb["history"] if "train/loss" in h]
    assert len(steps) == 3
    assert sum(h["train/tokens/trained"] for h in steps) == rec["summary"]["total_trained_tokens"]
    assert [h["train/loss"] for h in steps] == pytest.approx([s["loss"] for s in rec["steps"]], rel=1e-6)
    got = wb["summary"]
    assert got["run/memory/max/host_peak_rss_gib"] == rec["memory"]["max"]["host_peak_rss_gib"]
    assert got["run/throughput/trained_tokens_per_s"] == rec["throughput"]["trained_tokens_per_s"]
    assert got["run/eval/exact_match_after"] == rec["eval"]["exact_match_after"]
    assert got["run/status"] == "completed"

    # the run-record artifact, staged inside the run directory (a `wandb sync` elsewhere keeps it)
    (artifact,) = wb["artifacts"]
    assert artifact.type == "run-record"
    entries = {entry.path: entry.local_path for entry in artifact.manifest.contents}
    assert {"run.json", "config.yaml"} <= set(entries)
    for name, local in entries.items():
        staged = Path(local)
        assert staged.is_relative_to(run_dir / "wandb") and staged.is_file(), (name, local)
    assert Path(entries["config.yaml"]).read_bytes() == (run_dir / "config.yaml").read_bytes()


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


ONLINE_WITHOUT_SERVER = """
import json, logging, sys, time
from pathlib import Path
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
from finetune.telemetry import wandb_logging
from finetune.telemetry.record import RunRecord

run_dir = Path(sys.argv[1])
mode = wandb_logging.configure_environment("p", run_dir)
record = RunRecord(run_dir / "run.json", run_name="r", recipe="demo", config={})
sink = wandb_logging.WandB("p", run_dir)
started = time.monotonic()
sink.start(record.view)
waited = time.monotonic() - started
sink.run.log({"train/loss": 1.0})
sink.close(record.view, 1)
print("RESULT", json.dumps({"mode": mode, "offline": sink.run.settings._offline, "sync_dir": sink.run.settings.sync_dir,
                  "waited_s": round(waited, 1)}))
"""


def test_online_without_a_reachable_server_falls_back_to_offline_with_one_warning(tmp_path):
    """An API key but no way to the W&B server (here: a local port nobody listens on; this machine
    has no route to the real one either): before, wandb.init raised CommError after its 90 s timeout
    retrying (190 s seen) and the run failed, exit 1. Now it logs offline into the run directory after
    one warning that names that directory and the `wandb sync` command (init_timeout 15 s by default:
    27 s in all measured here; 2 s here to keep the test short)."""
    import json
    import subprocess
    import sys

    from tests.conftest import free_port

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {
        "HOME": str(tmp_path),
        "WANDB_API_KEY": "0123456789" * 4,
        "WANDB_BASE_URL": f"http://127.0.0.1:{free_port()}",
        "WANDB_INIT_TIMEOUT": "2",  # wandb's own setting, honoured (the run's default: 15 s)
        "PYTHONPATH": str(REPO),
    }
    p = subprocess.run(
        [sys.executable, "-c", ONLINE_WITHOUT_SERVER, str(run_dir)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])
    print(f"W&B online without a server: offline after {got['waited_s']} s")
    assert got["mode"] == "online" and got["offline"] is True, got
    sync_dir = Path(got["sync_dir"])
    assert sync_dir.parent == run_dir / "wandb" and sync_dir.name.startswith("offline-run-"), got
    assert any(sync_dir.glob("*.wandb")), list(sync_dir.iterdir())
    warnings = [line for line in p.stderr.splitlines() if line.startswith("WARNING finetune.telemetry.wandb_logging")]
    assert len(warnings) == 1, p.stderr[-4000:]
    assert f"logging offline to {sync_dir} instead" in warnings[0] and f"`wandb sync {sync_dir}`" in warnings[0]
