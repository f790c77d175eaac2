"""One training run, what finetune/train.py (the launch script) runs in every process:

    accelerate launch finetune/train.py --recipe zero2          # the recipe sets up ZeRO-2 itself
    accelerate launch --config_file accelerate_configs/zero2.yaml finetune/train.py --recipe zero2

Wiring only: config -> run directory -> tokenizer, data -> model -> Trainer -> run record.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from finetune.errors import EXIT_PREEMPTED, exit_on_user_error
from finetune.launch.script_args import parse_train_args

log = logging.getLogger("finetune")


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_train_args(argv)
    from finetune.config.recipe import load_recipe

    cfg, _ = load_recipe(args.recipe, overrides)  # validated before anything heavy happens
    cfg.run.overwrite = cfg.run.overwrite or args.overwrite

    from datetime import timedelta

    from accelerate import PartialState

    from finetune.data import demo
    from finetune.launch import preflight, rundir
    from finetune.launch import setup as launch_setup
    from finetune.launch.ranks import close_process_group_at_exit, run_on_main
    from finetune.telemetry import record
    from finetune.training import resume

    # Who sets up the strategy: the launcher's accelerate config, or the recipe from inside this
    # script (finetune/launch/setup.py); the latter prepares the environment before PartialState.
    setup = launch_setup.detect(cfg)
    launch_setup.prepare(setup)
    # The collective timeout must reach the first init_process_group (this one; DeepSpeed's
    # init_distributed gets it through Accelerate): a rank that stalls ends the run after it.
    state = PartialState(cpu=setup.cpu_gloo is not None,  # CPU/gloo runs: finetune/launch/cpu_rehearsal.py
                         timeout=timedelta(seconds=cfg.training.args["ddp_timeout"]))
    launch_setup.adopt_deepspeed_comm(setup)
    finished = close_process_group_at_exit(state)  # before the interpreter exits (finetune/launch/ranks.py)
    plan = None
    if args.resume:  # before preflight: the plan sets the accumulation and strategy the checks see
        from finetune.training import resume_plan

        facts = preflight.launch_facts(state, setup)  # what this launch sets up (launcher config or recipe)
        name, planned_dir, plan = run_on_main(state, lambda: resume_plan.for_launch(cfg, facts, args.resume, overrides))
        resume_plan.apply(plan, cfg)
    # world size, launch config vs recipe, data, run dir: all at once, before any weights load
    preflight.check_before_loading(cfg, state, setup=setup, resume=args.resume)
    _setup_logging(cfg.logging.log_level, state.is_main_process)
    if state.is_main_process:
        log.info("%s", setup.describe())

    # Every rank must agree on the run directory; rank 0 names and creates it.
    def make_run_dir():
        if plan:  # the run directory is reused as it is (finetune/training/resume.py)
            planned_dir.mkdir(parents=True, exist_ok=True)  # --resume=PATH into a new run directory
            return name, str(planned_dir), plan.checkpoint
        name_ = cfg.run.name or rundir.default_run_name(cfg.recipe)
        path = rundir.resolve_run_dir(name_, cfg.run.output_dir)
        rundir.prepare_run_dir(path, overwrite=cfg.run.overwrite,
                               name_given_by="--run.output_dir" if cfg.run.output_dir else "--run.name")
        return name_, str(path), None

    cfg.run.name, run_path, resume_ckpt = run_on_main(state, make_run_dir)
    run_dir = Path(run_path)
    cfg.run.output_dir = str(run_dir)
    rec = record.RunRecord(run_dir / "run.json", run_name=cfg.run.name, recipe=cfg.recipe,
                           config=cfg.to_dict()) if state.is_main_process else None
    if rec and resume_ckpt:
        resume.continue_record(rec, run_dir, Path(resume_ckpt), plan)
        # said loudly when the layout changes (accumulation recomputed, states resharded)
        (log.warning if plan.reshard != "none" or plan.layout_changed else log.info)(resume_plan.describe(plan))
    # A resumed run replaces run.json and writes config.resume<n>.yaml only once its data is checked
    # (_train): a resume refused there leaves the run directory as it was.
    committed: list[bool] = []

    def commit() -> None:
        committed.append(True)
        if rec:
            if resume_ckpt:
                resume.keep_previous_record(run_dir)
            saved = (resume.save_config if resume_ckpt else rundir.save_resolved_config)(run_dir, cfg.to_dict())
            log.info("resolved configuration (defaults < recipe < command line), saved to %s:\n%s",
                     saved, saved.read_text(encoding="utf-8").rstrip())
            rec.write()

    if not resume_ckpt:
        commit()

    if cfg.data.path == "demo":
        train_file = run_dir / "data" / "train.jsonl"
        if state.is_main_process and not (resume_ckpt and train_file.is_file()):  # resume: keep the run's data
            demo.write_demo(train_file.parent, cfg.data.demo_train_size, cfg.data.demo_heldout_size)
        state.wait_for_everyone()
        cfg.data.path = str(train_file)
        if cfg.eval.heldout_path == "demo":
            cfg.eval.heldout_path = str(train_file.parent / "heldout.jsonl")

    from finetune.training.guards import NonFiniteError
    from finetune.training.signals import install_signal_handlers

    install_signal_handlers()  # SIGTERM/SIGINT -> checkpoint and exit 75 (finetune/training/guards.py)
    try:
        code = _train(cfg, state, run_dir, rec, setup, resume_ckpt, plan, commit)
        finished.append(True)  # every rank returns here together (completed or preempted)
        return code
    except NonFiniteError as e:  # every rank agreed; a clear message, not a traceback (docs/faults.md)
        if rec and committed:
            rec.update("summary", status="failed", error=f"{type(e).__name__}: {e}", nonfinite_skipped=e.skipped)
            rec.write()
            print(f"error: {e}", file=sys.stderr, flush=True)
        finished.append(True)
        return e.exit_code
    except BaseException as e:  # the record must say how the run ended, then the error goes on
        from finetune.launch import nodes

        lost = nodes.failure_note(e)  # the ranks (and nodes) that are gone, when that is why
        if rec and committed:
            interrupted = isinstance(e, KeyboardInterrupt)
            rec.update("summary", status="interrupted" if interrupted else "failed",
                       error=None if interrupted else f"{lost + '; ' if lost else ''}{type(e).__name__}: {e}")
            rec.write()
            wandb = sys.modules.get("wandb")
            if wandb is not None and wandb.run is not None:
                wandb.run.finish(exit_code=1)
        raise


def _train(cfg, state, run_dir: Path, rec, setup, resume_ckpt: str | None = None, plan=None, commit=None) -> int:
    from transformers import TrainingArguments

    from finetune.data import build, read
    from finetune.launch import cpu_rehearsal
    from finetune.modeling import export, zero3
    from finetune.modeling import load as model_lib
    from finetune.telemetry import meter, wandb_logging
    from finetune.training import batch, checkpoint_facts, engaged, evaluation, resume, universal

    t0 = time.perf_counter()
    targs = cpu_rehearsal.training_overrides(dict(cfg.training.args), active=setup.cpu_gloo is not None)
    # The recipe's strategy engaged here (deepspeed= / fsdp=, fsdp_config=): before from_pretrained,
    # so ZeRO-3 loads straight into shards (transformers' zero.Init weak-ref is set by TrainingArguments).
    targs.update(setup.trainer_arguments)
    # The precision policy (finetune/precision.py, docs/precision.md), `auto` resolved as preflight did,
    # for the strategy this process sets up (the launcher's config or the recipe's row).
    from finetune.launch import precision_checks, preflight
    from finetune.training import precision_live

    facts = preflight.launch_facts(state, setup)
    policy, family = precision_checks.resolve_policy(cfg, facts), precision_checks.family(facts)
    targs.update(policy.training_args(family))
    if (targs["bf16"] or targs["fp16"]) and not precision_checks.runs_on_cuda(cfg, facts):
        targs["use_cpu"] = True  # TrainingArguments accepts bf16 without CUDA only with use_cpu (CPU autocast)
    save_total_limit = targs.pop("save_total_limit", None)  # rotated after a checkpoint is complete: finetune/training/checkpoints.py
    # Applied by finetune/modeling/load.py before the LoRA wrap (transformers 5.23 renamed the option).
    gradient_checkpointing = bool(targs.pop("gradient_checkpointing", False)) | bool(
        targs.pop("activation_checkpointing", False))
    report_to = cfg.logging.report_to or "none"
    use_wandb = wandb_logging.enabled(cfg.logging.report_to)
    if use_wandb:  # before Trainer builds its callbacks: they read W&B's environment
        wandb_logging.configure_environment(cfg.logging.wandb_project, run_dir)
    from finetune.training import speed

    targs = speed.trainer_overrides(targs)  # Liger's fused loss is training.loss_impl's, not Trainer's patch
    try:
        args = TrainingArguments(output_dir=str(run_dir), run_name=cfg.run.name, report_to=report_to, **targs)
    except (ValueError, TypeError) as e:
        from finetune.errors import ConfigError

        raise ConfigError([f"training: {e}"], "TrainingArguments") from None

    world = args.world_size
    effective = batch.effective_batch(args.per_device_train_batch_size, args.gradient_accumulation_steps, world)
    lr = batch.lr_scaling(args.learning_rate, cfg.training.lr_scaling, effective,
                          cfg.training.lr_reference_batch_size)
    args.learning_rate = lr["applied"]  # the optimizer is built from this value

    from finetune.data import collate, rows as data_rows
    from finetune.modeling import attention
    from finetune.modeling import loss as loss_lib

    speed.check(cfg)  # packing/padding-free vs attention implementation, Liger on this machine
    # Process-global SDPA flags, on every rank before the first forward (training, evaluation, generate).
    attention_record = attention.apply(cfg.model.sdpa_backends, args.device.type, cfg.model.attn_implementation)
    tokenizer = model_lib.load_tokenizer(cfg.model)
    bundle = build.build_datasets(cfg.data, tokenizer, seed=args.seed)
    fingerprint = checkpoint_facts.data_fingerprint(bundle.train)  # the rows, in order (checkpoint markers)
    if plan:  # the same rows as the checkpoint's, before the model loads
        from finetune.training.resume_plan import check_data

        check_data(plan, rows=len(bundle.train), fingerprint=fingerprint)
        commit()  # the continued record replaces run.json from here on
    universal_dir = universal.for_resume(state, plan, rec)  # DeepSpeed under another world size
    heldout_rows = read.read_rows(cfg.eval.heldout_path)[: cfg.eval.samples] if cfg.eval.exact_match else None

    from transformers import set_seed

    set_seed(args.seed)  # LoRA init must not depend on what the strategy's setup drew from the RNG before
    model = model_lib.load_model(cfg.model, cfg.method, gradient_checkpointing=gradient_checkpointing,
                                 policy=policy, deepspeed=family == "deepspeed")
    if family == "deepspeed":  # zero.Init's dtype trap: the module must be in the policy's dtype for DeepSpeed
        from finetune.precision import torch_dtype

        zero3.check_init_dtype(model, torch_dtype(policy.module_dtype(cfg.method.name, family)))
    loss_lib.install(model, cfg.training.loss_impl, chunk=cfg.training.loss_chunk_tokens,
                     label_smoothing=args.label_smoothing_factor, use_liger_kernel=args.use_liger_kernel,
                     device_type=args.device.type,  # before Trainer wraps the model (finetune/modeling/loss.py)
                     tokens=args.per_device_train_batch_size  # a micro-batch's most positions, bucketing included
                     * data_rows.longest_row(args.per_device_train_batch_size, cfg.data.max_length, cfg.data))
    trainable, total = model_lib.count_parameters(model)

    def evaluate(stage: str) -> dict:
        result = evaluation.exact_match(
            model, tokenizer, heldout_rows, system_prompt=cfg.data.system_prompt,
            use_chat_template=cfg.data.chat_template, max_new_tokens=cfg.eval.max_new_tokens,
            batch_size=cfg.eval.batch_size, source=cfg.eval.heldout_path,
            accelerator=trainer.accelerator)  # reduce() across ranks: an Accelerator, not PartialState
        if state.is_main_process:
            log.info("exact match %s training: %.1f%% (%d/%d)", stage, 100 * result["exact_match"],
                     result["correct"], result["total"])
        return result

    from finetune.training.guards import ResilientTrainer

    trainer = ResilientTrainer(
        model=model, args=args, train_dataset=bundle.train, eval_dataset=bundle.eval,
        data_collator=collate.make_collator(cfg.data, cfg.model, tokenizer.pad_token_id),
        processing_class=tokenizer, record=rec, **meter.mfu_inputs(model, cfg.method.name),
        save_total_limit=save_total_limit, on_nonfinite=cfg.training.on_nonfinite,
        max_nonfinite_skips=cfg.training.max_nonfinite_skips)
    trainer.resumed_world_size = plan.written["world_size"] if plan else None  # RNG streams: training/rng.py
    from finetune.launch import nodes

    nodes.install(trainer, rec, state)  # run.json `nodes`: machines, ranks, partitions, host peaks per node
    if universal_dir:
        universal.enable_loading(trainer)
    strategy_section = engaged.engaged(trainer.accelerator.state, method=cfg.method.name, setup=setup)
    engaged.check_expected(cfg.run.strategy, strategy_section, cfg.recipe, cfg.run.offload)
    engaged.live_check(trainer, expected=cfg.run.strategy, expected_offload=cfg.run.offload,
                       recipe=cfg.recipe, record=rec)  # the wrapped engine, before the first step
    precision_live.apply(trainer, policy)  # FSDP2 MixedPrecisionPolicy, DeepSpeed keys: read by prepare
    load_dtype = policy.load_dtype(cfg.method.name)
    precision_live.install(trainer, policy, requested=cfg.training.precision, family=family, method=cfg.method.name,
                           load_dtype=load_dtype, learning_rate=lr["applied"], record=rec)  # before step 1

    if rec:
        rec.set("strategy", strategy_section)
        # What the policy declares; the live fields are filled at on_train_begin (precision_live.install).
        rec.set("precision", {"policy": policy.name, "requested": cfg.training.precision, "family": family,
                              "load_dtype": load_dtype, "param_dtype": None, "compute_dtype": None,
                              "optimizer_state_dtype": None, "master_weights": None, "reduce_dtype": None,
                              "observed_compute_dtype": None, "warning": None, "evidence": None})
        rec.set("batch", {"per_device": args.per_device_train_batch_size,
                          "grad_accum": args.gradient_accumulation_steps, "data_parallel_size": world,
                          "effective": effective, "input_tokens_per_step": None, "trained_tokens_per_step": None})
        rec.set("lr", lr)
        if not resume_ckpt:
            resume.first_segment(rec)
        static = checkpoint_facts.static_facts(cfg, train_rows=len(bundle.train), fingerprint=fingerprint)
        trainer.resilience.run_facts = lambda: checkpoint_facts.run_block(
            rec.view.get("strategy"), rec.view.get("batch"), rec.view.get("lr"), static)  # the marker's `run` block
        rec.set("faults", {"collective_timeout_s": args.ddp_timeout, "on_nonfinite": cfg.training.on_nonfinite,
                           "max_nonfinite_skips": cfg.training.max_nonfinite_skips,
                           "save_total_limit": save_total_limit})  # docs/faults.md
        rec.set("data", vars(bundle.stats) | {"rows_skipped": bundle.stats.rows_skipped[:50]})
        rec.set("parameters", {"trainable": trainable, "total": total})
        rec.set("speed", speed.section(cfg, model, trainer, attention_record=attention_record,
                                       loss_record=loss_lib.installed(model)))
        # memory prediction for the engaged strategy (finetune/planning/prediction.py); its error is filled at the end
        from finetune.planning import prediction

        prediction.record_prediction(rec, model.config, cfg, gradient_checkpointing=gradient_checkpointing,
                                     precision=policy.name, train_dataset=bundle.train)
        rec.write()
        log.info("world size %d | per-device batch %d x accumulation %d x %d = effective batch %d | "
                 "lr %.3g (%s scaling, factor %.3g) | trainable %s of %s parameters | max length %d | precision %s",
                 world, args.per_device_train_batch_size, args.gradient_accumulation_steps, world, effective,
                 lr["applied"], lr["rule"], lr["factor"], f"{trainable:,}", f"{total:,}", cfg.data.max_length,
                 f"{policy.name} ({policy.summary})")

    wandb_run = wandb_logging.start(rec.view, project=cfg.logging.wandb_project, run_dir=run_dir) \
        if use_wandb and rec else None  # transformers' WandbCallback logs the steps into this run
    results = {}
    if heldout_rows is not None and cfg.eval.before:
        with zero3.full_parameters(model):  # ZeRO-3 loads straight into shards (finetune/modeling/zero3.py)
            results["before"] = evaluate("before")
    if plan:  # never saved into by this run: finetune/training/checkpoints.py move_aside_newer
        from finetune.launch.ranks import run_on_main
        from finetune.training import checkpoints

        moved = run_on_main(state, lambda: checkpoints.move_aside_newer(run_dir, plan.step))
        if rec:
            resume.note_segment(rec, superseded=[new for _, new in moved])
            rec.write()
    train_start = time.perf_counter()
    out = trainer.train(resume_from_checkpoint=universal_dir or resume_ckpt)
    train_s = time.perf_counter() - train_start
    if trainer.resilience.preempted:  # every rank agreed to stop; the checkpoint is complete
        return _preempted(trainer, rec, run_dir, effective)
    trainer.save_state()  # trainer_state.json in the run directory: log history, step, epoch
    measured = trainer.final_measurements()
    eval_loss = trainer.evaluate()["eval_loss"] if bundle.eval is not None else None
    if heldout_rows is not None:
        results["after"] = evaluate("after")

    model_dir = run_dir / "model"
    if cfg.run.save_model:
        export.save_final_model(trainer, model_dir)  # adapter for LoRA/QLoRA, full weights otherwise
        if state.is_main_process:
            tokenizer.save_pretrained(str(model_dir))
    if rec:
        rec.update("summary", eval_loss=eval_loss, steps=trainer.state.global_step, train_s=round(train_s, 2),
                   wall_s=round(time.perf_counter() - t0, 2), status="completed",
                   nonfinite_skipped=trainer.skipped_steps)
        from finetune.training.run_figures import record_figures

        record_figures(rec, measured, model, cfg, world=world, train_loss=out.training_loss)
        if results:
            rec.set("eval", {"metric": "exact_match", "heldout_path": cfg.eval.heldout_path,
                             **{f"exact_match_{k}": v["exact_match"] for k, v in results.items()},
                             "details": results})
        rec.write()
        if wandb_run is not None:
            wandb_logging.finish(wandb_run, rec.view, [rec.path, run_dir / "config.yaml",
                                                       *wandb_logging.launch_config_files()])
        from finetune.telemetry.summary import print_summary

        print_summary(rec.view, run_dir, model_dir if cfg.run.save_model else None, cfg.method.name)
    return 0


def _preempted(trainer, rec, run_dir: Path, effective: int) -> int:
    """Status `interrupted`, the resume command, and an exit code that says preempted."""
    from finetune.training import resume

    p = trainer.resilience.preempted
    ckpt = trainer.resilience.last_complete
    trainer.record_tail()  # steps[] up to the checkpoint's step: the resumed run totals from it
    if rec:
        rec.update("summary", status="interrupted", steps=trainer.state.global_step, checkpoint=str(ckpt),
                   error=f"preempted by {p['signal'] or 'a signal'} on rank(s) {p['ranks']} at step {p['step']}",
                   nonfinite_skipped=trainer.skipped_steps)
        rec.write()
        command = resume.resume_command(run_dir, effective=effective, per_device=trainer.args.per_device_train_batch_size)
        print(f"\npreempted: {p['signal'] or 'signal'} on rank(s) {p['ranks']}; stopped after step {p['step']} with a "
              f"complete checkpoint {ckpt}.\nresume with:\n  {command}\nexit code {EXIT_PREEMPTED} (preempted)", flush=True)
    return EXIT_PREEMPTED


def _setup_logging(level: str, main_process: bool) -> None:
    import transformers

    logging.basicConfig(format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S",
                        level=getattr(logging, level.upper()) if main_process else logging.WARNING)
    transformers.logging.set_verbosity_warning()

