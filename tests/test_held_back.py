"""Issue 27 item 5, issue 43 item 2: third-party noise held back at its source (finetune/held_back.py), each filter
matching one message, and kept in the run's third-party log. DeepSpeed's op builds announced as they happen:
tests/training/test_rank_imports.py. A whole run's console: tests/training/test_strategies.py
test_a_deepspeed_run_prints_no_library_noise_and_no_config_dump, and `finetune train`'s launches in
tests/training/test_faults.py."""

from __future__ import annotations

import logging
import warnings

import finetune  # noqa: F401 - installs the filters, as every process does


def _shown(message: str, category=FutureWarning, module: str = "torch.distributed.c10d_logger") -> bool:
    from finetune import held_back

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # the control's baseline: everything shows ...
        held_back.install()  # ... unless one of our filters (installed after, so first) matches
        warnings.warn_explicit(message, category, "x.py", 1, module=module)
    return bool(seen)


def test_deepspeeds_deprecated_collective_warnings_are_held_back_and_nothing_else():
    assert not _shown("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...")
    assert not _shown("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use ...")
    assert _shown("`torch.distributed.all_reduce_coalesced` is deprecated.")  # another deprecation still shows
    assert _shown("`torch.distributed.all_gather_into_tensor` is deprecated.", DeprecationWarning)  # other category
    assert not _shown("`is_gradient_checkpointing` is deprecated", module="transformers.modeling_utils")
    assert _shown("`is_gradient_checkpointing` is deprecated", module="my_code")  # only where peft triggers it


def test_deepspeeds_cpu_accelerator_notice_is_held_and_kept():
    from finetune import held_back

    held = held_back.DEEPSPEED_CPU_ACCELERATOR
    before = len(held.held)
    logger = logging.getLogger("DeepSpeed")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        logger.warning("Setting ds_accelerator to cpu (auto detect)")  # control: other DeepSpeed records pass
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["Setting ds_accelerator to cpu (auto detect)"]
    assert held.held[before:] == [
        "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    ]


ACCELERATE_DEFAULTS = (
    "The following values were not passed to `accelerate launch` and had defaults used instead:\n"
    "\t`--num_processes` was set to a value of `0`\n"
    "\t`--num_machines` was set to a value of `1`\n"
    "To avoid this warning pass in values for each of the problematic parameters or run `accelerate config`."
)


def test_accelerates_zero_processes_default_line_is_dropped_and_the_others_kept():
    from finetune import held_back

    record = logging.LogRecord("accelerate.commands.launch", logging.WARNING, "x", 1, ACCELERATE_DEFAULTS, None, None)
    assert held_back.ZERO_PROCESSES_DEFAULT.filter(record)
    assert "`--num_processes`" not in record.getMessage() and "`--num_machines` was set" in record.getMessage()
    only = ACCELERATE_DEFAULTS.replace("\t`--num_machines` was set to a value of `1`\n", "")
    record = logging.LogRecord("accelerate.commands.launch", logging.WARNING, "x", 1, only, None, None)
    assert not held_back.ZERO_PROCESSES_DEFAULT.filter(record)  # nothing left to say
    other = logging.LogRecord("accelerate.commands.launch", logging.WARNING, "x", 1, "something else", None, None)
    assert held_back.ZERO_PROCESSES_DEFAULT.filter(other) and other.getMessage() == "something else"


LAUNCH = """
import sys
from finetune.launch.accelerate import run_accelerate_launch
sys.exit(run_accelerate_launch(["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", {script!r}]))
"""


def test_an_in_process_accelerate_launch_without_a_process_count_does_not_say_zero(tmp_path):
    """accelerate launch as `finetune train` runs it (in its own process), no config and no
    --num_processes on a machine without CUDA: the one process runs, and no "value of `0`" is printed."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    script = tmp_path / "hello.py"
    script.write_text("print('RAN', flush=True)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", HF_HOME=str(tmp_path))  # no default config
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCH.format(script=str(script))],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0 and "RAN" in proc.stdout, proc.stderr[-2000:]
    assert "set to a value of `0`" not in proc.stderr, proc.stderr[-2000:]


def test_third_party_warnings_go_to_the_runs_log_file_and_transformers_bars_are_off(tmp_path, capsys):
    """torch's pin_memory UserWarning on a CPU and transformers' "Loading weights" / "Writing model shards"
    bars were on the console among our lines; the warnings are kept in the run's log file instead."""
    from transformers.utils import logging as hf_logging

    from finetune import held_back

    warned = logging.getLogger("py.warnings")
    logging.captureWarnings(False)  # as in a fresh process: an in-process run earlier in the session set it
    try:
        held_back.to_log_file(tmp_path / "third_party.log", rank=1)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn_explicit("'pin_memory' argument is set as true", UserWarning, "dataloader.py", 759)
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        logging.captureWarnings(False)
        for handler in warned.handlers[:]:
            handler.close()
            warned.removeHandler(handler)
        warned.propagate = True
        hf_logging.enable_progress_bar()
    assert "'pin_memory' argument" not in capsys.readouterr().err
    kept = (tmp_path / "third_party.log").read_text()
    assert "rank 1: dataloader.py:759: UserWarning: 'pin_memory' argument is set as true" in kept


def test_torchruns_failed_line_after_our_own_exit_message_is_held():
    """A preempted rank says "exit code 75 (preempted)"; torchrun's agent then logged "failed (exitcode:
    75) ..." as an error. `finetune train` names failed ranks itself (finetune/launch/accelerate.py)."""
    from finetune import held_back

    held_back.install_launcher()
    agent, seen = logging.getLogger("torch.distributed.elastic.multiprocessing.api"), []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(record.getMessage())
    agent.addHandler(handler)
    try:
        agent.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 75, 0, 123, "python")
        agent.warning(STAYS, 124, "SIGKILL", 30)  # control: the others stay
    finally:
        agent.removeHandler(handler)
    assert seen == ["Process 124 did not exit after SIGKILL within 30s; abandoning and continuing teardown."]
    assert held_back.TORCHRUN_FAILED.held[-1].startswith("failed (exitcode: 75) local_rank: 0")


# torchrun's warning about a rank it could not end even with SIGKILL (torch/distributed/elastic/multiprocessing/api.py):
# not held back, nothing of ours says it
STAYS = "Process %s did not exit after %s within %ss; abandoning and continuing teardown."


def _records_of(name: str):
    logger, seen = logging.getLogger(name), []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    return logger, handler, seen


def test_torchruns_lines_around_a_launch_are_held_in_finetune_train(monkeypatch):
    """Issue 43: torchrun's four-line OMP_NUM_THREADS notice on every DeepSpeed launch (accelerate sets the variable
    for its other launchers) and its "closing signal SIGTERM" line after the run's own exit line, in the process
    that runs accelerate launch for `finetune train`. The notice is torch's own, logged by torch's own code here."""
    import torch.distributed.run as torchrun

    from finetune import held_back

    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.delenv("OMP_NUM_THREADS")  # unset, as in a shell; put back after the test
    run_logger, run_handler, notices = _records_of("torch.distributed.run")
    agent, agent_handler, agent_lines = _records_of("torch.distributed.elastic.multiprocessing.api")
    run_logger.removeFilter(held_back.TORCHRUN_OMP_NOTICE)  # as in a process that has not installed it
    try:
        torchrun.config_from_args(torchrun.get_args_parser().parse_args(["--nproc_per_node", "2", "x.py"]))
        assert any("Setting OMP_NUM_THREADS" in n for n in notices), notices  # the control: shown before
        notices.clear()
        monkeypatch.delenv("OMP_NUM_THREADS")  # torchrun set it
        held_back.install_launcher()
        torchrun.config_from_args(torchrun.get_args_parser().parse_args(["--nproc_per_node", "2", "x.py"]))
        agent.warning("Sending process %s closing signal %s", 124, "SIGTERM")
        # a stopped rank that outlived its SIGTERM: `finetune train` names it "killed by SIGKILL" itself
        agent.warning("Unable to shutdown process %s via %s, forcefully exiting via %s", 124, 15, 9)
        agent.warning(STAYS, 124, "SIGKILL", 30)  # control: stays
    finally:
        run_logger.removeHandler(run_handler)
        agent.removeHandler(agent_handler)
    assert notices == [] and "Setting OMP_NUM_THREADS" in held_back.TORCHRUN_OMP_NOTICE.held[-1]
    assert agent_lines == ["Process 124 did not exit after SIGKILL within 30s; abandoning and continuing teardown."]
    assert held_back.TORCHRUN_FORCED.held[-1] == "Unable to shutdown process 124 via 15, forcefully exiting via 9"
    port = "Port `29500` is already in use. Accelerate will attempt to launch in a standalone-like mode"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        held_back.install_launcher()  # its filter goes in front
        warnings.warn_explicit(port, UserWarning, "launch.py", 508, module="accelerate.utils.launch")
        warnings.warn_explicit(port, UserWarning, "x.py", 1, module="my_code")  # the control: only accelerate's
    assert [w.filename for w in seen] == ["x.py"]
    assert held_back.TORCHRUN_STOPPING.held[-1] == "Sending process 124 closing signal SIGTERM"


def test_a_printed_line_is_held_by_its_text_and_the_others_are_printed(capsys):
    """DeepSpeed's `print('DeepSpeed ... built successfully')` in every rank, around the process group's set-up."""
    from finetune import held_back

    held = held_back.DEEPSPEED_OP_LOADED
    before = len(held.held)
    with held_back.printed_lines_held(held):
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("ours", end="")
        print(" too")
        print("DeepSpeed deepspeed.ops.comm.deepspeed_ccl_comm_op built successfully")  # another op's: shown
        print("unfinished", end="")
    print("after")
    assert capsys.readouterr().out == (
        "ours too\nDeepSpeed deepspeed.ops.comm.deepspeed_ccl_comm_op built successfully\nunfinishedafter\n"
    )
    assert held.held[before:] == ["DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"]


def test_messages_held_back_in_a_rank_are_kept_in_the_runs_log(tmp_path):
    """Held before the run directory existed (the process group's set-up) and after: both in third_party.log, once
    the run trains."""
    from finetune import held_back

    logger = logging.getLogger("DeepSpeed")
    with held_back.printed_lines_held(held_back.DEEPSPEED_OP_LOADED):
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
    saved_tracebacks = list(held_back.TRACEBACKS.handlers)
    try:
        held_back.to_log_file(tmp_path / "third_party.log", rank=1)
        logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        # not before the run trains: a run that fails at its start (a full disk) leaves no log file for them
        assert not (tmp_path / "third_party.log").exists()
        held_back.keep_held()
    finally:
        logging.captureWarnings(False)
        for name in ("py.warnings", held_back.KEPT.name):
            for handler in logging.getLogger(name).handlers[:]:
                handler.close()
                logging.getLogger(name).removeHandler(handler)
        logging.getLogger("py.warnings").propagate = True
        held_back.TRACEBACKS.handlers = saved_tracebacks
        from transformers.utils import logging as hf_logging

        hf_logging.enable_progress_bar()
    kept = (tmp_path / "third_party.log").read_text()
    assert "rank 1: held back from the console: DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built" in kept
    assert "rank 1: held back from the console: Setting accelerator to CPU." in kept


def test_handled_errors_tracebacks_go_to_the_run_log_and_a_log_that_cannot_be_written_is_quiet(tmp_path, capsys):
    """Issue 46 item 5: a handled error's library traceback is kept in the run's log file, never on the console; when
    that file cannot be written (the full disk that failed the run, its directory gone) nothing is raised or printed.
    Before: a warning or record after the run directory went raised FileNotFoundError from logging's handler."""
    from finetune import held_back

    warned = logging.getLogger("py.warnings")
    saved = (list(warned.handlers), warned.propagate, list(held_back.TRACEBACKS.handlers))
    try:
        held_back.to_log_file(tmp_path / "run" / "third_party.log", 0)
        (tmp_path / "run").mkdir()
        try:
            raise OSError(28, "No space left on device")
        except OSError as e:
            held_back.TRACEBACKS.error("the export failed", exc_info=e)
        kept = (tmp_path / "run" / "third_party.log").read_text()
        assert "the export failed" in kept and "OSError: [Errno 28] No space left on device" in kept, kept
        held_back.to_log_file(tmp_path / "gone" / "third_party.log", 0)  # a directory that is not there
        held_back.TRACEBACKS.error("the export failed", exc_info=OSError(28, "No space left on device"))
        warnings.warn("a library's warning", UserWarning, stacklevel=1)
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err and "No space" not in out + err, out + err
    finally:
        for handler in warned.handlers:
            handler.close()
        logging.captureWarnings(False)
        warned.handlers, warned.propagate = saved[0], saved[1]
        held_back.TRACEBACKS.handlers = saved[2]
