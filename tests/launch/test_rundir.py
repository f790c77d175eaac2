"""The run directory (finetune/launch/rundir.py): never replaced without --overwrite, except what a
run that failed before its first step left behind; the refusal says how to retry."""

from __future__ import annotations

import json

import pytest

from finetune.errors import UserError
from finetune.launch import rundir


def _failed_run(path, **summary):
    path.mkdir(parents=True)
    record = {"summary": {"status": "failed", "steps": 0, "error": "OSError: no network", **summary}, "steps": []}
    (path / "run.json").write_text(json.dumps(record))
    (path / "config.yaml").write_text("model: {}\n")
    (path / "data").mkdir()
    (path / "data" / "train.jsonl").write_text("{}\n")
    return path


def test_a_run_that_failed_before_step_1_leaves_a_directory_the_retry_reuses(tmp_path, capsys):
    """Issue 15 item 11: the retry of a run whose model download failed was refused."""
    path = _failed_run(tmp_path / "runs" / "exp")
    rundir.prepare_run_dir(path, overwrite=False)
    out = capsys.readouterr().out
    assert f"reusing run directory {path}" in out and "failed before its first step (OSError: no network)" in out
    assert path.is_dir() and [p.name for p in path.iterdir()] == [rundir.MARKER]


@pytest.mark.parametrize(
    "what, change",
    [
        (
            "it trained",
            lambda p: (p / "run.json").write_text(json.dumps({"summary": {"status": "failed", "steps": 3}})),
        ),
        ("it completed", lambda p: (p / "run.json").write_text(json.dumps({"summary": {"status": "completed"}}))),
        ("a checkpoint", lambda p: (p / "checkpoint-1").mkdir()),
        ("a file of the user's", lambda p: (p / "notes.txt").write_text("mine")),
        ("no readable record", lambda p: (p / "run.json").write_text("{not json")),
    ],
)
def test_anything_else_is_refused_with_the_retry_commands(tmp_path, what, change):
    path = _failed_run(tmp_path / "runs" / "exp")
    change(path)
    before = sorted(p.name for p in path.iterdir())
    with pytest.raises(UserError) as err:
        rundir.prepare_run_dir(path, overwrite=False)
    msg = str(err.value)
    assert f"run directory {path} already exists; nothing was changed" in msg, what
    assert "--run.name=exp-2" in msg and "--overwrite" in msg
    assert ("--resume" in msg) == (what == "a checkpoint")
    assert sorted(p.name for p in path.iterdir()) == before  # untouched


def test_the_suggested_name_is_free(tmp_path):
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "x").write_text("")
    (tmp_path / "exp-2").mkdir()
    assert "--run.name=exp-3" in rundir.exists_message(tmp_path / "exp")
    assert f"--run.output_dir={tmp_path / 'exp-3'}" in rundir.exists_message(tmp_path / "exp", "--run.output_dir")
