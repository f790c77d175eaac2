"""Issue 27 item 3: a resume continues the run that was started. Its saved configuration (config.yaml,
with the changes earlier resumes recorded) is the base, not the recipe as it reads today; an override
that differs is refused naming each difference, or applied and recorded with --allow-config-change.
The batch layout and where the run is are not configuration changes (resharding stays allowed)."""

from __future__ import annotations

import json

import pytest
import yaml

from finetune.config.recipe import load_recipe
from finetune.errors import ConfigError, UserError
from finetune.launch import rundir

FIRST = ["--training.max_steps=20", "--eval.exact_match=false", "--training.logging_steps=5"]


def _started(tmp_path, extra=()) -> str:
    """A run directory as a run of the demo recipe with FIRST leaves it; returns its --run.output_dir."""
    run_dir = tmp_path / "runs" / "short"
    run_dir.mkdir(parents=True)
    cfg, _ = load_recipe("demo", [*FIRST, *extra, "--run.name=short", f"--run.output_dir={run_dir}"])
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (run_dir / rundir.MARKER).write_text("")  # made by finetune
    return f"--run.output_dir={run_dir}"


def test_the_saved_configuration_is_the_base_not_the_recipe(tmp_path):
    from finetune.checkpointing import resume_config

    where = _started(tmp_path)
    got = resume_config.resolve("demo", [where], allow_change=False)
    assert got.cfg.training.args["max_steps"] == 20 and got.cfg.eval.exact_match is False
    assert got.changes == [] and got.saved.name == "config.yaml"
    # control: the recipe with the same command line (what a resume ran before): another configuration
    today, _ = load_recipe("demo", [where])
    assert today.training.args["max_steps"] == 80 and today.eval.exact_match is True
    assert {"training.max_steps", "eval.exact_match", "training.logging_steps"} <= set(got.recipe_differs)


def test_a_different_override_is_refused_naming_each_difference_or_applied_when_allowed(tmp_path):
    from finetune.checkpointing import resume_config

    where = _started(tmp_path)
    given = [where, "--training.max_steps=80", "--eval.exact_match=true", "--training.logging_steps=5"]
    with pytest.raises(ConfigError) as err:
        resume_config.resolve("demo", given, allow_change=False)
    msg = str(err.value)
    assert (
        "training.max_steps: 20 in the run, 80 given" in msg and "eval.exact_match: False in the run, True given" in msg
    )
    assert "logging_steps" not in msg  # the same value again is no difference
    assert "--allow-config-change" in msg and "config.yaml" in msg
    got = resume_config.resolve("demo", given, allow_change=True)
    assert got.cfg.training.args["max_steps"] == 80 and got.cfg.eval.exact_match is True
    assert got.changes == [
        {"key": "training.max_steps", "was": 20, "now": 80},
        {"key": "eval.exact_match", "was": False, "now": True},
    ]


def test_layout_location_and_overwrite_are_no_changes(tmp_path):
    """Resharding on resume sets the per-device batch and accumulation (resume_plan.py); the run is
    found by its name or directory; a start's --overwrite does not carry over."""
    from finetune.checkpointing import resume_config

    where = _started(tmp_path, ["--run.overwrite=true"])
    given = [where, "--training.per_device_train_batch_size=2", "--training.gradient_accumulation_steps=4"]
    got = resume_config.resolve("demo", given, allow_change=False)
    assert got.changes == [] and got.cfg.run.overwrite is False
    assert got.cfg.training.args["per_device_train_batch_size"] == 2


def test_an_allowed_change_recorded_by_a_resume_is_the_next_resumes_base(tmp_path):
    from finetune.checkpointing import resume_config

    where = _started(tmp_path)
    run_dir = tmp_path / "runs" / "short"
    segments = [{"step": 0}, {"step": 20, "config_changes": [{"key": "training.max_steps", "was": 20, "now": 40}]}]
    (run_dir / "run.json").write_text(json.dumps({"resumes": segments}))
    got = resume_config.resolve("demo", [where], allow_change=False)
    assert got.cfg.training.args["max_steps"] == 40 and got.changes == []


def test_without_a_saved_configuration_or_a_run_name_the_resume_says_so(tmp_path):
    from finetune.checkpointing import resume_config

    with pytest.raises(UserError, match="--run.name=NAME"):
        resume_config.resolve("demo", [], allow_change=False)
    with pytest.raises(UserError, match="has no config.yaml"):
        resume_config.resolve("demo", [f"--run.output_dir={tmp_path / 'nothing'}"], allow_change=False)


def _hashes(root):
    import hashlib

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def test_a_resume_of_a_completed_run_changes_nothing_and_exits_0(tmp_path, capsys):
    """Before: `--resume` of a completed run said "nothing left to train", then rewrote model/ and
    appended to run.json. The launched proof: tests/training/test_run_safety.py."""
    from finetune.checkpointing import resume_config
    from finetune.cli import dispatch
    from finetune.errors import NothingToDo

    where = _started(tmp_path)
    run_dir = tmp_path / "runs" / "short"
    (run_dir / "run.json").write_text(json.dumps({"summary": {"status": "completed", "steps": 20}}))
    (run_dir / "checkpoint-20").mkdir()
    before = _hashes(run_dir)
    for resume in ("auto", str(run_dir / "checkpoint-20")):
        with pytest.raises(NothingToDo, match="completed \\(step 20\\); there is nothing to resume"):
            resume_config.resolve("demo", [where], allow_change=False, resume=resume)
    assert resume_config.resolve("demo", [where], allow_change=False, resume=str(run_dir / "checkpoint-10"))
    assert dispatch.main(["train", "--recipe", "demo", where, "--resume"]) == 0
    assert "nothing was changed" in capsys.readouterr().err
    assert _hashes(run_dir) == before


def test_a_damaged_run_json_is_named_and_the_config_comes_from_the_newest_saved_one(tmp_path, capsys):
    """Before: a JSONDecodeError traceback. Now the file is named, the newest resumed configuration
    is the base (the changes run.json recorded are unreadable), and the file is kept renamed."""
    from finetune.checkpointing import resume, resume_config

    where = _started(tmp_path)
    run_dir = tmp_path / "runs" / "short"
    later, _ = load_recipe("demo", [*FIRST, "--run.name=short", "--training.max_steps=40"])
    (run_dir / "config.resume1.yaml").write_text(yaml.safe_dump(later.to_dict(), sort_keys=False))
    half = b'{"schema": 1, "summary": {"status": "running"}, "steps": [{"step": 1, "lo'
    (run_dir / "run.json").write_bytes(half)
    got = resume_config.resolve("demo", [where], allow_change=False)
    err = capsys.readouterr().err
    assert f"{run_dir / 'run.json'} is not valid JSON (line 1, column" in err and "config.resume1.yaml" in err
    assert got.cfg.training.args["max_steps"] == 40 and got.saved.name == "config.resume1.yaml"
    kept = resume.keep_previous_record(run_dir)  # as the resumed run commits
    assert kept == run_dir / "run.damaged1.json" and kept.read_bytes() == half and not (run_dir / "run.json").exists()


def test_a_resume_into_a_folder_finetune_did_not_make_is_refused(tmp_path):
    from finetune.checkpointing import resume_config

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.yaml").write_text("my: settings\n")
    (folder / "notes.md").write_text("mine")
    before = _hashes(folder)
    with pytest.raises(UserError, match="is not a run directory finetune made"):
        resume_config.resolve("demo", [f"--run.output_dir={folder}"], allow_change=False)
    assert _hashes(folder) == before


def test_allow_config_change_without_resume_is_refused(capsys):
    from finetune.cli import dispatch

    with pytest.raises(SystemExit) as e:
        dispatch.main(["train", "--recipe", "demo", "--allow-config-change"])
    assert e.value.code == 2 and "applies to --resume only" in capsys.readouterr().err


@pytest.mark.integration
def test_a_resume_without_the_first_runs_overrides_continues_that_run(
    tmp_path, tiny_model_dir, launch, monkeypatch, capsys
):
    """The issue's case: a run started with overrides (4 steps, no evaluation) and resumed without them
    ran another configuration (the recipe's 80 steps with evaluation). Now it continues to step 4 without
    evaluation; a different max_steps is refused, then applied and recorded with --allow-config-change."""
    run_dir = tmp_path / "runs" / "r"
    first = [
        "--recipe",
        "demo",
        f"--model.name_or_path={tiny_model_dir}",
        "--data.demo_train_size=32",
        "--training.per_device_train_batch_size=4",
        "--training.max_steps=4",
        "--training.save_strategy=steps",
        "--training.save_steps=2",
        "--training.logging_steps=1",
        "--eval.exact_match=false",
    ]
    res = launch(first, run_dir=run_dir, cwd=tmp_path)
    assert res.returncode == 0, res.explain()
    again = ["--recipe", "demo", f"--resume={run_dir / 'checkpoint-2'}"]
    res = launch(again, run_dir=run_dir, cwd=tmp_path)
    assert res.returncode == 0, res.explain()
    rec = res.record
    assert rec["summary"]["steps"] == 4 and not rec["eval"]  # the run's 4 steps, its evaluation off
    assert rec["resumes"][-1]["config_changes"] == [] and rec["resumes"][-1]["config_from"].endswith("config.yaml")
    # `finetune train` refuses a different max_steps before any launch (in this process: accelerate
    # launch fails the test if reached)
    from finetune.cli import dispatch
    from finetune.launch import accelerate as launcher

    monkeypatch.setattr(launcher, "run_accelerate_launch", lambda args: pytest.fail(f"launched {args}"))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        dispatch.main(["train", *again, "--training.max_steps=6", f"--run.output_dir={run_dir}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "training.max_steps: 4 in the run, 6 given" in err, err[-3000:]
    monkeypatch.undo()
    res = launch(
        [*again[:2], f"--resume={run_dir / 'checkpoint-4'}", "--training.max_steps=6", "--allow-config-change"],
        run_dir=run_dir,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.explain()
    rec = res.record
    assert rec["summary"]["steps"] == 6
    assert rec["resumes"][-1]["config_changes"] == [{"key": "training.max_steps", "was": 4, "now": 6}]
    assert "training.max_steps 4 -> 6" in res.stderr + res.stdout
