"""One training run, as every process started by `accelerate launch finetune/train.py` runs it, in
phases read top to bottom:

    start the processes and resolve the launch (each rank's node too) -> prepare the run (resume
    plan, preflight, run directory, record, the ranks' heartbeats) -> TrainingArguments -> speed
    options -> tokenizer and data -> model -> DDP options -> trainer -> nodes and setup recorded ->
    train -> finish and record

`Run` carries what the phases share. The configuration is resolved once (--overwrite, a resume
plan, the run's name and directory) before the phases that train, and only read after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.cli import options
from finetune.errors import EXIT_PREEMPTED, UserError, exit_on_user_error

if TYPE_CHECKING:
    from accelerate import PartialState

    from finetune.checkpointing.resume_config import ResumedConfig
    from finetune.checkpointing.resume_plan import ResumePlan
    from finetune.config.sections import Config
    from finetune.data.build import DataBundle
    from finetune.launch.peers import Heartbeat
    from finetune.launch.plan import LaunchPlan
    from finetune.telemetry.record import RunRecord
    from finetune.telemetry.sinks import Sinks
    from finetune.training.arguments import RunArguments
    from finetune.training.trainer import ResilientTrainer

log = logging.getLogger("finetune")


@dataclass
class Run:
    """What the phases share. `record` and `sinks` exist on rank 0 only."""

    cfg: Config  # resolved: only read from here on
    launch: LaunchPlan
    state: PartialState
    name: str
    dir: Path
    data_path: str  # data.path, or the demo data generated into the run directory
    heldout_path: str | None  # eval.heldout_path, resolved the same way
    record: RunRecord | None
    sinks: Sinks | None
    resume: ResumePlan | None  # the checkpoint this run continues from, and how
    ended: list  # appended to once every rank is done (finetune/launch/ranks.py close_process_group_at_exit)
    heartbeat: Heartbeat | None  # this rank's, to name a lost rank (finetune/launch/peers.py); None: one process
    committed: bool = False  # run.json and the resolved config are written (a refused resume writes neither)


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
def main(argv: list[str] | None = None) -> int:
    from finetune.config.recipe import load_recipe
    from finetune.training.collapse import Diverged
    from finetune.training.signals import install_signal_handlers

    args, overrides = options.parse_train_args(argv)
    resumed = None
    if args.resume:  # the run's saved configuration, with any change the user allowed (resume_config.py)
        from finetune.checkpointing import resume_config

        resumed = resume_config.resolve(args.recipe, overrides, allow_change=args.allow_config_change)
        cfg = resumed.cfg
    else:
        if args.allow_config_change:
            raise UserError("--allow-config-change applies to --resume only (a new run takes any configuration)")
        cfg, _ = load_recipe(args.recipe, overrides)  # validated before anything heavy happens
    if args.overwrite:
        cfg = cfg.replaced("run", overwrite=True)
    state, launch, ended = start_processes(cfg)
    run = prepare(cfg, launch, state, ended, resume=args.resume, overrides=overrides, resumed_config=resumed)
    install_signal_handlers()  # SIGTERM/SIGINT -> checkpoint and exit 75 (finetune/training/trainer.py)
    try:
        code = train_and_record(run)
        run.ended.append(True)  # every rank returns here together (completed or preempted)
        return code
    except Diverged as e:  # non-finite or collapsed; every rank agreed; a message, not a traceback (docs/faults.md)
        if run.record and run.committed:
            run.record.update("summary", status="failed", error=f"{type(e).__name__}: {e}", nonfinite_skipped=e.skipped)
            run.sinks.close(run.record.view, e.exit_code)
            print(f"error: {e}", file=sys.stderr, flush=True)
        run.ended.append(True)
        return e.exit_code
    except BaseException as e:  # the record must say how the run ended, then the error goes on
        from finetune.launch import peers

        lost = peers.failure_note(e, run.heartbeat, run.launch.machines)  # the ranks (and nodes) gone, if so
        if run.record and run.committed:
            interrupted = isinstance(e, KeyboardInterrupt)
            run.record.update(
                "summary",
                status="interrupted" if interrupted else "failed",
                error=None if interrupted else f"{lost + '; ' if lost else ''}{type(e).__name__}: {e}",
            )
            run.sinks.close(run.record.view, 1)
        raise


def train_and_record(run: Run) -> int:
    """The phases that train, in order; each returns what the next ones read."""
    from finetune.checkpointing import universal
    from finetune.training import node_figures

    started = time.perf_counter()
    arguments = training_arguments(run)
    attention_record = speed_options(run, arguments)
    data = load_data(run, arguments)
    universal_dir = universal.for_resume(run.state, run.resume, run.record)  # DeepSpeed under another world size
    model = load_model(run, arguments)
    ddp_record = ddp_options(run, arguments, model, data)
    trainer = build_trainer(run, arguments, model, data, universal_dir)
    node_figures.install(trainer, run.launch.machines, run.record)  # run.json `nodes`; every rank (it gathers)
    if run.record:
        record_setup(run, trainer, arguments, model, data, attention_record, ddp_record)
        run.sinks.start(run.record.view)
    trained = train(run, trainer, model, data, universal_dir)
    if trained is None:  # preempted: every rank agreed to stop; the checkpoint is complete
        return preempted(run, trainer, arguments)
    return finish(run, trainer, model, data, trained, started)


# --- before the run: the processes, the launch, the run directory ------------------------------------


def start_processes(cfg: Config) -> tuple[PartialState, LaunchPlan, list]:
    """The process group, set up by the launcher's config or the recipe (finetune/launch/strategy_setup.py),
    and the launch worked out once it exists."""
    from datetime import timedelta

    from accelerate import PartialState

    from finetune import preflight
    from finetune.launch import cpu_rehearsal, op_builds, strategy_setup
    from finetune.launch.plan import LaunchPlan
    from finetune.launch.ranks import close_process_group_at_exit

    setup = strategy_setup.detect(cfg)
    preflight.check_before_processes(cfg, setup)  # lone processes: refused by every rank, before any group
    _announce_op_builds(op_builds.before_processes(setup))  # DeepSpeed's CPU comm op compiles in PartialState
    strategy_setup.prepare(setup)  # the recipe route's environment, before the first PartialState
    # The collective timeout must reach the first init_process_group (this one; DeepSpeed's
    # init_distributed gets it through Accelerate): a rank that stalls ends the run after it.
    state = PartialState(cpu=setup.cpu_gloo is not None, timeout=timedelta(seconds=cfg.training.args["ddp_timeout"]))
    strategy_setup.adopt_deepspeed_comm(setup, sequence_parallel=cfg.parallel.sp_size > 1)
    ended = close_process_group_at_exit(state)  # before the interpreter exits (finetune/launch/ranks.py)
    if setup.cpu_gloo is not None:
        cpu_rehearsal.keep_fsdp_on_cpu()  # before Trainer builds its AcceleratorState
    return state, LaunchPlan.resolve(cfg, state, setup), ended


def prepare(
    cfg: Config,
    launch: LaunchPlan,
    state: PartialState,
    ended: list,
    *,
    resume: str | None,
    overrides: list[str],
    resumed_config: ResumedConfig | None = None,
) -> Run:
    """The resume plan, preflight, the run directory (rank 0 names and creates it), the record and
    its backends, and the demo data; a fresh run's record and config are written here."""
    from finetune import preflight
    from finetune.checkpointing import resume as resuming
    from finetune.checkpointing import resume_config, resume_plan
    from finetune.data import demo
    from finetune.launch import peers, rundir
    from finetune.launch.ranks import run_on_main
    from finetune.telemetry import sinks
    from finetune.telemetry.record import RunRecord

    plan = resumed = None
    if resume:  # before preflight: the plan sets the accumulation and strategy the checks see
        name, planned_dir, plan = run_on_main(state, lambda: resume_plan.for_launch(cfg, launch, resume, overrides))
        resume_plan.apply(plan, cfg)
        resumed = (name, planned_dir)
    # world size, launch config vs recipe, data, run dir: all at once, before any weights load
    preflight.check_before_loading(cfg, state, resume=resume, launch=launch)
    heartbeat = peers.start(state.process_index, launch.world_size)  # names a lost rank if training fails
    _setup_logging(cfg.logging.log_level, state.is_main_process)
    if state.is_main_process:
        log.info("%s", launch.setup.describe())
    name, path = run_on_main(state, lambda: rundir.create(cfg, resumed))  # every rank agrees on it
    cfg = cfg.replaced("run", name=name, output_dir=path)
    run_dir = Path(path)
    record = (
        RunRecord(run_dir / "run.json", run_name=name, recipe=cfg.recipe, config=cfg.to_dict())
        if state.is_main_process
        else None
    )
    if record and plan:
        resuming.continue_record(record, run_dir, Path(plan.checkpoint), plan)
        resume_config.note(record, resumed_config)
        # said loudly when the layout changes (accumulation recomputed, states resharded)
        (log.warning if plan.reshard != "none" or plan.layout_changed else log.info)(resume_plan.describe(plan))
    data_path, heldout_path = demo.paths(cfg, run_dir)
    run = Run(
        cfg=cfg,
        launch=launch,
        state=state,
        name=name,
        dir=run_dir,
        data_path=data_path,
        heldout_path=heldout_path,
        record=record,
        sinks=sinks.for_run(cfg, record, run_dir) if record else None,
        resume=plan,
        ended=ended,
        heartbeat=heartbeat,
    )
    if not plan:  # a resumed run commits once its data is checked (load_data)
        commit(run)
    if cfg.data.path == "demo":
        _write_demo_data(run)
    return run


def commit(run: Run) -> None:
    """Write run.json and the resolved configuration (rank 0). A resumed run commits only once its
    data is checked, so a resume refused before leaves the run directory as it was."""
    from finetune.checkpointing import resume
    from finetune.launch import rundir

    run.committed = True
    if run.record is None:
        return
    if run.resume:
        resume.keep_previous_record(run.dir)
    saved = (resume.save_config if run.resume else rundir.save_resolved_config)(run.dir, run.cfg.to_dict())
    if run.cfg.logging.print_config:
        log.info(
            "resolved configuration (defaults < recipe < command line), saved to %s:\n%s",
            saved,
            saved.read_text(encoding="utf-8").rstrip(),
        )
    else:
        log.info(
            "resolved configuration (defaults < recipe < command line) saved to %s (--logging.print_config=true prints it)",
            saved,
        )
    run.record.write()


# --- the phases that train -----------------------------------------------------------------------------


def training_arguments(run: Run) -> RunArguments:
    """TrainingArguments, once, before the model loads (finetune/training/arguments.py)."""
    from finetune.telemetry import wandb_logging
    from finetune.training import arguments

    if wandb_logging.enabled(run.cfg.logging.report_to):  # before Trainer builds its callbacks: they read it
        wandb_logging.configure_environment(run.cfg.logging.wandb_project, run.dir)
    return arguments.for_run(run.cfg, run.launch, output_dir=run.dir, run_name=run.name)


def speed_options(run: Run, arguments: RunArguments) -> dict:
    """Refuse unsafe speed options; set torch's SDPA backends on every rank before the first forward
    (process-global: training, evaluation, generate). Returns what was set, for run.json `speed`."""
    from finetune.modeling import attention
    from finetune.training import speed

    speed.check(run.cfg)  # packing/padding-free vs attention implementation, Liger on this machine
    model = run.cfg.model
    return attention.apply(model.sdpa_backends, arguments.args.device.type, model.attn_implementation)


def load_data(run: Run, arguments: RunArguments) -> Data:
    """Tokenizer, datasets, and the held-out rows; a resumed run checks the rows are the checkpoint's
    before the model loads, then commits."""
    from finetune.checkpointing import provenance, resume_plan
    from finetune.data import build, read
    from finetune.modeling.load import load_tokenizer
    from finetune.preflight import model_files

    cfg = run.cfg
    tokenizer = load_tokenizer(cfg.model)
    bundle = build.build_datasets(
        dataclasses.replace(cfg.data, path=run.data_path), tokenizer, seed=arguments.args.seed
    )
    model_files.check_vocabulary(cfg.model, tokenizer, bundle)  # an id past the embedding: IndexError at step 1
    fingerprint = provenance.data_fingerprint(bundle.train)
    if run.resume:
        resume_plan.check_data(run.resume, rows=len(bundle.train), fingerprint=fingerprint)
        commit(run)  # the continued record replaces run.json from here on
    heldout = read.read_rows(run.heldout_path)[: cfg.eval.samples] if cfg.eval.exact_match else None
    return Data(tokenizer, bundle, fingerprint, heldout)


def load_model(run: Run, arguments: RunArguments):
    """The model in the policy's dtypes (LoRA/QLoRA wrapped), with the loss installed before Trainer wraps it."""
    from finetune.training import build

    return build.model_for(run.cfg, run.launch, arguments)


def ddp_options(run: Run, arguments: RunArguments, model, data: Data) -> dict:
    """DDP's find_unused_parameters decided from the model (finetune/training/speed.py), set in
    TrainingArguments before Trainer reads it; returns run.json `speed.ddp`. Every rank probes the
    same first example, so every rank decides the same."""
    from finetune.training import speed

    decided = speed.ddp_unused_parameters(
        run.cfg, run.launch, model, data.bundle.train[0]["input_ids"][:64], arguments.args.device
    )
    if decided["decided_by"] in ("probe", "model config"):
        arguments.args.ddp_find_unused_parameters = decided["find_unused_parameters"]
    return decided


def build_trainer(run: Run, arguments: RunArguments, model, data: Data, universal_dir: str | None) -> ResilientTrainer:
    """The Trainer (finetune/training/build.py), set to continue a resumed run's checkpoint."""
    from finetune.checkpointing import universal
    from finetune.training import build

    trainer = build.trainer_for(
        run.cfg,
        run.launch,
        arguments,
        model,
        train_dataset=data.bundle.train,
        eval_dataset=data.bundle.eval,
        tokenizer=data.tokenizer,
        sinks=run.sinks,
        record=run.record,
    )
    trainer.resumed_world_size = run.resume.written["world_size"] if run.resume else None  # checkpointing/rng.py
    if universal_dir:
        universal.enable_loading(trainer)
    return trainer


def record_setup(
    run: Run,
    trainer: ResilientTrainer,
    arguments: RunArguments,
    model,
    data: Data,
    attention_record: dict,
    ddp_record: dict,
) -> None:
    """What the run set up, into its record (rank 0), each section as its owner builds it."""
    from finetune.checkpointing import provenance, resume
    from finetune.modeling import loss
    from finetune.modeling.load import parameters_section
    from finetune.planning import prediction
    from finetune.training import speed

    cfg, record = run.cfg, run.record
    record.set("batch", arguments.batch)
    record.set("lr", arguments.lr)
    if not run.resume:
        resume.first_segment(record)
    static = provenance.static_facts(cfg, train_rows=len(data.bundle.train), fingerprint=data.fingerprint)
    trainer.resilience.run_facts = lambda: provenance.run_block_of(record.view, static)  # the marker's `run` block
    record.set("faults", trainer.faults_section())  # docs/faults.md
    record.set("data", data.bundle.stats.section())
    record.set("parameters", parameters_section(model))
    record.set(
        "speed",
        speed.section(
            cfg,
            model,
            trainer,
            attention_record=attention_record,
            loss_record=loss.installed(model),
            ddp_record=ddp_record,
        ),
    )
    # memory prediction for the engaged strategy (finetune/planning/prediction.py); its error is filled at the end
    prediction.record_prediction(
        record,
        model.config,
        cfg,
        gradient_checkpointing=arguments.gradient_checkpointing,
        precision=run.launch.policy.name,
        train_dataset=data.bundle.train,
    )


def train(run: Run, trainer: ResilientTrainer, model, data: Data, universal_dir: str | None) -> Trained | None:
    """Exact match before, then Trainer.train() from the checkpoint resumed from; None when the run
    was preempted, a CollapseError when it collapsed (finetune/training/collapse.py)."""
    from finetune.checkpointing import resume
    from finetune.launch import op_builds

    _announce_op_builds(op_builds.at_optimizer(run.launch))  # DeepSpeedCPUAdam compiles when training starts
    results = {}
    if data.heldout is not None and run.cfg.eval.before:
        results["before"] = _exact_match(run, trainer, model, data, "before")
    if run.resume:  # never saved into by this run
        resume.set_aside_newer(run.state, run.dir, run.resume.step, run.record)
    train_start = time.perf_counter()
    out = trainer.train(resume_from_checkpoint=universal_dir or (run.resume.checkpoint if run.resume else None))
    train_s = time.perf_counter() - train_start
    if trainer.resilience.preempted:
        return None
    collapsed = trainer.collapse.stopped(trainer.skipped_steps)  # training.on_collapse: stop
    if collapsed:
        raise collapsed  # before any export: main() records it and exits 3
    return Trained(out.training_loss, train_s, results)


def preempted(run: Run, trainer: ResilientTrainer, arguments: RunArguments) -> int:
    """Status `interrupted`, the resume command, and an exit code that says preempted."""
    from finetune.checkpointing import resume

    p, ckpt = trainer.resilience.preempted, trainer.resilience.last_complete
    trainer.record_tail()  # steps[] up to the checkpoint's step: the resumed run totals from it
    if run.record:
        run.record.update(
            "summary",
            status="interrupted",
            steps=trainer.state.global_step,
            checkpoint=str(ckpt),
            error=f"preempted by {p['signal'] or 'a signal'} on rank(s) {p['ranks']} at step {p['step']}",
            nonfinite_skipped=trainer.skipped_steps,
        )
        run.sinks.close(run.record.view, EXIT_PREEMPTED)
        command = resume.resume_command(
            run.dir, effective=arguments.batch["effective"], per_device=trainer.args.per_device_train_batch_size
        )
        print(
            f"\npreempted: {p['signal'] or 'signal'} on rank(s) {p['ranks']}; stopped after step {p['step']} with a "
            f"complete checkpoint {ckpt}.\nresume with:\n  {command}\nexit code {EXIT_PREEMPTED} (preempted)",
            flush=True,
        )
    return EXIT_PREEMPTED


def finish(run: Run, trainer: ResilientTrainer, model, data: Data, trained: Trained, started: float) -> int:
    """The model exported first, then the eval loss and exact match after training, the summary, the
    figures; the sinks closed. An error in any of it reports where the trained weights are
    (finetune/training/after_training.py)."""
    from finetune.training import evaluation, fault_injection
    from finetune.training.after_training import WeightsKept, record_figures

    cfg, record = run.cfg, run.record
    with WeightsKept(trainer, record, run.dir / "model", data.tokenizer) as kept:
        trainer.save_state()  # trainer_state.json in the run directory: log history, step, epoch
        measured = trainer.final_measurements()
        if cfg.run.save_model:
            kept.export()  # adapter for LoRA/QLoRA, full weights otherwise (finetune/modeling/export.py)
        fault_injection.after_training(rank=run.state.process_index, step=trainer.state.global_step)  # drills
        eval_loss = trainer.evaluate()["eval_loss"] if data.bundle.eval is not None else None
        results = dict(trained.exact_match)
        if data.heldout is not None:
            results["after"] = _exact_match(run, trainer, model, data, "after")
        collapsed = trainer.collapse.error(trainer.skipped_steps)  # training.on_collapse: flag
        if record:
            record.update(
                "summary",
                eval_loss=eval_loss,
                steps=trainer.state.global_step,
                train_s=round(trained.train_s, 2),
                wall_s=round(time.perf_counter() - started, 2),
                status="failed" if collapsed else "completed",
                nonfinite_skipped=trainer.skipped_steps,
            )
            record_figures(record, measured, model, cfg, world=run.launch.world_size, train_loss=trained.train_loss)
            if results:
                record.set("eval", evaluation.section(results, run.heldout_path))
        if collapsed:
            raise collapsed  # main() records the error and exits 3
    if record:
        run.sinks.close(record.view, 0)
    return 0


# --- helpers ---------------------------------------------------------------------------------------------


def _write_demo_data(run: Run) -> None:
    """The demo recipe's data, generated into the run directory (a resumed run keeps its own)."""
    from finetune.data import demo

    train_file = Path(run.data_path)
    if run.state.is_main_process and not (run.resume and train_file.is_file()):
        demo.write_demo(train_file.parent, run.cfg.data.demo_train_size, run.cfg.data.demo_heldout_size)
    run.state.wait_for_everyone()


def _exact_match(run: Run, trainer: ResilientTrainer, model, data: Data, stage: str) -> dict:
    """Exact match on the held-out rows, sharded over the ranks; `before` gathers ZeRO-3 shards first."""
    from finetune.modeling import zero3
    from finetune.training import evaluation

    cfg = run.cfg
    with zero3.full_parameters(model) if stage == "before" else contextlib.nullcontext():
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
        )  # reduce() across ranks: an Accelerator, not PartialState
    if run.state.is_main_process:
        log.info(
            "exact match %s training: %.1f%% (%d/%d)",
            stage,
            100 * result["exact_match"],
            result["correct"],
            result["total"],
        )
    return result


def _announce_op_builds(ops: list[str]) -> None:
    """Rank 0 says which DeepSpeed ops are about to be compiled (finetune/launch/op_builds.py)."""
    import os

    from finetune.launch import op_builds

    line = op_builds.announce(ops)
    if line and os.environ.get("RANK", "0") == "0":
        print(f"[finetune] {line}", file=sys.stderr, flush=True)


def _setup_logging(level: str, main_process: bool) -> None:
    import transformers

    logging.basicConfig(
        format="[%(asctime)s %(name)s] %(message)s",
        datefmt="%H:%M:%S",
        level=getattr(logging, level.upper()) if main_process else logging.WARNING,
    )
    transformers.logging.set_verbosity_warning()
