"""Surviving faults during training: preemption signals, complete checkpoints, non-finite losses.

What happens in each case (docs/faults.md has the user-facing table):

* SIGTERM or SIGINT on any rank: the handler only records the signal (finetune/training/signals.py:
  it never raises, so a second signal cannot interrupt a checkpoint being written; it is logged
  and ignored). At the end of each optimizer step every rank all-gathers its flag; if any rank
  was signalled, all of them ask Trainer to save and stop at this step boundary, rank 0 marks the
  checkpoint complete, and the run (finetune/training/run.py) records status `interrupted`,
  prints the resume command and exits with EXIT_PREEMPTED (75). Trainer's own SIGTERM support (TrainingArguments
  enable_jit_checkpoint, transformers 5.23 trainer_jit_checkpoint.py) stops the loop and lets
  the script end normally, exit 0, which a scheduler reads as "finished"; and it only listens
  on the rank that got the signal. Not used here.
* After every checkpoint Trainer writes (scheduled or on preemption): a barrier, then rank 0
  writes the completion marker and rotates old checkpoints (finetune/training/checkpoints.py).
* A non-finite loss on any rank is agreed across ranks right after the forward pass, before
  backward: under DeepSpeed, accelerator.backward() runs engine.backward() AND engine.step(),
  so a check any later would come after the optimizer step. Where Trainer computes the
  gradient norm before the step (every strategy but DeepSpeed, whose engine clips inside its
  step), a non-finite norm is agreed too. Then, per training.on_nonfinite: `stop` (default)
  raises NonFiniteError naming the step and rank(s) before any optimizer update; `skip` drops
  the step's optimizer update on every rank (not under DeepSpeed: see check_policy), at most
  training.max_nonfinite_skips times, then stops.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import torch
from transformers import TrainerCallback

from finetune.errors import EXIT_NONFINITE, UserError
from finetune.training import checkpoints, faults
from finetune.training.signals import flags_per_rank, install_signal_handlers, received, restore_signal_handlers
from finetune.training.trainer import FinetuneTrainer

log = logging.getLogger("finetune")


class NonFiniteError(RuntimeError):
    exit_code = EXIT_NONFINITE

    def __init__(self, message: str, skipped: list[dict]):
        super().__init__(message)
        self.skipped = skipped  # steps skipped before this one (training.on_nonfinite: skip)


def check_policy(policy: str, distributed_type: str) -> None:
    if policy == "skip" and distributed_type == "DEEPSPEED":
        raise UserError("training.on_nonfinite: 'skip' is not implemented under DeepSpeed (its engine runs the "
                        "optimizer step inside backward, so the update cannot be dropped from outside); "
                        "use 'stop' (the default) and resume from the last checkpoint")


class ResilienceCallback(TrainerCallback):
    def __init__(self, trainer: ResilientTrainer, *, save_total_limit: int | None):
        self.trainer = trainer
        self.save_total_limit = save_total_limit
        self.preempted: dict | None = None  # {step, signal, ranks} once the ranks agreed to stop
        self.last_complete: Path | None = None
        self.run_facts = None  # rank 0: () -> the marker's `run` block (finetune/training/checkpoint_facts.py)

    # --- signals ---------------------------------------------------------------------------

    def on_train_end(self, args, state, control, **kwargs):
        # Preempted: keep recording signals until the process exits. The launcher tears the
        # other ranks down with SIGTERM as soon as one rank has exited 75; a rank still
        # finishing its record or tearing down its process group must not die of it.
        if self.preempted is None:
            restore_signal_handlers()

    def on_step_begin(self, args, state, control, **kwargs):
        faults.at_step_begin(rank=self.trainer.accelerator.process_index, step=state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        signums = flags_per_rank(self.trainer.accelerator, received[0] if received else 0)
        if any(signums) and self.preempted is None:
            ranks = [r for r, n in enumerate(signums) if n]
            self.preempted = {"step": state.global_step, "ranks": ranks,
                              "signal": signal.Signals(signums[ranks[0]]).name}
            control.should_save = True
            control.should_training_stop = True

    # --- checkpoints -----------------------------------------------------------------------

    def on_save(self, args, state, control, **kwargs):
        acc = self.trainer.accelerator
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        acc.wait_for_everyone()  # every rank's shards are on disk before the marker says so
        if acc.is_main_process:
            checkpoints.write_marker(ckpt, step=state.global_step, world_size=acc.num_processes,
                                     run=self.run_facts() if self.run_facts else None)
            checkpoints.rotate(Path(args.output_dir), self.save_total_limit, ckpt)
            log.info("checkpoint %s complete", ckpt)
        self.last_complete = ckpt
        acc.wait_for_everyone()


class ResilientTrainer(FinetuneTrainer):
    """FinetuneTrainer with the non-finite guard and the resilience callback installed."""

    def __init__(self, *args, save_total_limit: int | None = None, on_nonfinite: str = "stop",
                 max_nonfinite_skips: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.resilience = ResilienceCallback(self, save_total_limit=save_total_limit)
        self.add_callback(self.resilience)
        install_signal_handlers()  # normally done by finetune/training/run.py at start; idempotent
        self.on_nonfinite = on_nonfinite
        self.max_nonfinite_skips = max_nonfinite_skips
        self.skipped_steps: list[dict] = []
        self._skip_update = False
        check_policy(on_nonfinite, self.accelerator.distributed_type.value)

    def _nonfinite(self, what: str, value: torch.Tensor) -> bool:
        """Agree across ranks on a non-finite `value`; stop or mark this step skipped. True = skip."""
        bad = flags_per_rank(self.accelerator, not bool(torch.isfinite(value.detach()).all()))
        if not any(bad):
            return False
        step = self.state.global_step + 1
        ranks = [r for r, b in enumerate(bad) if b]
        if self.on_nonfinite == "skip" and len(self.skipped_steps) < self.max_nonfinite_skips:
            if not self._skip_update:
                self.skipped_steps.append({"step": step, "what": what, "ranks": ranks})
                log.warning("non-finite %s at step %d on rank(s) %s: skipping this step's optimizer update "
                            "(%d of at most %d)", what, step, ranks, len(self.skipped_steps), self.max_nonfinite_skips)
            self._skip_update = True
            return True
        limit = (f"; {len(self.skipped_steps)} step(s) already skipped, training.max_nonfinite_skips="
                 f"{self.max_nonfinite_skips}" if self.on_nonfinite == "skip" else "")
        last = self.resilience.last_complete
        raise NonFiniteError(f"non-finite {what} at step {step} on rank(s) {ranks} (value on this rank: "
                             f"{value.detach().float().flatten()[0].item()}); stopped before that step's optimizer "
                             f"update{limit}. Last complete checkpoint: "
                             f"{last if last else 'none written in this run'}", list(self.skipped_steps))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)
        if not model.training:  # evaluation also comes through here
            return out
        loss = out[0] if return_outputs else out
        loss = faults.corrupt_loss(loss, rank=self.accelerator.process_index, step=self.state.global_step + 1)
        if self._nonfinite("loss", loss):
            raise _Skipped(torch.zeros_like(loss.detach()))
        return (loss, *out[1:]) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        except _Skipped as s:  # every rank skipped this micro-batch's backward together
            return s.loss

    def _clip_grad_norm(self, model):
        norm = super()._clip_grad_norm(model)
        if norm is not None and not self._skip_update and self.accelerator.distributed_type.value != "DEEPSPEED":
            value = norm.full_tensor() if hasattr(norm, "full_tensor") else torch.as_tensor(norm)
            self._nonfinite("gradient norm", value)
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


class _Skipped(Exception):
    """Raised from compute_loss in skip mode so no backward runs on this micro-batch."""

    def __init__(self, loss):
        self.loss = loss


