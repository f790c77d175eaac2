"""The run directory (finetune/launch/rundir.py): never replaced without --overwrite, except what a
run that failed before its first step left behind; the refusal says how to retry."""

from __future__ import annotations

import json

import pytest

from finetune.errors import UserError
from finetune.launch import run_lock, rundir


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


# --- only what is ours: a folder finetune did not make is never emptied ------------------------------


def _user_folder(root):
    """A user's project: data, notes, a notebook, figures, and an earlier run under runs/."""
    files = {
        "train.jsonl": '{"instruction": "a", "output": "b"}\n',
        "notes.md": "# ideas\n",
        "analysis.ipynb": '{"cells": []}',
        "figures/loss.png": b"\x89PNG\r\n\x1a\n" + bytes(range(256)),
        "runs/earlier/run.json": '{"summary": {"status": "completed"}}',
        "runs/earlier/config.yaml": "run: {}\n",
        "runs/earlier/.finetune-run": "",
    }
    for name, body in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(body if isinstance(body, bytes) else body.encode())
    return root


def _hashes(root):
    import hashlib

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize(
    "output_dir, overwrite",
    [
        ("project", True),  # the user's folder, holding the data the run reads
        (".", True),  # the working directory
        ("~", True),  # the home directory
        ("project/runs", True),  # a folder holding runs
        ("project", False),
    ],
)
def test_a_folder_finetune_did_not_make_is_refused_and_every_file_survives(
    tmp_path, monkeypatch, output_dir, overwrite
):
    """Before: `--overwrite --run.output_dir=project` deleted the user's project (its data too) and then
    failed on the data it had deleted; `.` emptied the working directory. Now refused, path and fix
    named, nothing written into it (not even the lock), every file byte for byte the same."""
    from finetune.config.recipe import load_recipe

    project = _user_folder(tmp_path / "project")
    monkeypatch.chdir(project if output_dir == "." else tmp_path)
    monkeypatch.setenv("HOME", str(project))
    before = _hashes(tmp_path)
    data = project / "train.jsonl"
    cfg, _ = load_recipe("demo", [f"--run.output_dir={output_dir}", f"--data.path={data}", "--eval.exact_match=false"])
    cfg = cfg.replaced("run", overwrite=overwrite)
    with pytest.raises(UserError) as err:
        rundir.create(cfg, run_lock.Locks())
    msg = str(err.value)
    target = (project / "runs") if output_dir.endswith("runs") else project
    assert f"({target.resolve()}) already exists and is not one finetune made" in msg, msg
    assert "nothing was changed" in msg and "--run.name=NAME" in msg and "--run.output_dir=<a new or empty" in msg
    assert _hashes(tmp_path) == before
    assert not list(tmp_path.rglob(".finetune*.lock")) and not (target / rundir.MARKER).exists()


def test_the_root_and_the_home_directory_are_no_run_directories():
    from pathlib import Path

    for path in (Path("/"), Path.home()):
        assert "is not one finetune made" in rundir.problem(path, overwrite=True)


def test_overwrite_removes_what_a_run_wrote_and_keeps_the_users_files(tmp_path, capsys):
    """A run directory finetune made, with a user's file dropped in: --overwrite removes the run's own
    files (record, config, checkpoints, model, demo data, TensorBoard events) and keeps the rest."""
    path = tmp_path / "runs" / "exp"
    for name in (
        "run.json",
        "config.yaml",
        "config.resume1.yaml",
        "run.before-resume1.json",
        "trainer_state.json",
        "checkpoint-2/model.safetensors",
        "model/adapter_model.safetensors",
        "data/train.jsonl",
        "data/heldout.jsonl",
        "runs/Jan01_host/events.out.tfevents.1.host",
        "notes.md",
        "mine/data.csv",
    ):
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text("x")
    (path / rundir.MARKER).touch()
    (path / "mine" / "run.json").write_text("{}")  # not the run's: mine/ is no name a run writes
    kept = _hashes(path / "mine") | {"notes.md": _hashes(path)["notes.md"]}
    rundir.prepare_run_dir(path, overwrite=True)
    assert sorted(p.name for p in path.iterdir()) == sorted([rundir.MARKER, "notes.md", "mine"])
    assert _hashes(path / "mine") | {"notes.md": _hashes(path)["notes.md"]} == kept
    assert "kept in" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, kept",
    [
        ("data/mine.csv", "data"),  # data/ with a file the demo never writes: the user's
        ("runs/keep/run.json", "runs"),  # runs/ holding more than TensorBoard events
    ],
)
def test_a_folder_with_a_runs_name_but_the_users_contents_is_kept(tmp_path, extra, kept):
    path = tmp_path / "exp"
    for name in ("run.json", "config.yaml", extra):
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text("x")
    rundir.prepare_run_dir(path, overwrite=True)
    assert (path / extra).read_text() == "x" and not (path / "run.json").exists(), kept


def test_overwrite_that_would_delete_the_data_the_run_reads_is_refused(tmp_path):
    """The demo data of an earlier run given as data.path of a run that --overwrite's that run."""
    path = tmp_path / "exp"
    for name in ("run.json", "config.yaml", "data/train.jsonl"):
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text("x")
    before = _hashes(path)
    data = str(path / "data" / "train.jsonl")
    with pytest.raises(UserError, match=r"--overwrite would delete .*exp/data, which holds data.path"):
        rundir.prepare_run_dir(path, overwrite=True, inputs=[("data.path", data)])
    assert _hashes(path) == before


def test_the_suggested_retry_is_quoted_for_the_shell(tmp_path):
    import shlex

    path = tmp_path / "keep #2"
    (path / "x").mkdir(parents=True)
    line = next(w for w in rundir.exists_message(path).splitlines() if "a new run directory" in w)
    assert shlex.split(line)[0] == "--run.name=keep #2-2"
