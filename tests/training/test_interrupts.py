"""Signals as users send them, to the process they send them to (docs/faults.md "Signals"): SIGTERM
to `finetune train` as a container's PID 1 (docker stop, Kubernetes), Ctrl-C twice through `| tee` on
two ranks, SIGHUP (terminal closed) while the model loads, SIGTERM to the rank alone during the
final evaluation.
Each run is the tiny model through `finetune train`, a few steps; a fault injection holds a phase
open (finetune/training/fault_injection.py) so the signal lands inside it however slow the machine.
A signal to one rank of two: tests/training/test_strategies.py::test_sigterm_on_one_rank_....
The runs go two at a time (tests/training/test_faults.py in_lanes): one module fixture runs them, each
test raises its own run's outcome.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import sys
from pathlib import Path

import psutil
import pytest

from finetune.checkpointing import checkpoints
from finetune.errors import EXIT_PREEMPTED
from finetune.launch import rundir
from finetune.training import fault_injection as faults
from tests.conftest import REPO, Started, steps_logged
from tests.training.test_faults import (
    CPU_ENV,
    LANES_TIMEOUT,
    cli_train,
    in_lanes,
    launched,
    outcome_of,
    tiny_args,
)

pytestmark = pytest.mark.integration


def train_command(tiny_model_dir, run_dir: Path, steps: int, *extra: str, ranks: int = 1) -> list[str]:
    launch = (
        ["--recipe", "demo", "--cpu"]
        if ranks == 1
        else ["--recipe", "ddp", "--config_file", "accelerate_configs/cpu/ddp.yaml"]
    )
    return [
        sys.executable,
        "-m",
        "finetune.cli",
        "train",
        *launch,
        *tiny_args(tiny_model_dir, steps),
        *extra,
        f"--run.output_dir={run_dir}",
    ]


def _wrapper(job: Started):
    """The `finetune train` process of the job (python -m finetune.cli; not unshare or bash around it)."""
    return next(p for p in job.processes() if p.cmdline()[1:3] == ["-m", "finetune.cli"])


def _rank(job: Started, rank: int):
    """A rank's process: finetune/train.py with RANK (unset when accelerate launches one process)."""
    ranks = [p for p in job.processes() if any(a.endswith("train.py") for a in p.cmdline())]
    return next(p for p in ranks if p.environ().get("RANK", "0") == str(rank))


def _record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def _complete(run_dir: Path) -> list[str]:
    return [c.name for c in checkpoints.checkpoints(run_dir) if checkpoints.problem(c) is None]


def _docker_stop(tmp_path, tiny_model_dir):
    """`docker stop`: SIGTERM to the container's PID 1, `finetune train` (as root: in a new PID
    namespace, where PID 1 gets no signal it has no handler for; else a plain process). Before:
    the wrapper died at once and the rank trained on alone, orphaned. Now: one console line, every
    rank stops after its step with one complete checkpoint, exit 75, the record `interrupted`."""
    run_dir = tmp_path / "run"
    cmd = train_command(tiny_model_dir, run_dir, 4)
    as_pid_1 = os.geteuid() == 0 and shutil.which("unshare")
    if as_pid_1:
        cmd = ["unshare", "--pid", "--fork", "--mount-proc", *cmd]
    with Started(cmd, cwd=REPO, env={faults.ENV: "pause@rank0,step2"}, out=tmp_path / "out.txt") as job:
        job.wait_until(lambda: steps_logged(run_dir) >= 1, "step 1 logged (rank 0 then holds step 2 open)")
        rank = _rank(job, 0)
        _wrapper(job).send_signal(signal.SIGTERM)
        code = job.finish()
        out = job.output
        assert not rank.is_running() or rank.status() == "zombie", "the rank outlived the launch"
    assert code == EXIT_PREEMPTED, out[-4000:]
    assert out.count("SIGTERM received") == 1 and "Traceback" not in out, out[-4000:]
    summary = _record(run_dir)["summary"]
    assert summary["status"] == "interrupted", summary
    assert "preempted by SIGTERM to finetune train" in summary["error"] and "at step 2" in summary["error"], summary
    assert _complete(run_dir) == ["checkpoint-2"] and checkpoints.checkpoints(run_dir)[-1].name == "checkpoint-2"


def _ctrl_c_twice(tmp_path, tiny_model_dir):
    """`finetune train ... 2>&1 | tee log` on two ranks, Ctrl-C: the terminal sends SIGINT to the
    whole pipeline, so tee dies and the console is gone; Ctrl-C again while checkpoint-2 is being
    written (held open by a fault), and SIGINT to rank 0 itself then too. Before: KeyboardInterrupt
    in the wrapper, BrokenPipeError in the ranks, no checkpoint. Now: exit 75 through the pipe,
    checkpoint-2 complete, the record `interrupted`; the second signals change nothing."""
    run_dir, log = tmp_path / "run", tmp_path / "tee.log"
    line = shlex.join(train_command(tiny_model_dir, run_dir, 4, ranks=2)) + f" 2>&1 | tee {log}"
    script = f"trap : INT; {line}; exit ${{PIPESTATUS[0]}}"  # a shell that reports the wrapper's code
    env = {**CPU_ENV, faults.ENV: "pause@rank0,step2;slow_save@rank0,step2"}
    with launched(["bash", "-c", script], env=env, out=tmp_path / "out.txt") as job:
        job.wait_until(lambda: steps_logged(run_dir) >= 1, "step 1 logged")
        tee = next(p for p in job.processes() if p.name() == "tee")
        rank0 = _rank(job, 0)
        os.killpg(job.proc.pid, signal.SIGINT)  # Ctrl-C: the foreground job, tee included
        job.wait_until(lambda: not tee.is_running() or tee.status() == "zombie", "tee gone")
        job.wait_until(lambda: (run_dir / "checkpoint-2" / "optimizer.pt").exists(), "checkpoint-2 being written")
        os.killpg(job.proc.pid, signal.SIGINT)  # Ctrl-C again, during the save
        with contextlib.suppress(psutil.NoSuchProcess):  # rank 0 may have ended its held save and exited meanwhile
            rank0.send_signal(signal.SIGINT)
        code = job.finish()
    assert code == EXIT_PREEMPTED, (log.read_text()[-3000:], job.output[-3000:])
    summary = _record(run_dir)["summary"]
    assert summary["status"] == "interrupted" and "SIGINT to finetune train" in summary["error"], summary
    assert _complete(run_dir) == ["checkpoint-2"], [c.name for c in checkpoints.checkpoints(run_dir)]
    marker = checkpoints.read_marker(run_dir / "checkpoint-2")
    assert marker["world_size"] == 2 and "optimizer.pt" in marker["files"], marker
    assert "preempted:" not in log.read_text()  # the console was gone when the run ended


def _sighup_while_loading(tmp_path, tiny_model_dir):
    """The terminal closed (SIGHUP to `finetune train`) while the model loads: before, SIGHUP killed
    every process; now the ranks stop before training (nothing to save), exit 75, the record says
    `interrupted` before training, and the same command may start again in the same directory."""
    run_dir = tmp_path / "run"
    cmd = train_command(tiny_model_dir, run_dir, 2)
    with Started(cmd, cwd=REPO, env={faults.ENV: "slow_load@rank0,step1"}, out=tmp_path / "out.txt") as job:
        job.wait_until(lambda: _record(run_dir)["summary"]["status"] == "running", "run.json written")
        _wrapper(job).send_signal(signal.SIGHUP)
        code = job.finish()
        out = job.output
    assert code == EXIT_PREEMPTED, out[-4000:]
    assert out.count("SIGHUP received") == 1 and "Traceback" not in out, out[-4000:]
    assert "nothing was trained; run the same command again" in out, out[-3000:]
    rec = _record(run_dir)
    assert rec["summary"]["status"] == "interrupted" and "before training" in rec["summary"]["error"], rec["summary"]
    assert rec["steps"] == [] and checkpoints.checkpoints(run_dir) == []
    assert "was interrupted before its first step" in rundir.reusable(run_dir)


AFTER_TRAINING = {  # the drill that holds the phase open (rank 0, step 2) -> what the rank says on SIGTERM
    "slow_eval": ("evaluation", "training is done: stopping after a checkpoint of the final step"),
    "slow_export": ("the export", "the model is being exported: stopping once it is written"),
}


def _sigterm_after_training(tmp_path, tiny_model_dir, drill):
    """Training is done, the export (held open at its start) or the evaluation after it (held open) is running:
    SIGTERM to the rank only (`kill` of the train.py process a user finds in `top`) gives a complete checkpoint of
    the final step and exit 75 from `finetune train`, one line, the export written (it comes before the evaluation;
    a signal once it started lets it finish, as the line says); --resume trains nothing more (Trainer alone would
    train one step past max_steps: steps would be 3), exports and evaluates. The signal is sent once the drill's
    hold is on the console: a signal sent as soon as step 2 was logged once landed at the export's start, which then
    stopped without writing model/ while saying it would write it."""
    held, said = AFTER_TRAINING[drill]
    run_dir = tmp_path / "run"
    evaluate = ["--eval.exact_match=true", "--eval.before=false", "--data.demo_heldout_size=4", "--eval.samples=4"]
    cmd = train_command(tiny_model_dir, run_dir, 2, *evaluate)
    with Started(cmd, cwd=REPO, env={faults.ENV: f"{drill}@rank0,step2"}, out=tmp_path / "out.txt") as job:
        job.wait_until(lambda: f"rank 0 holds {held} open" in job.output, f"{held} held open")
        _rank(job, 0).send_signal(signal.SIGTERM)
        code = job.finish()
        out = job.output
    assert code == EXIT_PREEMPTED, out[-4000:]
    assert out.count("SIGTERM received") == 1 and "Traceback" not in out, out[-4000:]
    assert f"SIGTERM received: {said}" in out, out[-4000:]
    summary = _record(run_dir)["summary"]
    assert summary["status"] == "interrupted" and "SIGTERM on rank(s) [0]" in summary["error"], summary
    assert (run_dir / "model" / "adapter_model.safetensors").is_file(), sorted(p.name for p in run_dir.iterdir())
    assert _complete(run_dir) == ["checkpoint-2"]
    args = cmd[cmd.index("train") + 1 : -1]
    code, out, _ = cli_train([*args, "--resume"], run_dir=run_dir, env={})
    assert code == 0, out[-4000:]
    rec = _record(run_dir)
    assert rec["summary"]["status"] == "completed" and rec["summary"]["steps"] == 2, rec["summary"]
    assert [s["step"] for s in rec["steps"]] == [1, 2]
    assert rec["eval"]["details"]["after"]["total"] == 4 and (run_dir / "model" / "adapter_model.safetensors").is_file()


def _sigusr1_as_slurm(tmp_path, tiny_model_dir, target):
    """SLURM's warning before the time limit: `sbatch --signal=USR1@N` signals every process of the job
    step (here `finetune train` and both ranks), `--signal=B:USR1@N` the batch shell alone, which
    runs `finetune train` (here the wrapper alone, one rank). Before: SIGUSR1's default action killed
    every process it reached (exit -10), the wrapper alone exit 138 with the ranks orphaned, and
    run.json stayed `running`. Now: every rank stops after step 2 with a complete checkpoint, exit 75."""
    run_dir = tmp_path / "run"
    ranks = 2 if target == "every process" else 1
    env = {**(CPU_ENV if ranks == 2 else {}), faults.ENV: "pause@rank0,step2"}
    with launched(train_command(tiny_model_dir, run_dir, 4, ranks=ranks), env=env, out=tmp_path / "o") as job:
        job.wait_until(lambda: steps_logged(run_dir) >= 1, "step 1 logged (rank 0 then holds step 2 open)")
        wrapper = _wrapper(job)
        for p in job.processes() if target == "every process" else [wrapper]:
            if p.pid == wrapper.pid or any(a.endswith("train.py") for a in p.cmdline()):
                p.send_signal(signal.SIGUSR1)
        code = job.finish()
        out = job.output
    assert code == EXIT_PREEMPTED, out[-4000:]
    summary = _record(run_dir)["summary"]
    assert summary["status"] == "interrupted" and "preempted by SIGUSR1" in summary["error"], summary
    assert "at step 2" in summary["error"], summary
    assert _complete(run_dir) == ["checkpoint-2"], [c.name for c in checkpoints.checkpoints(run_dir)]
    assert checkpoints.read_marker(run_dir / "checkpoint-2")["world_size"] == ranks


def _sigterm_during_build(tmp_path, tiny_model_dir):
    """SIGTERM to `finetune train` while a 60,000-row file is rendered and tokenized: before, it took
    effect only once the whole build had run (124-144 s after the signal here); now the build checks
    the stop at every row and the run stops before training: exit 75, nothing trained, the build
    never finished (it would log its example count)."""
    import time

    data = tmp_path / "big.jsonl"
    with data.open("w") as f:
        for i in range(60_000):
            f.write(json.dumps({"instruction": f"Add {i} and {i % 7}.", "input": "", "output": str(i + i % 7)}) + "\n")
    run_dir = tmp_path / "run"
    cmd = train_command(tiny_model_dir, run_dir, 2, f"--data.path={data}")
    with Started(cmd, cwd=REPO, env={}, out=tmp_path / "out.txt") as job:
        job.wait_until(lambda: _record(run_dir)["summary"]["status"] == "running", "run.json written")
        time.sleep(2)  # inside the build: reading, rendering and tokenizing 60,000 rows take minutes here
        sent = time.monotonic()
        _wrapper(job).send_signal(signal.SIGTERM)
        code = job.finish()
        print(f"SIGTERM during the data build: exit {code} {time.monotonic() - sent:.1f} s after the signal")
        out = job.output
    assert code == EXIT_PREEMPTED, out[-4000:]
    assert "60000 train" not in out, "the build ran to its end before the stop took effect"
    summary = _record(run_dir)["summary"]
    assert summary["status"] == "interrupted" and "while the data was prepared" in summary["error"], summary
    assert checkpoints.checkpoints(run_dir) == []


# --- the runs, two at a time (tests/training/test_faults.py in_lanes); each test raises its run's outcome --

USR1 = "test_sigusr1_as_slurm_sends_it_checkpoints_and_exits_75"


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, tiny_model_dir):
    def at(scenario, *args):
        return lambda d: scenario(d, tiny_model_dir, *args)

    lanes = [
        [
            (
                "test_sigterm_during_the_final_evaluation_checkpoints_the_last_step_and_resume_only_evaluates",
                at(_sigterm_after_training, "slow_eval"),
            ),
            (
                "test_sigterm_as_the_export_starts_lets_it_finish_then_checkpoints_the_last_step",
                at(_sigterm_after_training, "slow_export"),
            ),
            ("test_ctrl_c_twice_through_tee_on_two_ranks_keeps_one_whole_checkpoint", at(_ctrl_c_twice)),
            (
                "test_sighup_while_the_model_loads_stops_before_training_and_the_directory_is_reusable",
                at(_sighup_while_loading),
            ),
        ],
        [
            (f"{USR1}[every process]", at(_sigusr1_as_slurm, "every process")),
            ("test_docker_stop_sigterm_to_finetune_train_as_pid_1_checkpoints_and_exits_75", at(_docker_stop)),
            (f"{USR1}[the wrapper alone]", at(_sigusr1_as_slurm, "the wrapper alone")),
            ("test_sigterm_during_the_build_of_60000_rows_stops_the_build", at(_sigterm_during_build)),
        ],
    ]
    return in_lanes(request, tmp_path_factory, lanes)


@LANES_TIMEOUT
def test_docker_stop_sigterm_to_finetune_train_as_pid_1_checkpoints_and_exits_75(runs, request):
    outcome_of(runs, request)  # _docker_stop


@LANES_TIMEOUT
def test_ctrl_c_twice_through_tee_on_two_ranks_keeps_one_whole_checkpoint(runs, request):
    outcome_of(runs, request)  # _ctrl_c_twice


@LANES_TIMEOUT
def test_sighup_while_the_model_loads_stops_before_training_and_the_directory_is_reusable(runs, request):
    outcome_of(runs, request)  # _sighup_while_loading


@LANES_TIMEOUT
def test_sigterm_during_the_final_evaluation_checkpoints_the_last_step_and_resume_only_evaluates(runs, request):
    outcome_of(runs, request)  # _sigterm_after_training


@LANES_TIMEOUT
def test_sigterm_as_the_export_starts_lets_it_finish_then_checkpoints_the_last_step(runs, request):
    outcome_of(runs, request)  # _sigterm_after_training


@LANES_TIMEOUT
@pytest.mark.parametrize("target", ["every process", "the wrapper alone"])
def test_sigusr1_as_slurm_sends_it_checkpoints_and_exits_75(runs, request, target):
    outcome_of(runs, request)  # _sigusr1_as_slurm


@LANES_TIMEOUT
def test_sigterm_during_the_build_of_60000_rows_stops_the_build(runs, request):
    outcome_of(runs, request)  # _sigterm_during_build


@pytest.mark.parametrize("ignored_here", [True, False])
def test_commands_start_as_a_terminal_starts_them_whatever_this_process_ignores(tmp_path, ignored_here):
    """The drills' premise (a terminal's Ctrl-C ends a pipeline's tee): a command `Started` begins with SIGINT at its
    default also when this process ignores it (the suite run as a background job). Control: a plain Popen of the same
    command inherits the ignored SIGINT."""
    import subprocess

    show = [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"]
    before = signal.signal(signal.SIGINT, signal.SIG_IGN if ignored_here else signal.default_int_handler)
    try:
        with Started(show, cwd=tmp_path, env={}, out=tmp_path / "out.txt") as job:
            job.proc.wait(60)
            started = job.output.strip()
        plain = subprocess.run(show, capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    finally:
        signal.signal(signal.SIGINT, before)
    assert started == "False" and plain == str(ignored_here), (started, plain)
