"""FinetuneTrainer: transformers.Trainer that counts tokens and keeps the run record current.

Tokens are counted on each rank from the batches it really trained on (input tokens:
attention positions that are not padding; trained tokens: labels != -100) and summed over
ranks at each log. The extra keys are added in `log()` itself, before Trainer hands the
dict to its callbacks, so every `report_to` integration receives them (a callback of ours
would run after the integrations and be too late).
"""

from __future__ import annotations

import time

import torch
from transformers import Trainer


class FinetuneTrainer(Trainer):
    def __init__(self, *args, record=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.record = record  # finetune.record.RunRecord on rank 0, None elsewhere
        self._tokens = torch.zeros(3, dtype=torch.long)  # input tokens, trained tokens, samples since log
        self._totals = torch.zeros(3, dtype=torch.long)
        self._last_log_time: float | None = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        labels = inputs.get("labels")
        mask = inputs.get("attention_mask")
        ids = inputs["input_ids"]
        if self._last_log_time is None:
            self._last_log_time = time.perf_counter()  # throughput window starts at the first step
        n_input = int(mask.sum()) if mask is not None else ids.numel()
        n_trained = int((labels != -100).sum()) if labels is not None else n_input
        self._tokens += torch.tensor([n_input, n_trained, ids.shape[0]])
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        training_log = "loss" in logs and "train_runtime" not in logs
        if training_log:
            now = time.perf_counter()
            counts = self._reduce(self._tokens)
            self._tokens.zero_()
            self._totals += counts
            logs["tokens/input"] = int(counts[0])
            logs["tokens/trained"] = int(counts[1])
            logs["tokens/trained_total"] = int(self._totals[1])
            logs["perf/trained_tokens_per_s"] = round(int(counts[1]) / (now - self._last_log_time), 2)
            self._last_log_time = now
        super().log(logs, start_time)
        if self.record is not None and training_log:
            self.record["steps"].append({
                "step": self.state.global_step,
                "loss": logs.get("loss"),
                "lr": logs.get("learning_rate"),
                "grad_norm": logs.get("grad_norm"),
                "trained_tokens": logs["tokens/trained"],
                "input_tokens": logs["tokens/input"],
                "step_s": None,
            })
            self.record["summary"]["steps"] = self.state.global_step
            self.record.write()

    def final_totals(self) -> dict:
        """Totals over the whole run, including steps after the last log. Call on every rank."""
        self._totals += self._reduce(self._tokens)
        self._tokens.zero_()
        return {"input_tokens": int(self._totals[0]), "trained_tokens": int(self._totals[1]),
                "samples": int(self._totals[2])}

    def _reduce(self, counts: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes == 1:
            return counts.clone()
        return self.accelerator.reduce(counts.to(self.accelerator.device), reduction="sum").cpu()
