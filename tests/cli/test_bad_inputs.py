"""The bad-input table (tests/cli/bad_inputs_table.py, docs/bad_inputs.md): each broken input gives
exit 2, a message naming what and where, no traceback, and leaves every file the user had as it was.

Most cases run `finetune train` / finetune/train.py main() in this process (no launch, no weights);
one runs the real `finetune train` command in a subprocess to prove the exit code and the absence of
a traceback end to end. An error from inside the launched process (past preflight) through the real
command: tests/training/test_train_e2e.py::test_bad_data_row_fails_the_run_with_file_and_row_in_the_record.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import torch

from tests.cli import bad_inputs_table
from tests.cli.bad_inputs_table import CASES, REPO, make_workspace, run_case


@pytest.mark.parametrize("case", CASES, ids=[c.what for c in CASES])
def test_bad_input_fails_cleanly(case, tmp_path, tiny_model_dir, monkeypatch):
    if case.gpu_free_only:  # a problem only without CUDA: CUDA hidden, so it runs on GPU machines too (issue 43)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    if case.needs_root and os.geteuid() != 0:
        pytest.skip("made with a mount: needs root")
    out = run_case(case, tmp_path, tiny_model_dir)
    assert not out.launched, "accelerate launch was reached"
    assert out.exit_code == 2, out.message
    assert not out.traceback, out.message
    assert out.message.startswith("error: "), out.message
    missing = [part for part in case.expect if part not in out.message]
    assert not missing, f"message lacks {missing}:\n{out.message}"
    assert out.changed == [], f"user files changed: {out.changed}"
    assert not any(d.startswith("runs/keep") for d in out.created), out.created


def _tree_hashes(root):
    return {p.relative_to(root): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def _finetune(args, cwd, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "finetune.cli", "train", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**_env(), "PYTHONPATH": str(REPO)},
    )


def _env():
    return {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FINETUNE_"))}


def test_finetune_train_command_reports_every_problem_exit_2_without_traceback(tmp_path):
    """The real command: a missing data file, a model path that does not exist and an existing run
    directory, all in one message; nothing launched, the earlier run byte for byte the same."""
    make_workspace(tmp_path)
    before = _tree_hashes(tmp_path)
    proc = _finetune(
        [
            "--recipe",
            "demo",
            "--data.path=missing.jsonl",
            "--eval.exact_match=false",
            "--model.name_or_path=./no-such-model",
            "--run.name=keep",
        ],
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "accelerate launch" not in proc.stdout, proc.stdout + proc.stderr
    assert "3 problems" in proc.stderr and "missing.jsonl: file not found" in proc.stderr
    assert "'./no-such-model': no such local directory" in proc.stderr and "runs/keep already exists" in proc.stderr
    assert _tree_hashes(tmp_path) == before


def test_a_disk_full_at_start_leaves_nothing_that_blocks_the_retry(tmp_path, tiny_model_dir):
    """The full-disk case, then space freed (the tmpfs grown): the run directory it left holds
    nothing but its lock, so the same command's run directory is created again, not refused."""
    from finetune.launch import rundir

    case = next(c for c in CASES if c.what == "disk full when the run starts")
    if os.geteuid() != 0:
        pytest.skip("made with a mount: needs root")
    try:
        out = run_case(case, tmp_path, tiny_model_dir, keep=True)
        assert out.exit_code == 2 and not out.traceback, out.message
        left = tmp_path / "disk" / "run"
        assert left.is_dir() and rundir.contents(left) == [], list(left.iterdir())
        subprocess.run(["mount", "-o", "remount,size=64m", str(tmp_path / "disk")], check=True)
        rundir.prepare_run_dir(left, overwrite=False)  # what the retry does with it: no refusal
    finally:
        bad_inputs_table.cleanup()
