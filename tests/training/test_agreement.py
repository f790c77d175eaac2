"""Every rank agrees at each boundary after training (finetune/training/endings.py, signals.Stops.agree;
docs/faults.md "Hangs and every stop signal").

In-process: two ranks over gloo (torch.multiprocessing, Accelerate's PartialState, no model) run the
run's own `finish()` (finetune/training/run.py) with a stand-in trainer whose export, evaluation,
exact match and checkpoint each enter a real collective, and the run's own fault injection
(FINETUNE_FAULT_INJECT, fail_<step>) fails one rank in one step; or one rank gets a stop signal in a
step. Every step x failing rank: both ranks must end the same way (the failure raised on both, naming
the failed rank; a stop: exit 75 on both), having entered the same collectives in the same order
(a rank that skipped one would leave the other waiting: the groups' 60 s timeout turns that into a
failed case, not a hang).

Launched: each strategy's own collectives (DDP, ZeRO-2, ZeRO-3, FSDP2, tensor parallelism), one launch
each, failing another of the four steps each time (LAUNCHED below): every step and every strategy
once; the step x failing-rank cross product runs in-process above.
"""

from __future__ import annotations

import json
import os
import signal
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import free_port

STEP = 3  # the step training ended at
STEPS = ("export", "eval", "exact_match", "record")
CASES = [("fail", step, rank) for step in STEPS for rank in (0, 1)] + [
    ("signal", "export", 1),
    ("signal", "eval", 0),
    ("signal", "exact_match", 1),
]


def _rank_main(rank: int, port: int, root: str, queue) -> None:
    """One rank: every case in turn over the same process group; each case's outcome to `queue`."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    from accelerate import PartialState

    state = PartialState(cpu=True, timeout=timedelta(seconds=60))
    for case in CASES:
        try:
            queue.put((rank, case, _one_case(state, rank, case, Path(root) / "-".join(map(str, case)))))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            queue.put((rank, case, ("crashed", f"{type(e).__name__}: {e}", [])))
            return


def _one_case(state, rank: int, case: tuple, run_dir: Path) -> tuple:
    import torch.distributed as dist

    from finetune.export import live
    from finetune.modeling import load
    from finetune.training import fault_injection, run, signals

    kind, step_name, bad_rank = case
    entered: list[str] = []
    stops = signals.Stops()  # this case's signals and watchdog

    def collective(name: str):
        entered.append(name)
        dist.barrier()

    def maybe_signal(name: str):
        if kind == "signal" and name == step_name and rank == bad_rank:
            stops.received.append(signal.SIGUSR1)  # what the handler records

    def save_final_model(trainer, model_dir):
        collective("export")
        maybe_signal("export")
        if rank == 0:
            Path(model_dir).mkdir(parents=True, exist_ok=True)

    def evaluate():
        collective("eval")
        maybe_signal("eval")
        return {"eval_loss": 1.0}

    def exact_match(*a):
        collective("exact_match")
        maybe_signal("exact_match")
        return {"exact_match": 0.5}

    class Resilience:
        preempted = last_complete = None

        def final_checkpoint(self):
            collective("checkpoint")
            self.last_complete = run_dir / f"checkpoint-{STEP}"
            return self.last_complete

        def stop_after_training(self, flags):
            self.final_checkpoint()
            self.preempted = {"step": STEP, **stops.describe(flags)}

    trainer = SimpleNamespace(
        accelerator=state,
        state=SimpleNamespace(global_step=STEP),
        args=SimpleNamespace(output_dir=str(run_dir), ddp_timeout=60),
        resilience=Resilience(),
        collapse=SimpleNamespace(error=lambda skipped: None),
        skipped_steps=[],
        save_state=lambda: None,
        final_measurements=lambda: collective("measurements"),
        evaluate=evaluate,
    )
    the_run = SimpleNamespace(
        cfg=SimpleNamespace(training=SimpleNamespace(finish_timeout=60), run=SimpleNamespace(save_model=True)),
        state=state,
        dir=run_dir,
        sinks=SimpleNamespace(merge=lambda *a, **k: None, put=lambda **k: None, close=lambda code: None),  # not here
        stops=stops,
        launch=SimpleNamespace(world_size=2),
        heldout_path=None,
        check_ahead=None,
        data_path=None,
    )
    data = SimpleNamespace(
        tokenizer=SimpleNamespace(save_pretrained=lambda d: None), bundle=SimpleNamespace(eval=[1]), heldout=[1]
    )
    trained = SimpleNamespace(exact_match={}, train_s=1.0, train_loss=1.0)
    # the case's fault, through the run's own injection points; the stand-ins above for the rest
    os.environ[fault_injection.ENV] = f"fail_{step_name}@rank{bad_rank},step{STEP}" if kind == "fail" else ""
    fault_injection.faults.cache_clear()
    # the run's steps as stand-ins entering the same collectives: the export's check (its probe rows and its
    # comparison) each one, as the live model's forward is
    stand_ins = {
        (load, "save_final_model"): save_final_model,
        (run, "exact_match"): exact_match,
        (run, "preempted"): lambda the_run, trainer, arguments: 75,
        # the record's step with its fault injection point, not its sections (the stand-ins measure nothing)
        (run, "record_end"): lambda the_run, trainer, model, ended: fault_injection.fail(
            "record", rank=rank, step=STEP
        ),
        (run, "ExportCheck"): SimpleNamespace(for_run=lambda the_run: SimpleNamespace(merged=False)),
        (live, "probe"): lambda check, tokenizer: collective("probe"),
        (live, "verify"): lambda trainer, model_dir, tokenizer, check, batch, warm: collective("check"),
    }
    saved = {(module, name): getattr(module, name) for module, name in stand_ins}
    for (module, name), value in stand_ins.items():
        setattr(module, name, value)
    try:
        code = run.finish(the_run, trainer, None, data, trained, 0.0, SimpleNamespace(args=trainer.args))
        return ("returned", code, entered)
    except Exception as e:  # noqa: BLE001 - the outcome under test
        return ("raised", f"{type(e).__name__}: {e}", entered)
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    root = tmp_path_factory.mktemp("agreement")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, str(root), queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    got: dict = {}
    try:
        for _ in range(2 * len(CASES)):
            rank, case, outcome = queue.get(timeout=240)
            got[(rank, case)] = outcome
            if outcome[0] == "crashed":
                break
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_every_rank_ends_the_same_way_after_a_fault_on_one_rank(outcomes, case):
    kind, step_name, bad = case
    r0, r1 = outcomes.get((0, case)), outcomes.get((1, case))
    assert r0 and r1, (case, outcomes)
    assert r0[2] == r1[2], f"the ranks entered different collectives: {r0[2]} / {r1[2]}"
    if kind == "signal":  # preempted on both, after the final step's checkpoint
        assert r0[:2] == r1[:2] == ("returned", 75), (r0, r1)
        assert r0[2][-1] == "checkpoint", r0
        return
    assert r0[0] == r1[0] == "raised", (r0, r1)
    own, other = (r0, r1) if bad == 0 else (r1, r0)
    injected = f"[fault injection] {step_name} fails on rank {bad} (training ended at step {STEP})"
    assert own[1].startswith(f"TrainedWeightsSaved: RuntimeError: {injected}"), own
    assert (
        other[1].startswith("TrainedWeightsSaved: FailedElsewhere: ")
        and f"rank {bad}: RuntimeError: {injected}" in (other[1])
    ), other
    # where the trained weights are, the same on both: the export unless it was the export that failed
    where = [r[1].splitlines()[-1] for r in (r0, r1)]
    assert where[0] == where[1], where
    if step_name == "export":
        assert "saved in the complete checkpoint" in where[0] and r0[2][-1] == "checkpoint", (where, r0)
    else:
        assert "the trained model is exported in" in where[0] and "checkpoint" not in r0[2], (where, r0)


# --- one launch per strategy, each failing another step (the cross product is above) ------------------

# strategy -> (recipe, CPU accelerate config, extra arguments, the step that fails, the rank it fails on)
LAUNCHED = {
    "ddp": ("ddp", "accelerate_configs/cpu/ddp.yaml", [], "record", 1),
    "zero2": (
        "zero2",
        "accelerate_configs/cpu/zero2.yaml",
        [
            "--eval.exact_match=true",
            "--eval.heldout_path=demo",
            "--data.demo_heldout_size=4",
            "--eval.samples=4",
            "--eval.max_new_tokens=2",
            "--eval.before=false",
        ],
        "exact_match",
        0,
    ),
    "zero3": ("zero3", "accelerate_configs/cpu/zero3.yaml", ["--data.eval_fraction=0.25"], "eval", 1),
    "fsdp": ("fsdp", "accelerate_configs/cpu/fsdp.yaml", [], "export", 0),
    "tp": ("zero2", "accelerate_configs/cpu/zero2.yaml", ["--parallel.tp_size=2", "--method.name=full"], "export", 1),
}


def _failure_after_training(tmp_path, tiny_model_dir, name):
    """`finetune train` with the shipped recipe's defaults (export on), 2 ranks over gloo, 2 steps; one
    rank fails at the end of one step after training (fault injection). Both ranks stop at that
    boundary: each says the failure (its own error, or the failed rank's), both save the same weights
    (the export, or when the export failed a complete checkpoint of step 2), run.json `failed` names
    the rank and its error, exit 1. Before (tensor parallelism's export found it), the failing rank went on to save a
    checkpoint while the other waited in the next agreement: both hung until the collective timeout."""
    from finetune.checkpointing import checkpoints
    from tests.training.test_faults import CPU_ENV, cli_train, tiny_args

    recipe, config, extra, step_name, bad = LAUNCHED[name]
    code, out, run_dir = cli_train(
        [
            "--recipe",
            recipe,
            "--config_file",
            config,
            *tiny_args(tiny_model_dir, 2),
            "--data.demo_train_size=32",
            *extra,
        ],
        run_dir=tmp_path / "run",
        env={**CPU_ENV, "FINETUNE_FAULT_INJECT": f"fail_{step_name}@rank{bad},step2"},
        timeout=400,
    )
    assert code == 1, out[-4000:]
    injected = f"[fault injection] {step_name} fails on rank {bad} (training ended at step 2)"
    other = 1 - bad
    assert f"[rank{bad}]: finetune.training.endings.TrainedWeightsSaved: RuntimeError: {injected}" in out, out[-4000:]
    said = f"[rank{other}]: finetune.training.endings.TrainedWeightsSaved: FailedElsewhere: "
    assert said in out and f"failed on rank(s) [{bad}] (rank {bad}: RuntimeError: {injected})" in out, out[-4000:]
    rec = json.loads((run_dir / "run.json").read_text())
    s = rec["summary"]
    assert s["status"] == "failed" and injected in s["error"], s
    # the strategy engaged, from the live objects (the record's strategy section, written before training)
    assert rec["strategy"]["world_size"] == 2 and rec["strategy"]["name"] == recipe, rec["strategy"]
    if name == "tp":
        assert rec["strategy"]["parallel"]["tp"] == 2 and rec["strategy"]["parallel"]["tp_layers"] > 0
    if recipe.startswith("zero"):
        assert rec["strategy"]["evidence"]["zero_stage"] == int(recipe[-1]), rec["strategy"]
    if step_name == "export":  # the trained weights went to a complete checkpoint of the final step instead
        assert (
            s["checkpoint"] == str(run_dir / "checkpoint-2") and checkpoints.problem(run_dir / "checkpoint-2") is None
        )
        assert f"saved in the complete checkpoint {run_dir / 'checkpoint-2'}" in s["error"], s
    else:
        assert f"the trained model is exported in {run_dir / 'model'}" in s["error"], s
        assert any((run_dir / "model" / f).is_file() for f in ("adapter_model.safetensors", "model.safetensors"))
        assert checkpoints.checkpoints(run_dir) == []


TEST = "test_a_failure_on_one_rank_after_training_is_agreed_by_every_rank"


@pytest.fixture(scope="module")
def launched_runs(request, tmp_path_factory, tiny_model_dir):
    """The five launches, two at a time (tests/training/test_faults.py in_lanes)."""
    from tests.training.test_faults import in_lanes

    def at(name):
        return (f"{TEST}[{name}]", lambda d: _failure_after_training(d, tiny_model_dir, name))

    return in_lanes(request, tmp_path_factory, [[at("zero2"), at("zero3")], [at("ddp"), at("fsdp"), at("tp")]])


@pytest.mark.timeout(1800)  # test_faults.LANES_TIMEOUT, not imported: the ranks spawned above import this module
@pytest.mark.integration
@pytest.mark.parametrize("name", list(LAUNCHED))
def test_a_failure_on_one_rank_after_training_is_agreed_by_every_rank(launched_runs, request, name):
    from tests.training.test_faults import outcome_of

    outcome_of(launched_runs, request)  # _failure_after_training
