"""Fine-tune a causal LM from a recipe. The strategy is whatever the accelerate config launches:

    accelerate launch finetune/train.py --recipe demo
    accelerate launch --config_file accelerate_configs/zero2.yaml finetune/train.py --recipe zero2 \
        --training.max_steps=100

Wiring only: config -> run directory -> tokenizer, data -> model -> Trainer -> run record.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script by `accelerate launch finetune/train.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from finetune.cli_support import parse_train_args  # noqa: E402
from finetune.errors import EXIT_PREEMPTED, exit_on_user_error  # noqa: E402

log = logging.getLogger("finetune")


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_train_args(argv)
    from finetune.recipe import load_recipe

    cfg, _ = load_recipe(args.recipe, overrides)  # validated before anything heavy happens
    cfg.run.overwrite = cfg.run.overwrite or args.overwrite

    from datetime import timedelta

    from accelerate import PartialState

    from finetune import cpu_distributed, demo_data, preflight, record, resume, rundir
    from finetune.distributed import run_on_main

    # The collective timeout must reach the first init_process_group (this one; DeepSpeed's
    # init_distributed gets it through Accelerate): a rank that stalls ends the run after it.
    state = PartialState(cpu=cpu_distributed.requested(),  # opt-in CPU/gloo runs: finetune/cpu_distributed.py
                         timeout=timedelta(seconds=cfg.training.args["ddp_timeout"]))
    # world size, launch config vs recipe, data, run dir: all at once, before any weights load
    preflight.check_before_loading(cfg, state, resume=args.resume)
    _setup_logging(cfg.logging.log_level, state.is_main_process)

    # Every rank must agree on the run directory; rank 0 names and creates it.
    def make_run_dir():
        name = cfg.run.name or rundir.default_run_name(cfg.recipe)
        path = rundir.resolve_run_dir(name, cfg.run.output_dir)
        if args.resume:  # the run directory is reused as it is (finetune/resume.py)
            return name, str(path), str(resume.prepare(path, args.resume, overwrite=cfg.run.overwrite))
        rundir.prepare_run_dir(path, overwrite=cfg.run.overwrite)
        return name, str(path), None

    cfg.run.name, run_path, resume_ckpt = run_on_main(state, make_run_dir)
    run_dir = Path(run_path)
    cfg.run.output_dir = str(run_dir)
    rec = record.RunRecord(run_dir / "run.json", run_name=cfg.run.name, recipe=cfg.recipe,
                           config=cfg.to_dict()) if state.is_main_process else None
    if rec and resume_ckpt:
        resume.continue_record(rec, run_dir, Path(resume_ckpt))
        log.info("resuming from %s (step %d)", resume_ckpt, rec["summary"]["resumed_at_step"])
    if rec:
        saved = (resume.save_config if resume_ckpt else rundir.save_resolved_config)(run_dir, cfg.to_dict())
        log.info("resolved configuration (defaults < recipe < command line), saved to %s:\n%s",
                 saved, saved.read_text(encoding="utf-8").rstrip())
        rec.write()

    if cfg.data.path == "demo":
        train_file = run_dir / "data" / "train.jsonl"
        if state.is_main_process and not (resume_ckpt and train_file.is_file()):  # resume: keep the run's data
            demo_data.write_demo(train_file.parent, cfg.data.demo_train_size, cfg.data.demo_heldout_size)
        state.wait_for_everyone()
        cfg.data.path = str(train_file)
        if cfg.eval.heldout_path == "demo":
            cfg.eval.heldout_path = str(train_file.parent / "heldout.jsonl")

    from finetune.resilience import NonFiniteError, install_signal_handlers

    install_signal_handlers()  # SIGTERM/SIGINT -> checkpoint and exit 75 (finetune/resilience.py)
    try:
        return _train(cfg, state, run_dir, rec, resume_ckpt)
    except NonFiniteError as e:  # every rank agreed; a clear message, not a traceback (docs/faults.md)
        if rec:
            rec["summary"].update(status="failed", error=f"{type(e).__name__}: {e}", nonfinite_skipped=e.skipped)
            rec.write()
            print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except BaseException as e:  # the record must say how the run ended, then the error goes on
        if rec:
            interrupted = isinstance(e, KeyboardInterrupt)
            rec["summary"]["status"] = "interrupted" if interrupted else "failed"
            rec["summary"]["error"] = None if interrupted else f"{type(e).__name__}: {e}"
            rec.write()
            wandb = sys.modules.get("wandb")
            if wandb is not None and wandb.run is not None:
                wandb.run.finish(exit_code=1)
        raise


def _train(cfg, state, run_dir: Path, rec, resume_ckpt: str | None = None) -> int:
    from transformers import TrainingArguments

    from finetune import batch, cpu_distributed, data, evaluation, export, model as model_lib, sharded, strategy
    from finetune import wandb_logging

    t0 = time.perf_counter()
    targs = cpu_distributed.training_overrides(dict(cfg.training.args))
    save_total_limit = targs.pop("save_total_limit", None)  # rotated after a checkpoint is complete: finetune/checkpoints.py
    # Applied by finetune/model.py before the LoRA wrap (transformers 5.23 renamed the option).
    gradient_checkpointing = bool(targs.pop("gradient_checkpointing", False)) | bool(
        targs.pop("activation_checkpointing", False))
    report_to = cfg.logging.report_to or "none"
    use_wandb = wandb_logging.enabled(cfg.logging.report_to)
    if use_wandb:  # before Trainer builds its callbacks: they read W&B's environment
        wandb_logging.configure_environment(cfg.logging.wandb_project, run_dir)
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

    from finetune import speed

    speed.check(cfg)  # packing/padding-free vs attention implementation, Liger on this machine
    tokenizer = model_lib.load_tokenizer(cfg.model)
    bundle = data.build_datasets(cfg.data, tokenizer, seed=args.seed)
    heldout_rows = data.read_rows(cfg.eval.heldout_path)[: cfg.eval.samples] if cfg.eval.exact_match else None

    from transformers import set_seed

    set_seed(args.seed)  # LoRA init must not depend on what the strategy's setup drew from the RNG before
    model = model_lib.load_model(cfg.model, cfg.method, gradient_checkpointing=gradient_checkpointing)
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

    from finetune.resilience import ResilientTrainer

    trainer = ResilientTrainer(
        model=model, args=args, train_dataset=bundle.train, eval_dataset=bundle.eval,
        data_collator=speed.make_collator(cfg.data, cfg.model, tokenizer.pad_token_id),
        processing_class=tokenizer, record=rec, **_mfu_inputs(model.config, cfg.method.name),
        save_total_limit=save_total_limit, on_nonfinite=cfg.training.on_nonfinite,
        max_nonfinite_skips=cfg.training.max_nonfinite_skips)
    engaged = strategy.engaged(trainer.accelerator.state, method=cfg.method.name,
                               mixed_precision=trainer.accelerator.mixed_precision)
    strategy.check_expected(cfg.run.strategy, engaged, cfg.recipe, cfg.run.offload)
    strategy.live_check(trainer, expected=cfg.run.strategy, expected_offload=cfg.run.offload,
                        recipe=cfg.recipe, record=rec)  # the wrapped engine, before the first step

    if rec:
        rec["strategy"] = engaged
        rec["batch"] = {"per_device": args.per_device_train_batch_size,
                        "grad_accum": args.gradient_accumulation_steps, "data_parallel_size": world,
                        "effective": effective, "input_tokens_per_step": None, "trained_tokens_per_step": None}
        rec["lr"] = lr
        rec["faults"] = {"collective_timeout_s": args.ddp_timeout, "on_nonfinite": cfg.training.on_nonfinite,
                         "max_nonfinite_skips": cfg.training.max_nonfinite_skips,
                         "save_total_limit": save_total_limit}  # docs/faults.md
        rec["data"] = vars(bundle.stats) | {"rows_skipped": bundle.stats.rows_skipped[:50]}
        rec["parameters"] = {"trainable": trainable, "total": total}
        # memory prediction for the engaged strategy (finetune/plan_memory.py); its error is filled at the end
        from finetune import plan_memory

        plan_memory.record_prediction(rec, model.config, cfg, gradient_checkpointing=gradient_checkpointing,
                                      weight_bytes=model_lib.resolve_dtype(cfg.model.dtype).itemsize,
                                      train_dataset=bundle.train)
        rec.write()
        log.info("world size %d | per-device batch %d x accumulation %d x %d = effective batch %d | "
                 "lr %.3g (%s scaling, factor %.3g) | trainable %s of %s parameters | max length %d",
                 world, args.per_device_train_batch_size, args.gradient_accumulation_steps, world, effective,
                 lr["applied"], lr["rule"], lr["factor"], f"{trainable:,}", f"{total:,}", cfg.data.max_length)

    wandb_run = wandb_logging.start(rec.data, project=cfg.logging.wandb_project, run_dir=run_dir) \
        if use_wandb and rec else None  # transformers' WandbCallback logs the steps into this run
    results = {}
    if heldout_rows is not None and cfg.eval.before:
        with sharded.full_parameters(model):  # ZeRO-3 loads straight into shards (finetune/sharded.py)
            results["before"] = evaluate("before")
    train_start = time.perf_counter()
    out = trainer.train(resume_from_checkpoint=resume_ckpt)
    train_s = time.perf_counter() - train_start
    if trainer.resilience.preempted:  # every rank agreed to stop; the checkpoint is complete
        return _preempted(trainer, rec, run_dir)
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
        rec["summary"].update(train_loss=out.training_loss, eval_loss=eval_loss, steps=trainer.state.global_step,
                              total_trained_tokens=sum(measured["trained_tokens"]),
                              total_input_tokens=sum(measured["input_tokens"]),
                              train_s=round(train_s, 2), wall_s=round(time.perf_counter() - t0, 2),
                              status="completed", nonfinite_skipped=trainer.skipped_steps)
        record_measurements(rec, measured, model_config=model.config, method=cfg.method.name,
                            world_size=world, warmup=cfg.training.throughput_warmup_steps)
        plan_memory.record_error(rec)
        if results:
            rec["eval"] = {"metric": "exact_match", "heldout_path": cfg.eval.heldout_path,
                           **{f"exact_match_{k}": v["exact_match"] for k, v in results.items()},
                           "details": results}
        rec.write()
        if wandb_run is not None:
            wandb_logging.finish(wandb_run, rec.data, [rec.path, run_dir / "config.yaml",
                                                       *wandb_logging.launch_config_files()])
        _print_summary(rec, run_dir, model_dir if cfg.run.save_model else None, cfg.method.name)
    return 0


def _preempted(trainer, rec, run_dir: Path) -> int:
    """Status `interrupted`, the resume command, and an exit code that says preempted."""
    from finetune import resilience

    p = trainer.resilience.preempted
    ckpt = trainer.resilience.last_complete
    if rec:
        rec["summary"].update(status="interrupted", steps=trainer.state.global_step, checkpoint=str(ckpt),
                              error=f"preempted by {p['signal'] or 'a signal'} on rank(s) {p['ranks']} "
                                    f"at step {p['step']}",
                              nonfinite_skipped=trainer.skipped_steps)
        rec.write()
        print(f"\npreempted: {p['signal'] or 'signal'} on rank(s) {p['ranks']}; stopped after step {p['step']} with a "
              f"complete checkpoint {ckpt}.\nresume with:\n  {resilience.resume_command(run_dir)}\n"
              f"exit code {EXIT_PREEMPTED} (preempted)", flush=True)
    return EXIT_PREEMPTED


def _mfu_inputs(model_config, method: str) -> dict:
    """What FinetuneTrainer needs for MFU at each log: FLOPs per token for a mean sequence length,
    and the device's peak (None off the table, so no MFU is shown rather than a guess)."""
    import torch

    from finetune import metrics

    peak = metrics.peak_flops(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    return {"flops_per_token": lambda seq_len: metrics.flops_per_token(model_config, method, seq_len)[0],
            "peak_flops": peak[1] if peak else None}


def record_measurements(rec, measured: dict, *, model_config, method: str, world_size: int, warmup: int) -> None:
    """Fill run.json's memory, throughput and per-step token figures from the trainer's measurements."""
    from finetune import metrics

    steps = len(measured["step_s"])
    rec["memory"] = measured["memory"]
    seq_len = sum(measured["input_tokens"]) / max(sum(measured["samples"]), 1)
    flops, convention = metrics.flops_per_token(model_config, method, seq_len)
    hw = rec["hardware"]
    peak = metrics.peak_flops(hw["device_name"]) if hw["device_type"] == "cuda" else None
    tp = metrics.throughput(measured["step_s"], measured["trained_tokens"], measured["input_tokens"],
                            measured["samples"], world_size=world_size, warmup=warmup, flops_token=flops,
                            peak=peak[1] if peak else None, devices=world_size)
    tp.update(flops_convention=convention, flops_per_token=flops, peak_device=peak[0] if peak else None,
              mfu_note=None if peak else f"no MFU: {hw['device_name']!r} is not in the peak-FLOPS table")
    rec["throughput"] = tp
    rec["batch"].update(input_tokens_per_step=round(sum(measured["input_tokens"]) / max(steps, 1), 1),
                        trained_tokens_per_step=round(sum(measured["trained_tokens"]) / max(steps, 1), 1))


def _print_summary(rec, run_dir: Path, model_dir: Path | None, method: str) -> None:
    """The end-of-run table: what was trained, how fast, how much memory, what it changed."""
    s, b = rec["summary"], rec["batch"]
    tp, mem = rec["throughput"] or {}, (rec["memory"] or {}).get("max") or {}
    rows = [("steps", f"{s['steps']} (effective batch {b['effective']} = {b['per_device']} per device x "
                      f"{b['grad_accum']} accumulation x {b['data_parallel_size']} ranks)"),
            ("strategy", f"{rec['strategy']['name']} ({rec['strategy']['distributed_type']}), {method}"),
            ("learning rate", f"{rec['lr']['applied']:.3g} ({rec['lr']['rule']} scaling, factor {rec['lr']['factor']:.3g})"),
            ("train loss", f"{s['train_loss']:.4f}" + (f", eval loss {s['eval_loss']:.4f}" if s.get("eval_loss") else "")),
            ("trained tokens", f"{s['total_trained_tokens']:,} of {s['total_input_tokens']:,} input tokens")]
    if tp.get("trained_tokens_per_s") is not None:
        rows.append(("throughput", f"{tp['trained_tokens_per_s']:,.1f} trained tokens/s, {tp['input_tokens_per_s']:,.1f} "
                                   f"input tokens/s, median step {tp['median_step_s']:.2f} s (first "
                                   f"{tp['warmup_steps_excluded']} step(s) excluded)"))
        rows.append(("MFU", f"{100 * tp['mfu']:.1f}% of {tp['peak_device']}" if tp.get("mfu") is not None
                     else "n/a (" + (tp.get("mfu_note") or "no peak figure") + ")"))
    device = mem.get("device_peak_allocated_gib")
    rows.append(("peak memory", (f"device {device:.2f} GiB allocated, " if device is not None else "")
                 + f"host RSS {mem.get('host_peak_rss_gib') or 0:.2f} GiB (max over ranks)"))
    ev = rec["eval"]
    if "exact_match_after" in ev:
        before = ev.get("exact_match_before")
        rows.append(("exact match", (f"{100 * before:.1f}% -> " if before is not None else "")
                     + f"{100 * ev['exact_match_after']:.1f}% on {ev['details']['after']['total']} held-out prompts"))
        per_task = ev["details"]["after"]["per_task"]
        if len(per_task) > 1:
            pre = ev["details"].get("before", {}).get("per_task", {})
            rows.append(("  per task", ", ".join(f"{t} {100 * pre[t]:.0f}->{100 * v:.0f}%" if t in pre
                                                else f"{t} {100 * v:.0f}%" for t, v in per_task.items())))
    rows.append(("wall time", f"{s['wall_s']:.0f} s (training {s['train_s']:.0f} s)"))
    rows.append(("run directory", f"{run_dir}   (run.json, config.yaml)"))
    if model_dir:
        rows.append(("LoRA adapter" if method in ("lora", "qlora") else "model", str(model_dir)))
    width = max(len(k) for k, _ in rows)
    lines = ["", "=" * 78, f"run {rec['run_name']} completed"] + [f"  {k:<{width}}  {v}" for k, v in rows] + ["=" * 78]
    print("\n".join(lines), flush=True)


def _setup_logging(level: str, main_process: bool) -> None:
    import transformers

    logging.basicConfig(format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S",
                        level=getattr(logging, level.upper()) if main_process else logging.WARNING)
    transformers.logging.set_verbosity_warning()


if __name__ == "__main__":
    sys.exit(main())
