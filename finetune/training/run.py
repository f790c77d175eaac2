"""One training run, as every process started by `accelerate launch finetune/train.py` runs it, in phases read top to
bottom (docs/architecture.md "The phases"). `Run` carries what the phases share. The configuration is resolved once
(--overwrite, a resume plan, the run's name and directory) before the phases that train, and only read after. The
phases and the hooks are the only code that hands sections of the record to the sinks (finetune/telemetry/sinks.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import transformers
from accelerate import PartialState

from finetune import held_back, preflight
from finetune.checkpointing import provenance, resume, resume_config, resume_plan, universal
from finetune.checkpointing.resume_config import ResumedConfig
from finetune.checkpointing.resume_plan import ResumePlan
from finetune.config.sections import Config
from finetune.console import guard_streams
from finetune.data import demo, read
from finetune.data.build import DataBundle, build_datasets
from finetune.errors import EXIT_PREEMPTED, exit_on_user_error
from finetune.export import live
from finetune.export.live import ExportCheck
from finetune.launch import cpu_rehearsal, peers, run_lock, rundir, strategy_setup
from finetune.launch.peers import Heartbeat, Teardown, run_on_main
from finetune.launch.plan import LaunchPlan
from finetune.modeling import attention, loss
from finetune.modeling.load import full_parameters, load_tokenizer, parameters_section
from finetune.planning import prediction
from finetune.preflight import model_files
from finetune.telemetry import sinks, wandb_logging
from finetune.telemetry.record import RunRecord
from finetune.telemetry.sinks import Sinks
from finetune.training import (
    arguments,
    build,
    endings,
    evaluation,
    fault_injection,
    planned,
    rank_imports,
    signals,
    speed,
)
from finetune.training.arguments import RunArguments
from finetune.training.endings import AfterTraining, Ending, Limits
from finetune.training.resilience import Diverged, ResilientTrainer

log = logging.getLogger("finetune")


@dataclass
class Run:
    """What the phases share. Every rank holds the record and its sinks; only rank 0's write and show it."""

    cfg: Config  # resolved: only read from here on
    launch: LaunchPlan
    state: PartialState
    name: str
    dir: Path
    data_path: str  # data.path, or the demo data generated into the run directory
    heldout_path: str | None  # eval.heldout_path, resolved the same way
    sinks: Sinks
    resume: ResumePlan | None  # the checkpoint this run continues from, and how
    teardown: Teardown  # the process group's, at exit (finetune/launch/peers.py)
    heartbeat: Heartbeat  # this rank's: names a lost or stuck rank (finetune/launch/peers.py)
    stops: signals.Stops  # this process's stop signals and watchdog (finetune/training/signals.py)
    check_ahead: Any = None  # rank 0, from training on: the export check's process (finetune/export/live.py)

    @property
    def recording(self) -> bool:
        """Once run.json and the resolved config are written (a refused resume writes neither)."""
        return self.sinks.committed


@dataclass(frozen=True)
class Data:
    tokenizer: Any
    bundle: DataBundle
    fingerprint: str  # the train rows in order (finetune/checkpointing/provenance.py)
    heldout: list[dict] | None  # exact-match rows, when eval.exact_match


@dataclass(frozen=True)
class Trained:
    train_loss: float
    train_s: float  # Trainer.train() of this launch
    exact_match: dict  # "before" -> evaluation.exact_match's result, when eval.before


@exit_on_user_error
def main(argv: list[str] | None = None, stops: signals.Stops | None = None) -> int:
    """`stops`: the stop signals finetune/train.py started recording before torch was imported."""
    guard_streams()  # a vanished console must not stop a run from checkpointing (finetune/console.py)
    stops = stops or signals.Stops()
    stops.install()  # recorded, never fatal (docs/faults.md "Signals"); train.py did it first
    signals.stop_with_parent()
    locks, code = run_lock.Locks(), None
    try:
        return (code := run_phases(argv, stops, locks))
    finally:
        locks.release_all()  # rank 0 is done with the run directory (a crash releases it too)
        if code != EXIT_PREEMPTED:  # preempted: torchrun stops the other ranks with SIGTERM; stay deaf to it
            stops.restore()


def run_phases(argv: list[str] | None, stops: signals.Stops, locks: run_lock.Locks) -> int:
    """main() once the signals are handled: start, prepare, train, end."""
    args, overrides, cfg, resumed = resume_config.of_command_line(argv)  # before anything heavy happens
    if args.overwrite:
        cfg = cfg.replaced("run", overwrite=True)
    stops.keep_only(cfg.training.stop_signals, grace_s=cfg.training.stop_grace)  # the others: default action back
    state, launch, teardown = start_processes(cfg, stopped=lambda: bool(stops.received))
    # heartbeat and watchdog: a stalled or stuck rank gets named (docs/faults.md), in the run once there is one
    run = None
    heartbeat = peers.start(state.process_index, launch.world_size, stops.watch, lambda cause: stuck(run, cause))
    try:
        stops.stop_if_received(state, "while the processes started")
    except signals.Stopped as e:  # nothing created yet
        teardown.ended_cleanly()
        return end(None, endings.stopped_before_training(e, None, resumed=False))
    run = prepare(
        cfg,
        launch,
        state,
        teardown,
        heartbeat,
        stops,
        locks,
        resume_from=args.resume,
        overrides=overrides,
        resumed_config=resumed,
    )
    try:
        code = train_and_record(run)
        run.teardown.ended_cleanly()  # every rank returns here together (completed or preempted)
        return code
    except signals.Stopped as e:  # every rank agreed, before training
        run.teardown.ended_cleanly()
        return end(run, endings.stopped_before_training(e, run.dir, resumed=run.resume is not None))
    except Diverged as e:  # non-finite or collapsed; every rank agreed; a message, not a traceback (docs/faults.md)
        code = end(run, endings.diverged(e))
        run.teardown.ended_cleanly()
        return code
    except BaseException as e:  # the record must say how the run ended, then the error goes on
        ending, failure = endings.failed(e, run)
        code = end(run, ending)
        if failure is None:  # said in one line (a rank lost, a GPU out of memory), the traceback in the run's log
            return code
        if failure is not e:  # a full or read-only disk: said, not a traceback
            raise failure from None
        raise


def train_and_record(run: Run) -> int:
    """The phases that train, in order; each returns what the next ones read. A signal before
    training stops every rank at the next phase boundary (signals.Stopped)."""
    started = time.perf_counter()
    arguments = training_arguments(run)
    attention_record = speed_options(run, arguments)
    data = run.stops.phase(
        run.state, "while the data was prepared", lambda: load_data(run, arguments), "the data preparation"
    )
    if run.resume:  # the rows must be the checkpoint's, before the model loads
        resume_plan.check_data(run.resume, rows=len(data.bundle.train), fingerprint=data.fingerprint)
        commit(run)  # the continued record replaces run.json from here on
    universal_dir = convert_for_resume(run)  # DeepSpeed under another world size
    with run.stops.watch.during("the model load", arguments.args.ddp_timeout):  # not cut short by a signal's grace
        model = load_model(run, arguments)
        ddp_record = ddp_options(run, arguments, model, data)
        trainer = build_trainer(run, arguments, model, data, universal_dir, ddp_record)
    run.stops.stop_if_received(run.state, "while the model loaded")
    record_setup(run, trainer, arguments, model, data, attention_record, ddp_record)
    run.sinks.start()
    # rank 0: the save's check starts its process with training, which it imports during (not before the first step)
    with live.started_ahead(ExportCheck.for_run(run), run.cfg.run.save_model and run.state.is_main_process) as ahead:
        run.check_ahead = ahead
        trained = train(run, trainer, model, data, universal_dir)
        if trained is None:  # preempted: every rank agreed to stop; the checkpoint is complete
            return preempted(run, trainer, arguments)
        return finish(run, trainer, model, data, trained, started, arguments)


# --- before the run: the processes, the launch, the run directory ------------------------------------


def start_processes(cfg: Config, stopped=lambda: False) -> tuple[PartialState, LaunchPlan, Teardown]:
    """The process group, set up by the launcher's config or the recipe (finetune/launch/strategy_setup.py),
    and the launch worked out once it exists. `stopped()`: a stop signal arrived (the Stops of the run)."""
    setup = strategy_setup.detect(cfg)
    preflight.check_before_processes(cfg, setup, stopped=stopped)  # lone processes: refused before any group
    with held_back.printed_lines_held(held_back.DEEPSPEED_OP_LOADED):
        rank_imports.load_ops(rank_imports.ops_before_processes(setup))  # else built in PartialState, unannounced
        strategy_setup.prepare(setup)  # the recipe route's environment, before the first PartialState
        # The collective timeout must reach the first init_process_group (this one; DeepSpeed's
        # init_distributed gets it through Accelerate): a rank that stalls ends the run after it.
        timeout = timedelta(seconds=cfg.training.typed.ddp_timeout)
        state = PartialState(cpu=setup.cpu_gloo is not None, timeout=timeout)
        strategy_setup.adopt_deepspeed_comm(setup, sequence_parallel=cfg.parallel.sp_size > 1)
    teardown = peers.Teardown(state)  # before the interpreter exits
    if setup.cpu_gloo is not None:
        cpu_rehearsal.keep_fsdp_on_cpu()  # before Trainer builds its AcceleratorState
    return state, LaunchPlan.resolve(cfg, state, setup), teardown


def prepare(
    cfg: Config,
    launch: LaunchPlan,
    state: PartialState,
    teardown: Teardown,
    heartbeat: Heartbeat,
    stops: signals.Stops,
    locks: run_lock.Locks,  # the run directories this process holds (rank 0)
    *,
    resume_from: str | None,
    overrides: list[str],
    resumed_config: ResumedConfig | None = None,
) -> Run:
    """The resume plan, preflight, the run directory (rank 0 names and creates it), the record and
    its backends, and the demo data; a fresh run's record and config are written here."""
    plan = resumed = None
    allowed = bool(resumed_config and resumed_config.allow_input_change)
    if resume_from:  # before preflight: the plan sets the accumulation and strategy the checks see
        run_on_main(state, lambda: rundir.lock_to_resume(cfg, locks))  # a live run's directory: refused, untouched
        name, planned_dir, plan = run_on_main(
            state, lambda: resume_plan.for_launch(cfg, launch, resume_from, overrides, allow_input_change=allowed)
        )
        cfg = resume_plan.applied(plan, cfg)  # a new configuration: nothing edits one after it is built
        resumed = (name, planned_dir)
    cfg, planned_section = planned.resolve(cfg, launch, state)  # `auto` levers: a new configuration, and run.json plan
    # world size, launch config vs recipe, data, run dir: all at once, before any weights load
    preflight.check_before_loading(cfg, state, resume=resume_from, launch=launch)
    _setup_logging(cfg.logging.log_level, state.is_main_process)
    log.info("%s", launch.setup.describe())  # rank 0: the other ranks log warnings only
    name, path = run_on_main(state, lambda: rundir.create(cfg, locks, resumed))  # every rank agrees on it
    cfg = cfg.replaced("run", name=name, output_dir=path)
    run_dir = Path(path)
    held_back.to_log_file(run_dir / rundir.LOG_FILE, state.process_index)
    if state.is_main_process:
        print(
            f"[finetune] run directory: {run_dir.absolute()} (any third-party warnings: {rundir.LOG_FILE})", flush=True
        )
    record = RunRecord(run_dir / "run.json", run_name=name, recipe=cfg.recipe, config=cfg.to_dict())
    run_sinks = sinks.for_run(cfg, record, run_dir, main=state.is_main_process)
    run_sinks.put(plan=planned_section)
    if plan:  # the earlier run.json, read on rank 0, carried into every rank's record
        created = run_sinks.view.get("created")
        continued, summary = run_on_main(
            state, lambda: resume.continued(run_dir, Path(plan.checkpoint), plan, created=created)
        )
        run_sinks.put(**continued)
        run_sinks.merge("summary", **summary)
        noted = resume_config.said(resumed_config)
        if noted:
            run_sinks.put(resumes=resume.noted(run_sinks.view, **noted))
        if state.is_main_process:  # said loudly when the layout changes or the base's snapshot is pinned
            (log.warning if plan.notable else log.info)(resume_plan.describe(plan))
    data_path, heldout_path = demo.paths(cfg, run_dir)
    run = Run(
        cfg,
        launch,
        state,
        name,
        run_dir,
        data_path,
        heldout_path,
        run_sinks,
        plan,
        teardown,
        heartbeat,
        stops,
    )
    if not plan:  # a resumed run commits once its data is checked (train_and_record)
        commit(run)
    train_file = Path(run.data_path)  # the demo recipe's data is generated here; a resumed run keeps its own
    if cfg.data.path == "demo" and not (run.resume and train_file.is_file()):
        size, heldout = cfg.data.demo_train_size, cfg.data.demo_heldout_size
        write = lambda: demo.write_demo(train_file.parent, size, heldout)  # noqa: E731
        rundir.write_on_main(run.state, run.dir, "the demo data", write)
    return run


def commit(run: Run) -> None:
    """Write run.json and the resolved configuration (rank 0). A resumed run commits only once its
    data is checked, so a resume refused before leaves the run directory as it was."""

    def write():
        if run.resume:
            resume.keep_previous_record(run.dir)
        run.sinks.commit()  # first: a directory holding a run.json is one a retry can judge (rundir.reusable)
        saved = (resume.save_config if run.resume else rundir.save_resolved_config)(run.dir, run.cfg.to_dict())
        shown = (
            f", saved to {saved}:\n{saved.read_text(encoding='utf-8').rstrip()}"
            if run.cfg.logging.print_config
            else f" saved to {saved} (--logging.print_config=true prints it)"
        )
        log.info("resolved configuration (defaults < recipe < command line)%s", shown)

    rundir.write_on_main(run.state, run.dir, "run.json and config.yaml", write)


# --- the phases that train -----------------------------------------------------------------------------


def training_arguments(run: Run) -> RunArguments:
    """TrainingArguments, once, before the model loads (finetune/training/arguments.py)."""
    if wandb_logging.enabled(run.cfg.logging.report_to):  # before Trainer builds its callbacks: they read it
        wandb_logging.configure_environment(run.cfg.logging.wandb_project, run.dir)
    return arguments.for_run(run.cfg, run.launch, output_dir=run.dir, run_name=run.name)


def speed_options(run: Run, arguments: RunArguments) -> dict:
    """Refuse unsafe speed options; set torch's SDPA backends on every rank before the first forward
    (process-global: training, evaluation, generate). Returns what was set, for run.json `speed`."""
    speed.check(run.cfg)  # packing/padding-free vs attention implementation, Liger on this machine
    model = run.cfg.model
    return attention.apply(model.sdpa_backends, arguments.args.device.type, model.attn_implementation)


def load_data(run: Run, arguments: RunArguments) -> Data:
    """Tokenizer, datasets, and the held-out rows; no collective, so a stop signal ends the build at
    the next row (signals.Interrupted)."""
    cfg = run.cfg
    tokenizer = load_tokenizer(cfg.model)
    bundle = build_datasets(
        dataclasses.replace(cfg.data, path=run.data_path),
        tokenizer,
        seed=arguments.args.seed,
        interrupt=run.stops.check_interrupt,
    )
    model_files.check_vocabulary(cfg.model, tokenizer, bundle)  # an id past the embedding: IndexError at step 1
    fingerprint = provenance.data_fingerprint(bundle.train)
    heldout = read.read_rows(run.heldout_path)[: cfg.eval.samples] if cfg.eval.exact_match else None
    return Data(tokenizer, bundle, fingerprint, heldout)


def convert_for_resume(run: Run) -> str | None:
    """DeepSpeed's universal checkpoint, when the resume plan reshards through it (every rank); noted
    in the resumed segment."""
    converted = universal.for_resume(run.state, run.resume)
    if converted is None:
        return None
    out, seconds = converted
    run.sinks.put(resumes=resume.noted(run.sinks.view, universal_cache=out, conversion_s=seconds))
    return out


def load_model(run: Run, arguments: RunArguments):
    """The model in the policy's dtypes (LoRA/QLoRA wrapped), with the loss installed before Trainer wraps it."""
    fault_injection.hold("slow_load", rank=run.state.process_index, step=1, what="the model load")
    return build.model_for(run.cfg, run.launch, arguments)


def ddp_options(run: Run, arguments: RunArguments, model, data: Data) -> dict:
    """DDP's find_unused_parameters decided from the model (finetune/training/speed.py), handed to the Trainer
    as it is built; run.json `speed.ddp`. Every rank probes the same first example, so every rank decides the same."""
    return speed.ddp_unused_parameters(
        run.cfg, run.launch, model, data.bundle.train[0]["input_ids"][:64], arguments.args.device
    )


def build_trainer(
    run: Run, arguments: RunArguments, model, data: Data, universal_dir: str | None, ddp_record: dict
) -> ResilientTrainer:
    """The Trainer (finetune/training/build.py) with its hooks, set to continue a resumed run's checkpoint."""
    rows = dict(train_rows=len(data.bundle.train), fingerprint=data.fingerprint)
    return build.trainer_for(
        run.cfg,
        run.launch,
        arguments,
        model,
        train_dataset=data.bundle.train,
        eval_dataset=data.bundle.eval,
        tokenizer=data.tokenizer,
        sinks=run.sinks,
        stops=run.stops,
        machines=run.launch.machines,  # run.json `nodes`; every rank (it gathers)
        resumed_world_size=run.resume.written["world_size"] if run.resume else None,  # Trainer._load_rng_state
        find_unused_parameters=ddp_record["find_unused_parameters"],  # None: not DDP
        run_facts=lambda: provenance.run_block_of(  # the completion marker's `run`, with the inputs record_setup put
            run.sinks.view, provenance.static_facts(run.cfg, **rows, inputs=run.sinks.view.get("inputs"))
        ),
        universal=universal_dir is not None,
    )


def record_setup(
    run: Run,
    trainer: ResilientTrainer,
    arguments: RunArguments,
    model,
    data: Data,
    attention_record: dict,
    ddp_record: dict,
) -> None:
    """What the run set up, handed to the sinks, each section as its owner computes it."""
    cfg, hand = run.cfg, run.sinks.put
    hand(batch=arguments.batch, lr=arguments.lr)
    if not run.resume:
        hand(resumes=resume.first_segment(run.sinks.view))
    # what the run is made from (the marker's too, on --resume): rank 0 reads the files, every rank keeps the record
    hand(inputs=run_on_main(run.state, lambda: provenance.inputs(cfg, run.data_path, run.heldout_path)))
    hand(faults=trainer.faults_section(), data=data.bundle.stats.section(), parameters=parameters_section(model))
    records = dict(attention_record=attention_record, loss_record=loss.installed(model), ddp_record=ddp_record)
    hand(speed=speed.section(cfg, model, trainer, **records))
    # memory prediction for the engaged strategy (finetune/planning/prediction.py); its error is filled at the end
    predicted = prediction.run_prediction(
        run.sinks.view,
        model.config,
        cfg,
        gradient_checkpointing=arguments.gradient_checkpointing,
        precision=run.launch.policy.name,
        train_dataset=data.bundle.train,
    )
    hand(predicted_memory=predicted)


def train(run: Run, trainer: ResilientTrainer, model, data: Data, universal_dir: str | None) -> Trained | None:
    """Exact match before, then Trainer.train() from the checkpoint resumed from; None when the run
    was preempted (during training, or at its end: then with a checkpoint of the final step), a
    CollapseError when it collapsed (finetune/training/resilience.py)."""
    rank_imports.load_ops(rank_imports.ops_at_optimizer(run.launch))  # DeepSpeedCPUAdam: else built in train()
    results = {}
    if data.heldout is not None and run.cfg.eval.before:
        results["before"] = exact_match(run, trainer, model, data, "before")
        run.stops.stop_if_received(run.state, "during the evaluation before training")
    if run.resume:  # never saved into by this run
        moved = resume.set_aside_newer(run.state, run.dir, run.resume.step)
        run.sinks.put(resumes=resume.noted(run.sinks.view, superseded=moved))
    run.stops.set_stage(signals.TRAINING)
    held_back.keep_held()  # the notices held back so far, into the run's third_party.log
    train_start = time.perf_counter()
    out = trainer.train(resume_from_checkpoint=universal_dir or (run.resume.checkpoint if run.resume else None))
    train_s = time.perf_counter() - train_start
    run.stops.set_stage(signals.FINISHING)
    if trainer.resilience.preempted:  # a signal after training is agreed at finish()'s first boundary
        return None
    collapsed = trainer.collapse.stopped(trainer.skipped_steps)  # training.on_collapse: stop
    if collapsed:
        raise collapsed  # before any export: main() records it and exits 3
    return Trained(out.training_loss, train_s, results)


def finish(
    run: Run, trainer: ResilientTrainer, model, data: Data, trained: Trained, started: float, arguments: RunArguments
) -> int:
    """The export, then the eval loss and exact match, the summary, the figures; the sinks closed. Each
    step ends at a boundary every rank agrees on (finetune/training/endings.py): a failure on any rank
    saves the trained weights on every rank and reports where they are; a signal stops every rank
    there with a checkpoint of the final step (exit 75; --resume evaluates)."""
    cfg, rank, step = run.cfg, run.state.process_index, trainer.state.global_step
    limits = Limits(finish_s=cfg.training.finish_timeout, save_s=arguments.args.ddp_timeout)
    peers.set_collective_timeout(max(limits.finish_s, limits.save_s) + peers.MARGIN_S)  # the watchdog acts first
    results = dict(trained.exact_match)

    def measure():
        trainer.save_state()  # trainer_state.json in the run directory: log history, step, epoch
        return trainer.final_measurements()

    def evaluate():
        fault_injection.hold("slow_eval", rank=rank, step=step, what="evaluation")
        loss = trainer.evaluate()["eval_loss"] if data.bundle.eval is not None else None
        fault_injection.fail("eval", rank=rank, step=step)  # drills fail a step after its collectives
        return loss

    def match():
        result = exact_match(run, trainer, model, data, "after")
        fault_injection.fail("exact_match", rank=rank, step=step)
        return result

    check = ExportCheck.for_run(run)
    after = AfterTraining(trainer, run.dir / "model", data.tokenizer, limits, run.stops, check, run.check_ahead)
    try:
        with after:
            measured = after.step("the measurements", measure)
            if cfg.run.save_model:
                run.stops.set_stage(signals.EXPORTING)  # a signal lets the export finish, never torn
                after.export()
                run.stops.set_stage(signals.FINISHING)
                run.sinks.put(export=after.record)  # the check's findings (rank 0's; the sinks write rank 0's)
            eval_loss = after.step("the evaluation", evaluate)
            if data.heldout is not None:
                results["after"] = after.step("exact match", match)
            collapsed = trainer.collapse.error(trainer.skipped_steps)  # training.on_collapse: flag
            ended = Ended(measured, trained, results, eval_loss, started, collapsed)
            after.step("the record", lambda: record_end(run, trainer, model, ended))
            if collapsed:
                raise collapsed  # main() records the error and exits 3
    except signals.Stopped:  # every rank agreed; the checkpoint of the final step is written
        return preempted(run, trainer, arguments)
    except Exception:
        if after.checkpoint:  # the export (or its check) failed: the weights are in this checkpoint
            run.sinks.merge("summary", checkpoint=str(after.checkpoint))
            run.sinks.put(export=after.record)
        raise
    run.sinks.close(0)
    return 0


@dataclass(frozen=True)
class Ended:
    """What the steps after training measured, for the record."""

    measured: dict
    trained: Trained
    exact_match: dict
    eval_loss: float | None
    started: float
    collapsed: Exception | None


def record_end(run: Run, trainer: ResilientTrainer, model, ended: Ended) -> None:
    """The last step after training: the summary, the figures and the evaluation, handed to the sinks."""
    fault_injection.fail("record", rank=run.state.process_index, step=trainer.state.global_step)
    run.sinks.merge(
        "summary",
        eval_loss=ended.eval_loss,
        steps=trainer.state.global_step,
        train_s=round(ended.trained.train_s, 2),
        wall_s=round(time.perf_counter() - ended.started, 2),
        status="failed" if ended.collapsed else "completed",
        nonfinite_skipped=trainer.skipped_steps,
    )
    world, train_loss = run.launch.world_size, ended.trained.train_loss
    summary, sections = endings.figures(
        run.sinks.view, ended.measured, model, run.cfg, world=world, train_loss=train_loss
    )
    run.sinks.merge("summary", **summary)
    if ended.exact_match:
        sections["eval"] = evaluation.section(ended.exact_match, run.heldout_path)
    run.sinks.put(**sections)


# --- how a run ends ------------------------------------------------------------------------------------


def preempted(run: Run, trainer: ResilientTrainer, arguments: RunArguments) -> int:
    """Every rank agreed to stop with a complete checkpoint: the steps since the last log recorded
    (every rank: it gathers), then the ending."""
    trainer.record_tail()  # steps[] up to the checkpoint's step: the resumed run totals from it
    return end(run, endings.preempted(trainer, arguments.batch["effective"], run.dir))


def end(run: Run | None, ending: Ending) -> int:
    """How the run ended, handed to the sinks once the record is committed, and said by rank 0."""
    if run is not None and run.recording:
        run.sinks.merge("summary", **ending.summary)
        run.sinks.close(ending.code)
    if ending.said and (run is None or run.state.is_main_process):
        print(ending.said, file=sys.stderr if ending.to_stderr else sys.stdout, flush=True)
    return ending.code


def stuck(run: Run | None, cause: str) -> None:
    """The watchdog ends this rank (its thread, the main thread held in a collective): the run, once there is one,
    is recorded failed; no sink is closed and no collective entered, either could hang too."""
    if run is not None and run.recording:
        run.sinks.merge("summary", **endings.stuck(cause, run.dir))


# --- helpers ---------------------------------------------------------------------------------------------


def exact_match(run: Run, trainer: ResilientTrainer, model, data: Data, stage: str) -> dict:
    """Exact match on the held-out rows, sharded over the ranks; `before` gathers ZeRO-3 shards first."""
    cfg = run.cfg
    with full_parameters(model) if stage == "before" else contextlib.nullcontext():
        result = evaluation.exact_match(
            model,
            data.tokenizer,
            data.heldout,
            system_prompt=cfg.data.system_prompt,
            use_chat_template=cfg.data.chat_template,
            max_new_tokens=cfg.eval.max_new_tokens,
            batch_size=cfg.eval.batch_size,
            source=run.heldout_path,
            accelerator=trainer.accelerator,
            watch=run.stops.watch,
        )  # reduce() across ranks: an Accelerator, not PartialState
    done = (100 * result["exact_match"], result["correct"], result["total"])
    log.info("exact match %s training: %.1f%% (%d/%d)", stage, *done)  # rank 0: the others log warnings only
    return result


def _setup_logging(level: str, main_process: bool) -> None:
    logging.basicConfig(
        format="[%(asctime)s %(name)s] %(message)s",
        datefmt="%H:%M:%S",
        level=getattr(logging, level.upper()) if main_process else logging.WARNING,
    )
    transformers.logging.set_verbosity_warning()
