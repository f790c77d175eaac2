"""Silent wrong results and lost work after training (issue 23, categories 3 and 6): a collapsed model
is stopped (or flagged) instead of reported `completed`; an error after the last optimizer step saves
the trained weights first and says where they are; a checkpoint damaged in place is passed over on
resume. The launches go through `finetune train` (tests/training/test_faults.py cli_train)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from finetune.checkpointing import checkpoints
from finetune.errors import EXIT_NONFINITE
from finetune.training import fault_injection as faults
from tests.training.test_faults import LANES_TIMEOUT, cli_train, in_lanes, outcome_of

VOCAB = 49152


def feed(watch, series: list[tuple[float, float | None]], control=None) -> SimpleNamespace:
    """Log windows (loss, grad_norm) as Trainer hands them to its callbacks, one step each."""
    control = control or SimpleNamespace(should_training_stop=False)
    for step, (loss, norm) in enumerate(series, start=1):
        logs = {"loss": loss, "grad_norm": norm}
        watch.on_log(SimpleNamespace(logging_steps=1), SimpleNamespace(global_step=step), control, logs=logs)
    return control


def test_zero_gradient_windows_in_a_row_stop_the_run_naming_the_uniform_loss():
    from finetune.training.resilience import CollapseError, CollapseWatch

    watch = CollapseWatch(policy="stop", windows=3, vocab_size=VOCAB)
    uniform = round(math.log(VOCAB), 4)
    control = feed(watch, [(10.9, 3.0), (11.2, 0.0), (uniform, 0.0)])  # two zero windows: not yet
    assert not control.should_training_stop and watch.stopped([]) is None
    feed(watch, [(uniform, 0.0)], control)
    assert control.should_training_stop and watch.error([]) is None  # `flag`'s error is not this policy's
    err = watch.stopped([])
    assert isinstance(err, CollapseError) and str(err) == (
        "the model collapsed: gradient norm exactly 0 in 3 consecutive log windows up to step 1 (logging_steps 1), "
        f"loss {uniform:.4f} = ln(49152), a uniform prediction: nothing trains any more. Lower training.learning_rate "
        "(or raise warmup_steps) and start again from the last checkpoint before it; stopped (training.on_collapse: stop)"
    )


def test_a_random_model_at_ln_v_with_gradients_is_not_a_collapse():
    """Control: a fresh random model's loss is about ln(V) too; its gradients are not zero."""
    from finetune.training.resilience import CollapseWatch

    watch = CollapseWatch(policy="stop", windows=2, vocab_size=VOCAB)
    uniform = math.log(VOCAB)
    control = feed(
        watch, [(uniform, 2.9), (uniform, 2.8), (uniform, 0.0), (uniform, 1e-9), (uniform, 0.0), (uniform, None)]
    )
    assert watch.found is None and watch.stopped([]) is None and not control.should_training_stop


def test_the_flag_policy_trains_on_and_ends_failed():
    from finetune.training.resilience import CollapseError, CollapseWatch

    watch = CollapseWatch(policy="flag", windows=2, vocab_size=VOCAB)
    assert not feed(watch, [(5.0, 0.0), (5.0, 0.0), (5.0, 0.0)]).should_training_stop
    assert watch.stopped([]) is None
    assert "gradient norm exactly 0 in 2 consecutive log windows up to step 2" in watch.found
    assert "(ln of the vocabulary: 10.8027)" in watch.found  # not at ln(V): said so, not claimed uniform
    error = watch.error([{"step": 1}])
    assert isinstance(error, CollapseError) and error.exit_code == EXIT_NONFINITE and error.skipped == [{"step": 1}]
    assert str(error).endswith("trained to the end and exported (training.on_collapse: flag)")


TINY = [
    "--recipe",
    "demo",
    "--data.demo_train_size=64",
    "--eval.exact_match=false",
    "--training.logging_steps=1",
    "--training.per_device_train_batch_size=4",
]


def _collapse(tmp_path, tiny_model_dir):
    """Full fine-tuning of the tiny model at learning rate 1000: from about step 7 the gradient norm is
    exactly 0 and the loss ln(49152) = 10.8027 (measured). On main: `completed`, exit 0."""
    code, out, run_dir = cli_train(
        [
            *TINY,
            f"--model.name_or_path={tiny_model_dir}",
            "--method.name=full",
            "--training.learning_rate=1000",
            "--training.warmup_steps=5",
            "--training.max_steps=16",
        ],
        run_dir=tmp_path / "run",
        env={},
    )
    assert code == EXIT_NONFINITE, out[-4000:]
    rec = json.loads((run_dir / "run.json").read_text())
    s = rec["summary"]
    assert s["status"] == "failed" and s["error"].startswith("CollapseError: the model collapsed"), s
    assert "= ln(49152), a uniform prediction" in s["error"] and "stopped (training.on_collapse: stop)" in s["error"]
    norms = [x["grad_norm"] for x in rec["steps"]]
    assert norms[-3:] == [0.0, 0.0, 0.0] and all(n > 0 for n in norms[:2]), norms
    assert rec["steps"][-1]["step"] < 16 and s["steps"] == rec["steps"][-1]["step"]  # stopped early
    assert rec["faults"]["on_collapse"] == "stop" and rec["faults"]["collapse_windows"] == 3
    assert not (run_dir / "model").exists()  # nothing exported as if it had worked


def _error_after_training(tmp_path, tiny_model_dir):
    """Run 1 (LoRA, 4 steps, a checkpoint every 2, run.save_model false): an error after the last step
    (fault injection) -> the trained adapter is exported anyway and the error names it; on main the
    run ended with nothing saved after step 4. Then checkpoint-4 is damaged in place (same size) and
    model/ replaced by a file, and run 2 resumes to step 7: it passes over checkpoint-4 (on main it
    resumed from it), and its export fails, so the final step's weights go to a complete checkpoint
    (written here: step 7 is no save step) named in the error."""
    run_dir = tmp_path / "run"
    args = [
        *TINY,
        f"--model.name_or_path={tiny_model_dir}",
        "--training.save_strategy=steps",
        "--training.save_steps=2",
    ]
    code, out, _ = cli_train(
        [*args, "--training.max_steps=4", "--run.save_model=false"],
        run_dir=run_dir,
        env={faults.ENV: "fail_eval@rank0,step4"},
    )
    assert code == 1, out[-4000:]
    saved = f"the trained model is exported in {run_dir / 'model'} (saved after the error)"
    assert "[fault injection] eval fails on rank 0 (training ended at step 4)" in out and saved in out, out[-4000:]
    s = json.loads((run_dir / "run.json").read_text())["summary"]
    assert s["status"] == "failed" and saved in s["error"] and s["steps"] == 4, s
    assert (run_dir / "model" / "adapter_model.safetensors").is_file()
    assert [c.name for c in checkpoints.checkpoints(run_dir)] == ["checkpoint-2", "checkpoint-4"]

    optimizer = run_dir / "checkpoint-4" / "optimizer.pt"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    optimizer.write_bytes(bytes(data))
    for f in (run_dir / "model").iterdir():
        f.unlink()
    (run_dir / "model").rmdir()
    (run_dir / "model").write_text("a file where the export goes")
    code, out, _ = cli_train(
        [*args, "--training.max_steps=7", "--run.save_model=true", "--resume", "--allow-config-change"],
        run_dir=run_dir,
        env={},
    )
    assert code == 1, out[-4000:]
    assert f"skipping checkpoint {run_dir / 'checkpoint-4'}: file optimizer.pt does not match" in out, out[-4000:]
    rec = json.loads((run_dir / "run.json").read_text())
    s = rec["summary"]
    assert s["resumed_from"] == str(run_dir / "checkpoint-2"), s
    assert (run_dir / "checkpoint-4.superseded-1").is_dir()  # set aside, not deleted
    assert s["status"] == "failed" and s["checkpoint"] == str(run_dir / "checkpoint-7"), s
    assert f"the trained weights are saved in the complete checkpoint {run_dir / 'checkpoint-7'} (step 7" in s["error"]
    assert checkpoints.problem(run_dir / "checkpoint-7") is None
    assert (run_dir / "checkpoint-7" / "adapter_model.safetensors").is_file()


# --- the two launched tests at once (tests/training/test_faults.py in_lanes) -----------------------------


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, tiny_model_dir):
    def at(scenario):
        return lambda d: scenario(d, tiny_model_dir)

    lanes = [
        [
            (
                "test_an_error_after_training_saves_the_weights_first_and_a_damaged_checkpoint_is_passed_over",
                at(_error_after_training),
            )
        ],
        [("test_a_learning_rate_that_collapses_the_model_ends_failed_not_completed", at(_collapse))],
    ]
    return in_lanes(request, tmp_path_factory, lanes)


@LANES_TIMEOUT
@pytest.mark.integration
def test_a_learning_rate_that_collapses_the_model_ends_failed_not_completed(runs, request):
    outcome_of(runs, request)  # _collapse


@LANES_TIMEOUT
@pytest.mark.integration
def test_an_error_after_training_saves_the_weights_first_and_a_damaged_checkpoint_is_passed_over(runs, request):
    outcome_of(runs, request)  # _error_after_training
