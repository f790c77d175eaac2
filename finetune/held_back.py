"""Third-party messages held back at their source, each for a stated reason and matched by its own text and logger or
module, never by a blanket switch. Installed when `finetune` is imported, so in every process (the CLI, each launched
rank, the benchmark's workers). What is held back is kept (`held`) where a run may still need to say it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings

# Where a rank's held messages go once its run directory exists (to_log_file): the run's third-party log.
KEPT = logging.getLogger("finetune.held_back")


class HeldBack(logging.Filter):
    """Drops the records of one logger whose message starts with `prefix` (or, under `printed_lines_held`, the printed
    lines that do), keeping their text, and in a rank the run's third-party log (to_log_file)."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix
        self.held: list[str] = []

    def holds(self, text: str) -> bool:
        if not text.startswith(self.prefix):
            return False
        self.held.append(text)
        if KEPT.handlers:  # a rank's run directory exists (to_log_file); written once it trains (keep_held)
            KEPT.warning("held back from the console: %s", text)
        return True

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.holds(record.getMessage())


# bitsandbytes is imported by peft whenever peft is imported (peft 0.21 peft/helpers.py imports it unconditionally), and
# transformers imports peft with TrainingArguments whenever peft is installed (transformers 5.23 trainer_utils.py), so
# every command that validates a recipe imports it, 4-bit or not; none of the three has a switch. On import, its CPU
# backend (bitsandbytes/backends/cpu/ops.py) warns that the optional `kernels` package for its 4-bit CPU matmul is
# missing, on any CPU with AVX512-BF16: noise for every run without 4-bit weights. A QLoRA run on CPU, where it applies,
# shows it (finetune/modeling/load.py).
CPU_4BIT_NOTICE = HeldBack("Failed to load CPU gemm_4bit_forward")
# DeepSpeed picks its accelerator when it is first imported (deepspeed/accelerator/real_accelerator.py) and, finding no
# CUDA, warns "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." in every
# process of every command that imports it (through accelerate and transformers), also where no DeepSpeed strategy runs.
# Whether a CUDA device is visible is said by the run itself: the precision line and run.json `hardware`, and preflight
# refuses a GPU launch on a machine without one.
DEEPSPEED_CPU_ACCELERATOR = HeldBack("Setting accelerator to CPU")


class ZeroProcessesDefault(logging.Filter):
    """accelerate launch without --num_processes and without a config that sets it counts the CUDA
    devices (accelerate 1.15 commands/launch.py _validate_launch_command) and, on a machine without
    one, reports "`--num_processes` was set to a value of `0`" among its defaults, then runs one
    process: the 0 is no process count. Its line is dropped (the other defaults stay); installed by
    `finetune train` and bench-comm around the accelerate launch they run in their own process."""

    LINE = "`--num_processes` was set to a value of `0`"

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or self.LINE not in record.msg:
            return True
        lines = [line for line in record.msg.split("\n") if self.LINE not in line]
        record.msg = "\n".join(lines)
        return any(line.startswith("\t`") for line in lines)  # other defaults still worth saying


ZERO_PROCESSES_DEFAULT = ZeroProcessesDefault()
# torchrun's agent logs "failed (exitcode: 75) local_rank: 0 (pid: N) of binary: ..." when a rank
# exits non-zero (torch/distributed/elastic/multiprocessing/api.py), after the rank said why ("exit
# code 75 (preempted)"); `finetune train` names the failed ranks itself (launch/accelerate.py).
TORCHRUN_FAILED = HeldBack("failed (exitcode:")
# ... and "Sending process N closing signal SIGTERM" for each rank still running once one has exited (the same file):
# the run has said how it ended (its exit line, or the failed ranks named by `finetune train`).
TORCHRUN_STOPPING = HeldBack("Sending process ")
# ... and "Unable to shutdown process N via 15, forcefully exiting via 9" for a rank that outlived its SIGTERM (a
# stopped one): `finetune train` names it itself, "killed by SIGKILL" (launch/accelerate.py report_failed_ranks).
TORCHRUN_FORCED = HeldBack("Unable to shutdown process ")
# torchrun (torch/distributed/run.py) warns in four lines that it sets OMP_NUM_THREADS=1 for each rank when the
# variable is unset and a node runs several ranks: on every DeepSpeed launch (accelerate sets the variable for its
# other launchers, accelerate/utils/launch.py). The ranks' thread count is in the record (`hardware`); 1 is what
# torchrun gives them either way.
TORCHRUN_OMP_NOTICE = HeldBack("\n*****************************************\nSetting OMP_NUM_THREADS")
# DeepSpeed's CPU communication backend prints "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" in
# every rank whenever it loads the op (deepspeed/comm/torch.py build_shm_op), also when nothing was built; a build
# that happens is announced by the run (finetune/training/rank_imports.py). Held while the process group is set up.
DEEPSPEED_OP_LOADED = HeldBack("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")


class _LogFile(logging.FileHandler):
    """The run's log file. A write that fails (the disk that failed the run is full, the run directory gone) is
    dropped quietly: the run's message says what failed, and logging's own traceback would be a second one."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            super().emit(record)  # opens the file on the first record (delay): not inside logging's own guard
        except OSError:
            pass

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass


# The tracebacks of errors the run handles and says in one line (an export on a full disk, a figure that could not be
# computed): kept in the run's log file, which the line names, never on the console.
TRACEBACKS = logging.getLogger("finetune.tracebacks")
TRACEBACKS.addHandler(logging.NullHandler())  # before the run directory exists: nowhere (not logging's last resort)
TRACEBACKS.propagate = False


def install_launcher() -> None:
    """Around an accelerate launch run in this process (`finetune train`, bench-comm)."""
    logging.getLogger("accelerate.commands.launch").addFilter(ZERO_PROCESSES_DEFAULT)
    agent = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    for held in (TORCHRUN_FAILED, TORCHRUN_STOPPING, TORCHRUN_FORCED):
        agent.addFilter(held)
    logging.getLogger("torch.distributed.run").addFilter(TORCHRUN_OMP_NOTICE)
    # accelerate warns "Port `29500` is already in use" when another job on the machine holds the default rendezvous
    # port, then has torchrun pick a free one itself (accelerate/utils/launch.py): nothing to act on.
    warnings.filterwarnings(
        "ignore", message=r"Port `\d+` is already in use", category=UserWarning, module=r"accelerate\.utils\.launch"
    )


class PrintedLines(io.TextIOBase):
    """A stdout that holds back the whole lines one of `held` matches and writes every other line to `real`."""

    def __init__(self, real, held: tuple[HeldBack, ...]):
        super().__init__()
        self.real, self.held, self.pending = real, held, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not any(h.holds(line) for h in self.held):
                self.real.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        if self.pending and not any(h.holds(self.pending) for h in self.held):
            self.real.write(self.pending)
        self.pending = ""
        self.real.flush()


@contextlib.contextmanager
def printed_lines_held(*held: HeldBack):
    """While inside: a line printed to stdout that one of `held` matches is held back (print() calls of a library,
    which no logging filter sees); every other line is printed as it was."""
    lines = PrintedLines(sys.stdout, held)
    try:
        with contextlib.redirect_stdout(lines):
            yield
    finally:
        lines.flush()


def to_log_file(path, rank: int) -> None:
    """From here on, this rank's third-party warnings (Python's `warnings`: torch's pin_memory notice on
    a CPU, deprecations) and the tracebacks of handled errors (TRACEBACKS) go to the run's log file, kept
    with their source, instead of the console, and so do the messages held back at their source (this
    module) once the run trains (keep_held); and transformers' progress bars (loading weights, writing
    model shards) are off: the run says what it loads and saves. Our own lines are log records and
    prints (finetune raises no warnings)."""
    from transformers.utils import logging as hf_logging

    handler = _LogFile(path, encoding="utf-8", delay=True)  # made by the first warning only
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank}: %(message)s"))
    for logger in (logging.getLogger("py.warnings"), KEPT):
        for earlier in logger.handlers:  # an earlier run in this process (the benchmark, the tests)
            earlier.close()
        logger.handlers, logger.propagate = [handler], False
    KEPT.disabled = True  # until keep_held(): held notices alone never make the file
    TRACEBACKS.handlers = [handler]
    logging.captureWarnings(True)
    hf_logging.disable_progress_bar()


def keep_held() -> None:
    """Once the run trains: the messages this rank held back, those held before too, go to the run's log file from
    here on. Not earlier: a run that fails before (a disk full at the start) leaves nothing but what it must."""
    KEPT.disabled = False
    for held in (CPU_4BIT_NOTICE, DEEPSPEED_CPU_ACCELERATOR, DEEPSPEED_OP_LOADED):
        for text in held.held:
            KEPT.warning("held back from the console: %s", text)


def install() -> None:
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(CPU_4BIT_NOTICE)
    # DeepSpeed's own logger (deepspeed/utils/logging.py LoggerFactory: "DeepSpeed", propagate off);
    # a filter added before DeepSpeed configures it stays on it.
    logging.getLogger("DeepSpeed").addFilter(DEEPSPEED_CPU_ACCELERATOR)
    # DeepSpeed 0.19.8's ZeRO-3 calls torch.distributed.all_gather_into_tensor / reduce_scatter_tensor
    # (deepspeed/comm/torch.py), which torch 2.13 deprecates for the *_single names: a FutureWarning on
    # every rank for each collective. accelerate's per-step `warnings.catch_warnings` resets the
    # once-per-location registry, so it repeats every step (22 times in a 3-step run). Only DeepSpeed can
    # change the call; the collectives themselves are unchanged.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )
    # peft 0.21 reads `model.is_gradient_checkpointing` (peft_model.py PeftModel.__init__), which transformers 5.24
    # deprecates for `is_activation_checkpointing`: once per rank at every LoRA/QLoRA model load, about peft's code.
    warnings.filterwarnings(
        "ignore",
        message=r"`is_gradient_checkpointing` is deprecated",
        category=FutureWarning,
        module=r"transformers\.modeling_utils",
    )
