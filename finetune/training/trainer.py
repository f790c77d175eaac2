"""The run's Trainer: transformers.Trainer that measures each step, keeps the record current and
survives faults (preemption signals, complete checkpoints, non-finite losses; docs/faults.md).

FinetuneTrainer feeds the meter (finetune/telemetry/meter.py) from inside the step, before
Trainer hands a log window to its callbacks, so every `report_to` integration receives the extra
keys. ResilientTrainer adds the fault handling: a signal on any rank stops every rank at the same
step boundary after a complete checkpoint; a non-finite loss or gradient norm on any rank is agreed
before that step's optimizer update, then stops (or skips the update).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ProgressCallback

from finetune.checkpointing import checkpoints, rng
from finetune.data.collate import COUNTS_KEY, REAL_TOKENS_KEY
from finetune.data.render import IGNORE_INDEX
from finetune.launch import peers, rank_progress
from finetune.modeling.loss import SCORED_TOKENS_KWARG, installed
from finetune.telemetry.meter import BatchShare, Meter, counting
from finetune.telemetry.sinks import Sinks
from finetune.training import fault_injection, sample_trace, sequence_parallel, signals
from finetune.training.collapse import CollapseWatch
from finetune.training.signals import flags_per_rank, install_signal_handlers
from finetune.training.step_guard import CHECKED, Agreed, NonFiniteError, StepFlags, check_policy

log = logging.getLogger("finetune")


class _StepClock(TrainerCallback):
    """Drives the meter's clock: training begins, each optimizer step begins and ends."""

    def __init__(self, trainer: FinetuneTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        # the model is prepared: the mesh's groups exist, and each rank knows how its batches count
        self.trainer.meter.share = batch_share(self.trainer.model_wrapped, self.trainer.accelerator)
        fault_injection.install_tp_partial_sums(
            self.trainer.model_wrapped, rank=self.trainer.accelerator.process_index, step=self.trainer.next_step
        )
        self.trainer.meter.start_training(self.trainer.accelerator)

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.meter.step_begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.meter.step_end()


class FinetuneTrainer(Trainer):
    def __init__(self, *args, sinks: Sinks | None = None, model_flops=None, peak_flops=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.sinks = sinks  # where each log window goes (finetune/telemetry/sinks.py): rank 0, None elsewhere
        if self.pop_callback(ProgressCallback) is not None:
            self.add_callback(CompactProgress)
        self.meter = Meter(model_flops=model_flops, peak_flops=peak_flops)
        pc = self.accelerator.parallelism_config
        self.sequence_parallel = pc is not None and pc.sp_enabled and pc.sp_backend == "deepspeed"
        if not self.sequence_parallel:  # Ulysses re-cuts the collator's batches: counted on the device there
            self.data_collator = counting(self.data_collator)  # the meter's counts, on the host (train and eval)
        self.add_callback(_StepClock(self))
        # The chunked loss takes its scored-token count from the host (no nonzero() sync per micro-batch);
        # not under torch.compile, which skips the compaction and would recompile for every new count,
        # nor under a mesh (a rank's shard of the positions is not the batch the host counted).
        mesh = pc is not None and (pc.tp_enabled or pc.cp_enabled or pc.sp_enabled)
        self._pass_scored = (
            bool((installed(self.model) or {}).get("compact")) and not self.args.torch_compile and not mesh
        )
        self.resumed_world_size: int | None = None  # world size that wrote the checkpoint resumed from
        self._logged_share = 1.0  # a rank's share of the logged loss (sequence_parallel_loss)
        if self.sequence_parallel:  # sequence_parallel_loss divides by the step's token count itself
            self.loss_is_scaled_for_ga = True
            sequence_parallel.route_skips()

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """Trainer's, with DeepSpeed's sequence-parallel dataloader adapter made a ShardLoader
        (finetune/training/sequence_parallel.py: epochs and mid-epoch resumption)."""
        model, loader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.sequence_parallel:
            loader = sequence_parallel.ShardLoader(loader)
            self.callback_handler.train_dataloader = loader
        return model, loader

    def next_step(self) -> int:
        """The optimizer step being trained, counted from 1 as in run.json's steps[]."""
        return self.state.global_step + 1

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Trainer fetches every batch of an optimizer step here, before on_step_begin (transformers
        5.23 Trainer._run_epoch): outside the step clock, so its time is the data loading of the
        step, measured on its own (the meter's per-window data_loading_s and share of wall time).
        Under sequence parallelism the step's scored tokens are counted here over every rank."""
        t0 = time.perf_counter()
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.sequence_parallel:
            items = sequence_parallel.scored_tokens(batches, device)
        self.meter.data_loading(time.perf_counter() - t0)
        return batches, items

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.sequence_parallel and model.training:
            return self.sequence_parallel_loss(model, inputs, return_outputs, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def sequence_parallel_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """The loss of one sequence shard under Ulysses, such that the step's gradient is the one of
        the token-weighted mean over the whole step (every shard, rank and micro-batch), as without
        sequence parallelism: the shard's summed token losses / the step's scored tokens
        (get_batch_samples), times what DeepSpeed divides the summed gradients by
        (sequence_parallel.gradient_divisor). DeepSpeed's adapter shifted the labels before the split
        (`shift_labels`: the last position of a shard is scored against the next shard's first
        token). transformers' own SP loss (deepspeed_sp_compute_loss) weights each micro-batch
        alone: a mean of means under accumulation or data parallelism."""
        shift = inputs["shift_labels"]
        if fault_injection.late_shift(rank=self.accelerator.process_index, step=self.next_step()):
            shift = shift.clone()
            shift[..., -1] = IGNORE_INDEX  # = the shard's own labels shifted after the split (a control)
        # `labels` for the model's own loss, which reads shift_labels when given (ForCausalLMLoss)
        outputs = model(**{**inputs, "shift_labels": shift, "labels": shift}, num_items_in_batch=num_items_in_batch)
        divisor = sequence_parallel.gradient_divisor(model)
        self._logged_share = divisor / self.accelerator.num_processes  # training_step: Trainer logs the mean
        loss = outputs.loss * divisor
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        sample_trace.record(self, inputs)  # FINETUNE_SAMPLE_TRACE only (tests)
        counts = self.meter.count_batch(inputs)
        if self._pass_scored:
            inputs[SCORED_TOKENS_KWARG] = counts[1]  # trained tokens = the positions the loss scores
        out = super().training_step(model, inputs, num_items_in_batch)
        self.meter.memory.sample()
        if self.sequence_parallel:  # Trainer logs the mean over ranks: each rank's share of the step's loss
            out = out / self._logged_share
        return out

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs.pop(REAL_TOKENS_KEY, None)  # counts for the meter, not model inputs
        counts = inputs.pop(COUNTS_KEY, None)
        if self._pass_scored and counts is not None:
            inputs[SCORED_TOKENS_KWARG] = counts[1]
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        training_log = "loss" in logs and "train_runtime" not in logs
        step_entry = self.meter.log_window(logs, self.accelerator, self.state.global_step) if training_log else None
        super().log(logs, start_time)
        if self.sinks is not None and step_entry is not None:
            self.sinks.log(step_entry)

    def record_tail(self) -> None:
        """The steps after the last log as one more `steps` entry, so steps[] covers every step of
        the launch (a resumed run totals its earlier segments from it). Every rank (it gathers)."""
        tail = self.meter.tail_window(self.accelerator, self.state.global_step)
        if self.sinks is not None and tail is not None:
            self.sinks.log(tail)

    def _load_rng_state(self, checkpoint):
        """Trainer's own restore at the same world size; across a change, the explicit rule of
        finetune/checkpointing/rng.py (Trainer would look for files of its own layout and say nothing)."""
        old = self.resumed_world_size
        if checkpoint is None or old is None or old == self.args.world_size:
            return super()._load_rng_state(checkpoint)
        rng.restore(checkpoint, rank=self.args.process_index, old_world_size=old)

    def final_measurements(self) -> dict:
        """record_tail(), then the per-step series summed over ranks and memory peaks (per rank,
        max). Every rank must call this (it gathers)."""
        self.record_tail()
        return self.meter.final(self.accelerator)


def batch_share(wrapped, accelerator) -> BatchShare:
    """How this rank's micro-batches relate to the other ranks' (finetune/telemetry/meter.py BatchShare),
    from the live groups: tensor- and context-parallel ranks train on the same batch (the group's
    first rank counts it); Ulysses ranks each hold a shard of it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return BatchShare()
    counted, sp_group = True, None
    if any(c.__name__ == "DeepSpeedEngine" for c in type(wrapped).__mro__):
        from deepspeed.utils import groups

        if wrapped.autotp_size() > 1:
            counted = dist.get_rank(group=groups.get_tensor_model_parallel_group()) == 0
        if wrapped.sequence_parallel_size > 1:
            sp_group = groups._get_sequence_parallel_group()
    mesh = getattr(accelerator, "torch_device_mesh", None)
    for dim in ("tp", "cp"):
        if mesh is not None and dim in (mesh.mesh_dim_names or ()):
            counted = counted and mesh[dim].get_local_rank() == 0
    return BatchShare(counted=counted, sp_group=sp_group)


class CompactProgress(ProgressCallback):
    """Trainer's progress bar, with one compact line per log step instead of the raw dict."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not (state.is_world_process_zero and self.training_bar is not None and logs and "loss" in logs):
            return super().on_log(args, state, control, logs=logs, **kwargs)
        parts = [
            f"step {state.global_step}/{state.max_steps}",
            f"loss {logs['loss']:.4f}",
            f"lr {logs.get('learning_rate', 0):.3g}",
        ]
        if logs.get("grad_norm") is not None:
            parts.append(f"gnorm {logs['grad_norm']:.3g}")
        if "perf/trained_tokens_per_s" in logs:
            parts.append(
                f"{logs['perf/trained_tokens_per_s']:,.0f} tok/s ({logs['perf/trained_tokens_per_s_per_device']:,.0f}"
                f"/dev)"
            )
        parts.append(f"{logs['perf/step_s']:.2f} s/step")
        if "perf/mfu" in logs:
            parts.append(f"MFU {100 * logs['perf/mfu']:.1f}%")
        if "memory/max_device_peak_allocated_gib" in logs:
            parts.append(f"dev {logs['memory/max_device_peak_allocated_gib']:.2f} GiB")
        parts.append(f"host {logs.get('memory/max_host_peak_rss_gib', 0):.2f} GiB")
        self.training_bar.write(" | ".join(parts))


# --- faults: signals, complete checkpoints, non-finite guard -------------------------------------


class ResilienceCallback(TrainerCallback):
    def __init__(self, trainer: ResilientTrainer, *, save_total_limit: int | None):
        self.trainer = trainer
        self.save_total_limit = save_total_limit
        self.preempted: dict | None = None  # {step, signal, ranks, relayed_by} once the ranks agreed to stop
        self.nothing_to_train = False  # resumed from a checkpoint of the last step
        self.last_complete: Path | None = None
        self.run_facts = None  # rank 0: () -> the marker's `run` block (finetune/checkpointing/provenance.py)

    # --- signals ---------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        # Resumed from a checkpoint of the last step (a run stopped after training): Trainer would
        # train one step past max_steps before it looks; there is nothing left to train.
        self.nothing_to_train = state.global_step >= state.max_steps > 0
        if self.nothing_to_train:
            log.info("resumed at step %d of %d: nothing left to train", state.global_step, state.max_steps)
            control.should_training_stop = True

    def on_step_begin(self, args, state, control, **kwargs):
        fault_injection.at_step_begin(rank=self.trainer.accelerator.process_index, step=state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        rank_progress.progress(state.global_step)
        flags = self.trainer.agreement_of(state.global_step).signals()  # rode on the step's one agreement
        if any(flags) and self.preempted is None:
            self.preempted = {"step": state.global_step, **signals.describe(flags)}
            control.should_save = True
            control.should_training_stop = True

    def stop_after_training(self, flags: list[int]) -> None:
        """Every rank agreed (`flags`: every rank's signal flag, one non-zero) to stop after Trainer.train()
        returned: a complete checkpoint of the final step, and the run is preempted."""
        with peers.watch.during("the checkpoint of the final step", self.trainer.args.ddp_timeout):
            self.final_checkpoint()
        self.preempted = {"step": self.trainer.state.global_step, **signals.describe(flags)}

    def final_checkpoint(self) -> Path:
        """A complete checkpoint of the final step, on every rank: the one saved at the last step (or
        resumed from) when every rank sees it complete, else saved now (agreed: a rank that cannot see
        it makes every rank save)."""
        trainer = self.trainer
        final = Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"
        missing = checkpoints.problem(final, verify=False) is not None
        if any(flags_per_rank(trainer.accelerator, int(missing))):
            log.warning("saving a checkpoint of the final step: %s", final)
            trainer._save_checkpoint(trainer.model_wrapped, trial=None)
            trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
        self.last_complete = final
        return final

    def on_prediction_step(self, args, state, control, **kwargs):
        peers.watch.progress()  # an evaluation batch done: the watchdog's limit counts from here

    # --- checkpoints -----------------------------------------------------------------------

    def on_save(self, args, state, control, **kwargs):
        acc = self.trainer.accelerator
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        acc.wait_for_everyone()  # every rank's shards are on disk before the marker says so
        error = None
        if acc.is_main_process:
            try:
                checkpoints.write_marker(
                    ckpt,
                    step=state.global_step,
                    world_size=acc.num_processes,
                    run=self.run_facts() if self.run_facts else None,
                )
                checkpoints.rotate(Path(args.output_dir), self.save_total_limit, ckpt)
                log.info("checkpoint %s complete", ckpt)
            except Exception as e:  # noqa: BLE001 - agreed below: every rank raises
                error = e
        signals.agree(acc, f"the completion marker of {ckpt.name}", error, with_signals=False)  # not a plain barrier
        self.last_complete = ckpt


class ResilientTrainer(FinetuneTrainer):
    """FinetuneTrainer with the non-finite guard and the resilience callback installed. The guard
    keeps its flags on the device (finetune/training/step_guard.py): no host sync and no collective
    per micro-batch; the ranks agree once per optimizer step, before its update."""

    def __init__(
        self,
        *args,
        save_total_limit: int | None = None,
        on_nonfinite: str = "stop",
        max_nonfinite_skips: int = 0,
        on_collapse: str = "stop",
        collapse_windows: int = 3,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.resilience = ResilienceCallback(self, save_total_limit=save_total_limit)
        self.add_callback(self.resilience)
        config = getattr(self.model, "config", None)
        vocab = getattr(config.get_text_config() if config is not None else None, "vocab_size", None)
        self.collapse = CollapseWatch(policy=on_collapse, windows=collapse_windows, vocab_size=vocab)
        self.add_callback(self.collapse)
        install_signal_handlers()  # normally done by finetune/training/run.py at start; idempotent
        self.on_nonfinite = on_nonfinite
        self.max_nonfinite_skips = max_nonfinite_skips
        self.skipped_steps: list[dict] = []
        self._skip_update = False
        check_policy(on_nonfinite, self.accelerator.distributed_type.value)
        self._deepspeed = self.accelerator.distributed_type.value == "DEEPSPEED"
        self.flags = StepFlags(self.accelerator.device)
        self._agreed: tuple[int, Agreed] | None = None  # (step, every rank's row) of the last agreement

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self.resilience.nothing_to_train:  # no batch drawn: the step loop ends without a step
            return [], None
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _save_checkpoint(self, model, trial):
        """Trainer's save, made an agreed outcome: a full disk (or quota, or read-only) on any rank is
        a StorageError on every rank (rank 0's names the checkpoint, the reason, the free space and
        the newest complete checkpoint); the incomplete one is removed (it has no marker; removing it
        frees its space for run.json). Any other error on any rank raises on every rank."""
        from finetune import storage

        acc = self.accelerator
        ckpt = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        failure = error = None
        try:
            with peers.watch.during(f"the save of {ckpt.name}", self.args.ddp_timeout):  # the watchdog's limit
                super()._save_checkpoint(model, trial)
                fault_injection.at_save(rank=acc.process_index, step=self.state.global_step, ckpt=ckpt)
        except Exception as e:  # noqa: BLE001 - agreed below before any rank goes on
            failure, error = storage.error(e, ckpt, f"writing checkpoint {ckpt}"), e
        # every rank's outcome: 0 saved, an errno (a full or read-only disk), -1 any other error
        codes = flags_per_rank(acc, failure.errno if failure else -1 if error else 0)
        if not any(codes):
            return
        if -1 in codes:  # not the disk: every rank raises (its own error, or one naming the ranks that failed)
            if error is not None:
                raise error
            failed = [r for r, c in enumerate(codes) if c]
            raise signals.FailedElsewhere(f"writing checkpoint {ckpt} failed on rank(s) {failed}; stopped with them")
        if acc.is_main_process and ckpt.exists() and checkpoints.problem(ckpt) is not None:
            shutil.rmtree(ckpt, ignore_errors=True)
        acc.wait_for_everyone()
        if not acc.is_main_process:
            raise storage.StorageError(f"writing checkpoint {ckpt} failed (rank 0 says why)", failure and failure.errno)
        last = next((c for c in reversed(checkpoints.checkpoints(ckpt.parent)) if checkpoints.problem(c) is None), None)
        then = f"The incomplete {ckpt.name} was removed; " + (
            f"the newest complete checkpoint is {last}: free space, then continue with --resume"
            if last
            else "no complete checkpoint was written: free space, then run again"
        )
        ranks = [r for r, c in enumerate(codes) if c]
        code = next(c for c in codes if c)
        failed_at = failure.failed_at if failure else None
        where = f"writing checkpoint {ckpt}" + (f" on rank(s) {ranks}" if acc.num_processes > 1 else "")
        raise storage.StorageError(storage.message(code, ckpt, where, then, failed_at=failed_at), code)

    def faults_section(self) -> dict:
        """run.json `faults`: how this run meets a stalled rank, a non-finite step and old checkpoints."""
        return {
            "collective_timeout_s": self.args.ddp_timeout,
            "on_nonfinite": self.on_nonfinite,
            "max_nonfinite_skips": self.max_nonfinite_skips,
            "on_collapse": self.collapse.policy,
            "collapse_windows": self.collapse.windows,
            "save_total_limit": self.resilience.save_total_limit,
        }

    def agreement_of(self, step: int) -> Agreed:
        """The agreement of optimizer step `step`; an error if it did not run (a Trainer whose step no
        longer passes through the hooks below would otherwise train unguarded)."""
        if self._agreed is None or self._agreed[0] != step:
            raise RuntimeError(
                f"the ranks did not agree on optimizer step {step} before its update: the non-finite "
                "guard's hooks (compute_loss, _get_grad_norm) were not called as transformers 5.24 calls them"
            )
        return self._agreed[1]

    def _agree(self) -> None:
        """The step's one agreement (signals included); then stop, or mark the update skipped."""
        step = self.state.global_step + 1
        agreed = self.flags.agree(self.accelerator, signals.code())
        self._agreed = (step, agreed)
        if any(agreed.signals()):
            peers.watch.acted()  # the stop is agreed: the watchdog's grace period ends (checkpoint next)
        bad = agreed.nonfinite()
        if bad is None:
            return
        slot, ranks = bad
        what = CHECKED[slot]
        if self.on_nonfinite == "skip" and len(self.skipped_steps) < self.max_nonfinite_skips:
            self.skipped_steps.append({"step": step, "what": what, "ranks": ranks})
            log.warning(
                "non-finite %s at step %d on rank(s) %s: skipping this step's optimizer update (%d of at most %d)",
                what,
                step,
                ranks,
                len(self.skipped_steps),
                self.max_nonfinite_skips,
            )
            self._skip_update = True
            return
        limit = (
            f"; {len(self.skipped_steps)} step(s) already skipped, training.max_nonfinite_skips="
            f"{self.max_nonfinite_skips}"
            if self.on_nonfinite == "skip"
            else ""
        )
        values = ", ".join(f"rank {r}: {agreed.value(slot + '_value', r)}" for r in ranks)
        last = self.resilience.last_complete
        raise NonFiniteError(
            f"non-finite {what} at step {step} on rank(s) {ranks} ({values}); stopped before that step's "
            f"optimizer update{limit}. Last complete checkpoint: {last if last else 'none written in this run'}",
            list(self.skipped_steps),
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if not model.training:  # evaluation also comes through here
            return out
        loss = out[0] if return_outputs else out
        loss = fault_injection.corrupt_loss(loss, rank=self.accelerator.process_index, step=self.state.global_step + 1)
        self.flags.note("loss", loss)
        if self._deepspeed and self.accelerator.sync_gradients:
            self._agree()  # the step's last micro-batch: the engine steps inside its backward
        return (loss, *out[1:]) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        # A non-finite micro-batch adds 0 to the logged loss (its step is skipped or stops the run):
        # on the device, so Trainer's own per-micro-batch check (logging_nan_inf_filter) can stay off.
        return torch.nan_to_num(super().training_step(model, inputs, num_items_in_batch), 0.0, 0.0, 0.0)

    def _get_grad_norm(self, model, grad_norm=None):
        """Trainer computes the norm here (clipped or not) right before the optimizer step: the
        agreement point of every strategy but DeepSpeed, whose engine has stepped by now."""
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if not self._deepspeed:
            if norm is not None:
                # FSDP2: this rank's part of a DTensor norm; the agreement ORs the ranks (no collective)
                local = norm.to_local() if hasattr(norm, "to_local") else torch.as_tensor(norm)
                self.flags.note("grad_norm", local)
            self._agree()
        return norm

    def create_optimizer(self, *args, **kwargs):
        opt = super().create_optimizer(*args, **kwargs)
        if self.on_nonfinite == "skip" and not getattr(opt, "_finetune_guarded", False):
            step = opt.step

            def guarded_step(*a, **k):
                if self._skip_update:
                    self._skip_update = False
                    return None  # gradients are zeroed by Trainer right after; no update, on every rank
                return step(*a, **k)

            opt.step = guarded_step
            opt._finetune_guarded = True
        return opt
