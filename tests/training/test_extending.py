"""The four extension points of docs/architecture.md ("Adding a strategy", "... a tracker", "... a data
format", "... a run.json field"), each proven the way its section says: a toy one is added in exactly
the places the section lists, and a short launched run trains with it and saves, its save checked (the
defaults). The places are changed by a launch script of the test's own (a copy of what finetune/train.py
does, after the change), never by editing the package: each rank runs it, so each rank's package has the toy.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, logged_steps, short_demo
from tests.telemetry.run_record_doc import DOC, declared_paths, documented, undocumented

pytestmark = pytest.mark.integration

STEPS = 2


def launch_script(tmp_path: Path, change: str) -> Path:
    """A launch script that makes `change` to the package's tables, then runs finetune/train.py's main."""
    script = tmp_path / "toy_train.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\n{textwrap.dedent(change)}\n"
        "from finetune.train import main\n\nsys.exit(main())\n"
    )
    return script


def short_run(tiny_model_dir, *extra: str) -> list[str]:
    return short_demo(
        tiny_model_dir,
        STEPS,
        "--training.logging_steps=1",
        "--training.per_device_train_batch_size=4",
        *extra,
    )


def trained_and_saved(rec: dict) -> list[dict]:
    """Each step logged once, and the run's save checked by a fresh process (run.verify_export: auto, the default):
    a toy row must not break what a run leaves behind."""
    check = rec["export"]["check"]
    assert check["passed"] and check["problems"] == [], check
    return logged_steps(rec, STEPS)


def test_a_strategy_added_as_a_row_trains_under_its_own_name(tmp_path, tiny_model_dir, launch):
    """Adding a strategy: one row of finetune/strategies.py STRATEGIES. The toy is DDP's row renamed; the
    recipe names it, the launch config, the live engine and the planner all find it by its properties."""
    script = launch_script(
        tmp_path,
        """
        import dataclasses
        from finetune import strategies
        toy = dataclasses.replace(strategies.by_key("ddp"), key="toy_ddp", name="toy_ddp", speed_rank=10, recipe=None)
        strategies.STRATEGIES = (*strategies.STRATEGIES, toy)
        """,
    )
    res = launch(
        short_run(tiny_model_dir, "--run.strategy=toy_ddp"),
        run_dir=tmp_path / "run",
        cwd=tmp_path,
        config_file="accelerate_configs/cpu/ddp.yaml",
        env={"FINETUNE_CPU_DISTRIBUTED": "1"},
        script=script,
        timeout=600,
    )
    assert res.returncode == 0, res.explain()
    rec = res.record
    strategy = rec["strategy"]
    assert (strategy["name"], strategy["world_size"]) == ("toy_ddp", 2), strategy
    assert strategy["evidence"]["engine_class"] == "DistributedDataParallel", strategy["evidence"]  # engaged, live
    assert rec["predicted_memory"]["strategy"] == "toy_ddp", rec["predicted_memory"]  # the planner's row
    assert rec["resumes"][0]["strategy"] == "toy_ddp" and rec["summary"]["status"] == "completed"
    trained_and_saved(rec)


def test_a_tracker_added_as_a_row_sees_each_step_once(tmp_path, tiny_model_dir, launch):
    """Adding a tracker: one row of finetune/telemetry/sinks.py TRACKERS, named in logging.report_to. The toy
    writes each log window it is handed; it must hold run.json's steps[], each once, with the meter's keys."""
    script = launch_script(
        tmp_path,
        """
        import json
        from transformers import TrainerCallback
        from finetune.telemetry import sinks

        class ToyTracker(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if state.is_world_process_zero and "loss" in logs and "train_runtime" not in logs:
                    with open(f"{args.output_dir}/toy_tracker.jsonl", "a") as f:
                        f.write(json.dumps({"step": state.global_step, **logs}) + "\\n")

        sinks.TRACKERS = (*sinks.TRACKERS, ("toy", ToyTracker))
        """,
    )
    res = launch(
        short_run(tiny_model_dir, "--logging.report_to=[toy]"), run_dir=tmp_path / "run", cwd=tmp_path, script=script
    )
    assert res.returncode == 0, res.explain()
    steps = trained_and_saved(res.record)
    seen = [json.loads(line) for line in (tmp_path / "run" / "toy_tracker.jsonl").read_text().splitlines()]
    assert [s["step"] for s in seen] == [s["step"] for s in steps], seen
    assert [s["loss"] for s in seen] == [s["loss"] for s in steps]
    assert all("tokens/trained" in s and "perf/step_s" in s for s in seen), seen[0]  # FinetuneTrainer's keys


def test_a_data_format_added_as_a_record_trains_and_evaluates(tmp_path, tiny_model_dir, launch):
    """Adding a data format: one record of finetune/data/formats.py TABLE. The toy's rows are {"q", "a"}; the
    recipe may name it (data.format), its rows train, and the held-out exact match reads them as pairs."""
    script = launch_script(
        tmp_path,
        """
        from finetune.data import formats

        def qa_pair(row):
            return formats.require_str(row, "q", "qa", non_empty=True), formats.require_str(row, "a", "qa")

        toy = formats.DataFormat(("q", "a"), "qa rows need q, a", qa_pair, "pair", ("q", "a"))
        formats.TABLE = {**formats.TABLE, "qa": toy}
        """,
    )
    rows = [{"q": f"What is {i} plus {i}?", "a": str(2 * i)} for i in range(16)]
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = launch(
        short_run(
            tiny_model_dir,
            f"--data.path={data}",
            "--data.format=qa",
            "--eval.exact_match=true",
            f"--eval.heldout_path={data}",
            "--eval.samples=4",
            "--eval.max_new_tokens=2",
            "--eval.batch_size=4",
        ),
        run_dir=tmp_path / "run",
        cwd=tmp_path,
        script=script,
    )
    assert res.returncode == 0, res.explain()
    rec = res.record
    assert rec["data"]["format"] == "qa" and rec["data"]["rows_read"] == 16 and rec["data"]["rows_skipped"] == []
    assert rec["data"]["train_trained_tokens"] > 0  # the answers carry loss
    assert rec["eval"]["details"]["after"]["total"] == 4, rec["eval"]
    trained_and_saved(rec)


TOY_ROWS = """
| `toy` | object | - | always | the toy section of tests/training/test_extending.py |
| `toy.max_steps` | int | steps | always | TrainingArguments.max_steps, as the Trainer was built with it |
"""
TOY_SECTION = """
    from typing import TypedDict
    from finetune.telemetry import record_schema

    class Toy(TypedDict):
        max_steps: int

    toy = record_schema.Section("toy", Toy, record_schema.ABSENT, False)
    """


def test_a_run_json_field_added_in_its_places_is_recorded_and_held_to_the_doc(
    tmp_path, tiny_model_dir, launch, monkeypatch
):
    """Adding a run.json field: its declaration (finetune/telemetry/record_schema.py), the phase that hands it
    over (finetune/training/run.py) and its rows in docs/run_record.md. The toy section appears in the run's
    record, and the doc checks see it: missing without its rows, matched with them."""
    script = launch_script(
        tmp_path,
        TOY_SECTION
        + """
    record_schema.SECTIONS = (*record_schema.SECTIONS, toy)
    from finetune.training import run

    setup = run.record_setup

    def record_setup(the_run, trainer, *args, **kwargs):
        setup(the_run, trainer, *args, **kwargs)
        the_run.sinks.put(toy={"max_steps": trainer.args.max_steps})

    run.record_setup = record_setup
    """,
    )
    res = launch(short_run(tiny_model_dir), run_dir=tmp_path / "run", cwd=tmp_path, script=script)
    assert res.returncode == 0, res.explain()
    rec = res.record
    assert rec["toy"] == {"max_steps": STEPS}, rec.get("toy")
    trained_and_saved(rec)
    # the doc checks (tests/telemetry/test_record.py, test_run_record_doc.py), the toy declared in this process too
    from finetune.telemetry import record

    declared: dict = {}
    exec(textwrap.dedent(TOY_SECTION), declared)  # the same declaration, not added to the package's table here
    monkeypatch.setattr(record, "SECTIONS", (*record.SECTIONS, declared["toy"]))
    assert declared_paths() - set(documented()) == {"toy", "toy.max_steps"}
    assert undocumented(rec, documented()) == ["toy", "toy.max_steps"]
    with_rows = documented(DOC.read_text(encoding="utf-8") + TOY_ROWS)
    assert declared_paths() == set(with_rows) and undocumented(rec, with_rows) == []
