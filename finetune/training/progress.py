"""The console progress of a run: Trainer's progress bar, with one compact line per log step.
"""

from __future__ import annotations

from transformers.trainer_callback import ProgressCallback


class CompactProgress(ProgressCallback):
    """Trainer's progress bar, with one compact line per log step instead of the raw dict."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not (state.is_world_process_zero and self.training_bar is not None and logs and "loss" in logs):
            return super().on_log(args, state, control, logs=logs, **kwargs)
        parts = [f"step {state.global_step}/{state.max_steps}", f"loss {logs['loss']:.4f}",
                 f"lr {logs.get('learning_rate', 0):.3g}"]
        if logs.get("grad_norm") is not None:
            parts.append(f"gnorm {logs['grad_norm']:.3g}")
        if "perf/trained_tokens_per_s" in logs:
            parts.append(f"{logs['perf/trained_tokens_per_s']:,.0f} tok/s ({logs['perf/trained_tokens_per_s_per_device']:,.0f}"
                         f"/dev)")
        parts.append(f"{logs['perf/step_s']:.2f} s/step")
        if "perf/mfu" in logs:
            parts.append(f"MFU {100 * logs['perf/mfu']:.1f}%")
        if "memory/max_device_peak_allocated_gib" in logs:
            parts.append(f"dev {logs['memory/max_device_peak_allocated_gib']:.2f} GiB")
        parts.append(f"host {logs.get('memory/max_host_peak_rss_gib', 0):.2f} GiB")
        self.training_bar.write(" | ".join(parts))
