"""Faults during training (docs/faults.md): torn checkpoints, a rank that dies, non-finite losses.

Resume equality under every strategy and SIGTERM preemption are in tests/training/test_strategies.py
(they compare against that module's uninterrupted runs). The launches here go through
`finetune train` (finetune/cli/dispatch.py), the command users run, so the exit codes are the ones a
scheduler sees. Fault injection: finetune/training/fault_injection.py.
The launched runs go two at a time (in_lanes, below; the other launched fault tests use it too).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from finetune.checkpointing import checkpoints
from finetune.errors import EXIT_NONFINITE, UserError
from finetune.training import fault_injection as faults
from tests.conftest import REPO, Started, continue_record, save_record

CPU_ENV = {"FINETUNE_CPU_DISTRIBUTED": "1"}
_LAUNCHING = threading.Lock()


@contextlib.contextmanager
def launched(cmd: list[str], *, env: dict, out: Path, cwd: Path = REPO):
    """`Started`, one launch at a time from its start until its ranks exist: two launches at once would both find
    accelerate's default rendezvous port (29500) free and then both bind it (seen: EADDRINUSE)."""
    with _LAUNCHING:
        job = Started(cmd, cwd=cwd, env=env, out=out)
        try:
            deadline = time.monotonic() + 300
            while job.proc.poll() is None and time.monotonic() < deadline and not _ranks_started(job):
                time.sleep(0.2)
        except BaseException:  # interrupted while waiting: the launch is killed as on leaving the block below
            job.__exit__(None, None, None)
            raise
    with job:
        yield job


def _ranks_started(job: Started) -> bool:
    import psutil

    try:  # a rank runs finetune/train.py; `finetune train` binds the port before it starts one
        cmdlines = [p.cmdline() for p in job.processes()[1:]]
    except psutil.Error:
        return False
    return any(any(a.endswith("train.py") for a in c) and "accelerate.commands.launch" not in c for c in cmdlines)


def cli_train(args: list[str], *, run_dir: Path, env: dict, timeout: float = 420) -> tuple[int, str, Path]:
    """`python -m finetune.cli train ARGS --run.output_dir=RUN_DIR` in its own process group; on
    timeout the group is killed and the test fails; a launcher killed by a signal fails it too."""
    cmd = [sys.executable, "-m", "finetune.cli", "train", *args, f"--run.output_dir={run_dir}"]
    fd, out_file = tempfile.mkstemp(suffix=".out.txt")
    os.close(fd)
    try:
        with launched(cmd, env=env, out=Path(out_file)) as job:
            code = job.finish(timeout=timeout)
            out = job.output
    finally:
        os.unlink(out_file)
    if code < 0:
        pytest.fail(f"launcher killed by signal {-code}: {' '.join(cmd)}\n{out[-3000:]}")
    return code, out, run_dir


def in_lanes(request, tmp_path_factory, lanes: list[list]) -> dict:
    """A module's launched scenarios (test name -> function of a fresh directory), each lane in order
    and the lanes at once: a launch spends much of its time in one process (imports, the launcher)
    or waiting (a held phase, a timeout), so two fill a 2-core machine. Only the scenarios of tests
    this session runs; each outcome (None, or what the scenario raised) for its test to raise again."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    wanted = {name for lane in lanes for name, _ in lane} & selected
    started = request.module.__dict__.setdefault("_in_lanes_started", set())
    if started & wanted:  # pytest sets the fixture up again after a failed setup (its timeout): no second copy
        pytest.fail(f"the runs of {request.module.__name__} were interrupted in an earlier test's setup")
    started |= wanted
    outcomes: dict = {}

    def run(lane):
        for name, scenario in lane:
            if name in wanted:
                try:
                    scenario(tmp_path_factory.mktemp(re.sub(r"\W+", "_", name)[:40]))
                    outcomes[name] = None
                except BaseException as e:  # noqa: BLE001 - raised again by the scenario's test
                    outcomes[name] = e

    threads = [threading.Thread(target=run, args=(lane,)) for lane in lanes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


# A module's runs all happen in the setup of its first test: more than the suite's 900 s per test; every
# launch keeps its own timeout, after which its process group is killed.
LANES_TIMEOUT = pytest.mark.timeout(1800)


def outcome_of(outcomes: dict, request) -> None:
    """The scenario of this test passed, or what it raised is raised here."""
    error = outcomes[request.node.name]
    if error is not None:
        raise error


def tiny_args(tiny_model_dir, steps: int) -> list[str]:
    return [
        f"--model.name_or_path={tiny_model_dir}",
        "--data.demo_train_size=64",
        "--eval.exact_match=false",
        f"--training.max_steps={steps}",
        "--training.logging_steps=1",
        "--training.warmup_steps=0",
        "--training.learning_rate=1e-3",
        "--training.lr_scaling=none",
        "--training.seed=42",
        "--training.per_device_train_batch_size=4",
        "--method.lora_dropout=0.0",
    ]


# --- checkpoint validity and rotation (no training) ---------------------------------------------


def _fake_checkpoint(run_dir: Path, step: int, *, complete: bool = True) -> Path:
    ckpt = run_dir / f"checkpoint-{step}"
    (ckpt / "global_step").mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (ckpt / "global_step" / "shard_0.pt").write_bytes(b"x" * 1000)
    if complete:
        checkpoints.write_marker(ckpt, step=step, world_size=2)
    return ckpt


def test_truncated_newest_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path, caplog):
    _fake_checkpoint(tmp_path, 2)
    newest = _fake_checkpoint(tmp_path, 4)
    (newest / "global_step" / "shard_0.pt").write_bytes(b"x" * 10)  # truncated after the save
    _fake_checkpoint(tmp_path, 6, complete=False)  # killed while saving: no marker
    with caplog.at_level("WARNING", logger="finetune"):
        assert checkpoints.newest_valid(tmp_path) == tmp_path / "checkpoint-2"
    warned = caplog.text
    assert "checkpoint-6" in warned and "no finetune-checkpoint-complete.json" in warned, warned
    assert "checkpoint-4" in warned and "shard_0.pt is 10 bytes, 1000 when saved" in warned, warned


def test_no_complete_checkpoint_is_a_clear_user_error(tmp_path):
    _fake_checkpoint(tmp_path, 3, complete=False)
    with pytest.raises(UserError, match=r"no complete checkpoint in .*checkpoint-3 \(no finetune-checkpoint"):
        checkpoints.resolve("auto", tmp_path)
    with pytest.raises(UserError, match="no checkpoint-<step> directory"):
        checkpoints.resolve("auto", tmp_path / "checkpoint-3" / "global_step")
    with pytest.raises(UserError, match="run directory .* does not exist"):
        checkpoints.resolve("auto", tmp_path / "missing")
    with pytest.raises(UserError, match="cannot resume from this checkpoint: no finetune-checkpoint"):
        checkpoints.resolve(str(tmp_path / "checkpoint-3"), tmp_path)


def test_rotation_keeps_complete_checkpoints_and_never_the_new_one_alone(tmp_path):
    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 4, complete=False)  # torn: nothing can resume from it
    newest = _fake_checkpoint(tmp_path, 5)
    deleted = checkpoints.rotate(tmp_path, 2, newest)
    assert sorted(p.name for p in deleted) == ["checkpoint-1", "checkpoint-2", "checkpoint-4"]
    assert [p.name for p in checkpoints.checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-5"]
    assert checkpoints.rotate(tmp_path, None, newest) == []


def test_resumed_record_keeps_steps_up_to_the_checkpoint(tmp_path):
    from finetune.telemetry.record import RunRecord

    old = RunRecord(tmp_path / "run.json", run_name="r", recipe="ddp", config={})
    old.set("steps", [{"step": s, "loss": 10.0 - s} for s in range(1, 6)])
    old.update("summary", status="interrupted")
    save_record(old)
    ckpt = _fake_checkpoint(tmp_path, 3)
    for n in (1, 2):
        rec = RunRecord(tmp_path / "run.json", run_name="r", recipe="ddp", config={})
        continue_record(rec, tmp_path, ckpt)
        got = rec.view
        assert [s["step"] for s in got.get("steps")] == [1, 2, 3]
        assert got.get("summary", "resumes") == n and got.get("summary", "resumed_from") == str(ckpt)
        assert got.get("summary", "resume_history")[0]["steps_discarded"] == 2
        assert got.get("created") == old.view.get("created")
        save_record(rec)
    from finetune.checkpointing import resume_plan
    from finetune.config.recipe import load_recipe

    cfg = load_recipe("ddp", [f"--run.output_dir={tmp_path}"])[0]
    cfg.run.overwrite = True
    with pytest.raises(UserError, match="--resume and --overwrite"):
        resume_plan.locate(cfg, "auto")


def test_fault_injection_spec_is_parsed_or_refused(monkeypatch):
    monkeypatch.setenv(faults.ENV, "nan_loss@rank1,step3;kill@rank0,step2")
    faults.faults.cache_clear()
    assert faults.faults() == (("nan_loss", 1, 3), ("kill", 0, 2))
    monkeypatch.setenv(faults.ENV, "nan@rank1")
    faults.faults.cache_clear()
    with pytest.raises(UserError, match="expected KIND@rankR,stepS"):
        faults.faults()
    faults.faults.cache_clear()


def test_a_pause_holds_only_its_rank_and_step_open_then_returns(monkeypatch):
    """The external-SIGTERM test (tests/training/test_strategies.py) relies on this window."""
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setenv(faults.ENV, "pause@rank0,step2")
    faults.faults.cache_clear()
    try:
        for rank, step in ((1, 2), (0, 1), (0, 3)):
            faults.at_step_begin(rank=rank, step=step)
        assert slept == []
        faults.at_step_begin(rank=0, step=2)
        assert slept == [faults.PAUSE_S] and faults.PAUSE_S >= 1
    finally:
        faults.faults.cache_clear()


# --- launched runs -------------------------------------------------------------------------------


def _killed_rank(tmp_path, tiny_model_dir):
    """Rank 1 SIGKILLs itself at step 2: the job ends (well inside the harness timeout) non-zero,
    the failed rank named by the launcher; the surviving rank's record says failed."""
    code, out, run_dir = cli_train(
        [
            "--recipe",
            "ddp",
            "--config_file",
            "accelerate_configs/cpu/ddp.yaml",
            *tiny_args(tiny_model_dir, 5),
            "--training.ddp_timeout=60",
        ],
        run_dir=tmp_path / "run",
        env={**CPU_ENV, faults.ENV: "kill@rank1,step2"},
        timeout=300,
    )
    assert code == 1, out[-4000:]
    assert "[fault injection] rank 1 kills itself (SIGKILL) at step 2" in out
    assert "finetune: rank 1 (local rank 1" in out and "failed: killed by SIGKILL" in out, out[-4000:]
    assert "closing signal SIGTERM" not in out, out[-4000:]  # torchrun's, stopping rank 0 (issue 43)
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["summary"]["status"] == "failed" and "gloo" in rec["summary"]["error"], rec["summary"]
    assert rec["strategy"]["name"] == "ddp" and rec["strategy"]["world_size"] == 2


def _stopped_rank(tmp_path, tiny_model_dir):
    """SIGSTOP to rank 1 after step 1 (rank 0 holds step 2 open meanwhile): rank 0's collective
    times out after training.ddp_timeout. Before: rank 0 was reported as the first failure and rank
    1 only as killed by SIGKILL. Now rank 1 is named as the rank that stopped making progress (its
    heartbeats ended), rank 0's failure as a consequence, and rank 0's record names rank 1.
    ddp_timeout 15 s: rank 1's silence lasts at least that long, above peers.STALL_S (10 s). torchrun then
    SIGKILLs the stopped rank 30 s after its SIGTERM (torch's fixed wait when a rank failed, docs/faults.md)."""
    from tests.conftest import steps_logged
    from tests.training.test_interrupts import _rank, train_command

    run_dir = tmp_path / "run"
    cmd = train_command(tiny_model_dir, run_dir, 4, "--training.ddp_timeout=15", ranks=2)
    env = {**CPU_ENV, faults.ENV: "pause@rank0,step2"}
    with launched(cmd, env=env, out=tmp_path / "out.txt") as job:
        job.wait_until(lambda: steps_logged(run_dir) >= 1, "step 1 logged")
        _rank(job, 1).send_signal(signal.SIGSTOP)
        code = job.finish(timeout=400)
        out = job.output
    assert code == 1, out[-4000:]
    assert "finetune: rank 1 stopped making progress: its last heartbeat came" in out, out[-4000:]
    assert "failed: killed by SIGKILL (stalled: the cause)" in out, out[-4000:]
    assert "finetune: rank 0 (local rank 0" in out and "(a consequence: it waited for rank(s) [1])" in out
    summary = json.loads((run_dir / "run.json").read_text())["summary"]
    assert summary["status"] == "failed" and "rank(s) [1] on node" in summary["error"], summary
    # our lines only: rank 0's gloo timeout is said in its one line, its traceback kept in the run's log
    assert "Traceback" not in out and "Unable to shutdown process" not in out, out[-4000:]
    assert f"; traceback: {run_dir / 'third_party.log'}). Continue" in out, out[-4000:]
    kept = (run_dir / "third_party.log").read_text()
    assert "rank 0: this rank's error, after rank(s) [1] on node" in kept and "Traceback" in kept, kept[-3000:]


def _adapter(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "adapter_model.safetensors"))


def _nonfinite_skipped(tmp_path, tiny_model_dir):
    """DDP, a checkpoint every step, on_nonfinite=skip with a limit of 1: rank 1's NaN loss at step 2
    is skipped on both ranks (the step-2 weights equal the step-1 weights), step 3 trains, rank 0's
    NaN at step 4 is over the limit: both ranks stop before step 4's update, exit 3, record
    failed naming step 4 and rank 0, checkpoint-3 kept complete."""
    code, out, run_dir = cli_train(
        [
            "--recipe",
            "ddp",
            "--config_file",
            "accelerate_configs/cpu/ddp.yaml",
            *tiny_args(tiny_model_dir, 5),
            "--training.save_strategy=steps",
            "--training.save_steps=1",
            "--training.on_nonfinite=skip",
            "--training.max_nonfinite_skips=1",
        ],
        run_dir=tmp_path / "run",
        env={**CPU_ENV, faults.ENV: "nan_loss@rank1,step2;nan_loss@rank0,step4"},
    )
    assert code == EXIT_NONFINITE, out[-4000:]
    assert "non-finite loss at step 4 on rank(s) [0]" in out, out[-4000:]
    rec = json.loads((run_dir / "run.json").read_text())
    s = rec["summary"]
    assert s["status"] == "failed" and "step 4" in s["error"] and "rank(s) [0]" in s["error"], s
    assert s["nonfinite_skipped"] == [{"step": 2, "what": "loss", "ranks": [1]}], s
    assert [x["step"] for x in rec["steps"]] == [1, 2, 3]
    assert rec["strategy"]["name"] == "ddp" and rec["strategy"]["world_size"] == 2
    assert [c.name for c in checkpoints.checkpoints(run_dir)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert all(checkpoints.problem(c) is None for c in checkpoints.checkpoints(run_dir))
    w1, w2, w3 = (_adapter(run_dir / f"checkpoint-{k}") for k in (1, 2, 3))
    assert all((w1[k] == w2[k]).all() for k in w1), "the skipped step changed the weights"
    assert any((w2[k] != w3[k]).any() for k in w2), "step 3 should have trained"


def _out_of_memory(tmp_path, tiny_model_dir):
    """DDP rank 1 runs out of GPU memory at step 2 (fault injection raises torch.OutOfMemoryError, CUDA's words): it
    says so in one line with the levers and this recipe's values, no traceback on the console (it is in the run's
    log); rank 0, whose collective fails for it, names that rank's memory as why it stops, and run.json (rank 0's)
    fails with rank 1's line, not "stopped answering"; exit 1. Every rank out of memory at once (equal shapes) is
    the same path: each says its own line, rank 0's is the record's."""
    code, out, run_dir = cli_train(
        ["--recipe", "ddp", "--config_file", "accelerate_configs/cpu/ddp.yaml", *tiny_args(tiny_model_dir, 4)],
        run_dir=tmp_path / "run",
        env={**CPU_ENV, faults.ENV: "oom@rank1,step2"},
    )
    assert code == 1, out[-4000:]
    assert "finetune: rank 1 ran out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB." in out
    assert "training.per_device_train_batch_size (now 4)" in out and "data.max_length (now 128)" in out, out[-4000:]
    assert "`finetune plan --recipe ddp` predicts the peak per GPU" in out, out[-4000:]
    assert "finetune: rank 0 stops: rank(s) [1] ran out of GPU memory (said above; traceback: " in out, out[-4000:]
    assert "Traceback" not in out and "OutOfMemoryError" not in out and "stopped answering" not in out, out[-4000:]
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["strategy"]["name"] == "ddp" and rec["strategy"]["world_size"] == 2, rec["strategy"]
    s = rec["summary"]
    assert s["status"] == "failed" and s["error"].startswith("rank 1 ran out of GPU memory (CUDA out of memory."), s
    kept = (run_dir / "third_party.log").read_text()
    assert "torch.OutOfMemoryError: CUDA out of memory" in kept and "Traceback" in kept, kept[-3000:]


def _left_by_out_of_memory(tmp_path, tiny_model_dir):
    """Rank 1 runs out of GPU memory at step 2 while rank 0 stays where it is (the `hang` fault: on a GPU, NCCL's
    collective waits on a peer that is gone, where gloo fails at once): rank 0's watchdog ends it LEFT_S after rank 1
    told, naming rank 1, and records rank 1's line in run.json; without it rank 0 waited until torchrun's SIGKILL
    (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 300 s here) and its run.json stayed `running`."""
    code, out, run_dir = cli_train(
        ["--recipe", "ddp", "--config_file", "accelerate_configs/cpu/ddp.yaml", *tiny_args(tiny_model_dir, 4)],
        run_dir=tmp_path / "run",
        env={**CPU_ENV, faults.ENV: "oom@rank1,step2;hang@rank0,step2"},
        timeout=240,
    )
    assert code == 1, out[-4000:]
    assert "finetune: rank 1 ran out of GPU memory (CUDA out of memory." in out, out[-4000:]
    assert "finetune: stuck: rank 0 was left by rank 1 (it ran out of GPU memory, said above)" in out, out[-4000:]
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["strategy"]["name"] == "ddp" and rec["strategy"]["world_size"] == 2, rec["strategy"]
    s = rec["summary"]
    assert s["status"] == "failed" and s["error"].startswith("rank 1 ran out of GPU memory (CUDA out of memory."), s


# What other programs printed on `finetune train`'s console before issue 43 (the launcher: torchrun, accelerate; the
# ranks: DeepSpeed), each held back at its source now (finetune/held_back.py).
THIRD_PARTY_LAUNCH_LINES = (
    "Setting OMP_NUM_THREADS",  # torchrun's notice on DeepSpeed launches
    "built successfully",  # DeepSpeed's CPU communication op, once per rank
    "Setting accelerator to CPU",  # DeepSpeed's, in the launcher and every rank
    "closing signal SIGTERM",  # torchrun's, after the run's own exit line
    "had defaults used instead",  # accelerate's notice of the launch values it chose
    "ChildFailedError",  # torchrun's report of a failed rank: `finetune train` names the failed ranks itself
    "is already in use",  # accelerate's note that another job holds the default port
)


def _nonfinite_deepspeed(tmp_path, tiny_model_dir):
    """ZeRO-2 runs the optimizer step inside backward, so the loss is checked (and agreed) before
    it: rank 1's NaN at step 3 stops both ranks with the step and rank named."""
    code, out, run_dir = cli_train(
        [
            "--recipe",
            "zero2",
            "--config_file",
            "accelerate_configs/cpu/zero2.yaml",
            *tiny_args(tiny_model_dir, 4),
            "--training.save_strategy=steps",
            "--training.save_steps=2",
            "--training.max_grad_norm=1.0",
        ],
        run_dir=tmp_path / "run",
        env={**CPU_ENV, faults.ENV: "nan_loss@rank1,step3"},
    )
    assert code == EXIT_NONFINITE, out[-4000:]
    # `finetune train` of a DeepSpeed recipe on CPU: only our lines (issue 43), the ranks' held ones in the run's log
    for theirs in THIRD_PARTY_LAUNCH_LINES:
        assert theirs not in out, (theirs, out[-4000:])
    assert "held back from the console: DeepSpeed deepspeed.ops" in (run_dir / "third_party.log").read_text()
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["strategy"]["name"] == "zero2" and rec["strategy"]["evidence"]["zero_stage"] == 2, rec["strategy"]
    assert "non-finite loss at step 3 on rank(s) [1]" in rec["summary"]["error"], rec["summary"]
    assert [x["step"] for x in rec["steps"]] == [1, 2]
    assert [c.name for c in checkpoints.checkpoints(run_dir)] == ["checkpoint-2"]
    assert checkpoints.problem(run_dir / "checkpoint-2") is None


def test_signal_handler_records_and_a_second_signal_is_ignored(capfd):
    """SIGINT/SIGTERM/SIGHUP are recorded, not raised (no KeyboardInterrupt mid-save); restored afterwards."""
    import time

    from finetune.training import signals

    # What SIGINT was before: Python's default_int_handler in a terminal, SIG_IGN when the suite runs as a
    # background job of a non-interactive shell (POSIX ignores SIGINT for those), or the recording handler of a
    # trainer an earlier test built in this process.
    before = signal.getsignal(signal.SIGINT)
    stops = signals.Stops()
    stops.install()
    stops.set_stage(signals.TRAINING)
    try:
        assert signal.getsignal(signal.SIGINT) not in (before, signal.default_int_handler, signal.SIG_IGN)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            os.kill(os.getpid(), sig)
            time.sleep(0.1)  # Python runs the handler at the next bytecode boundary
        assert stops.received == [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2]
        assert stops.code() == signal.SIGINT and stops.describe([0, stops.code()]) == {
            "signal": "SIGINT",
            "ranks": [1],
            "relayed_by": None,
        }
    finally:
        stops.restore()
    err = capfd.readouterr().err
    assert "SIGINT received: stopping at the end of this optimizer step" in err, err
    assert "SIGTERM received again: ignored" in err and "SIGUSR2 received again: ignored" in err, err
    assert signal.getsignal(signal.SIGINT) is before  # restored, whatever it was


def test_a_process_forked_from_a_rank_dies_of_sigterm_while_the_rank_records_it():
    """datasets' map pool, its manager and DataLoader workers are forked from a rank: multiprocessing's
    Pool.terminate() SIGTERMs the workers and joins them, so a worker that kept the rank's recording handler
    held the rank forever (a pool worker of a suite run was found alive, catching SIGTERM, 27 min after its
    rank had been ended by the watchdog). The rank itself still records the signal (the control)."""
    import time

    from finetune.training import signals

    # as a rank starts: SIGTERM's default action (a trainer an earlier test built here left its recording handler,
    # which this process's fork hooks would hand the child otherwise)
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    stops = signals.Stops()
    stops.install()
    recording = signal.getsignal(signal.SIGTERM)
    try:
        assert recording not in (signal.SIG_DFL, signal.SIG_IGN, None)
        pid = os.fork()
        if pid == 0:  # the child: SIGTERM must end it before it reaches _exit(0)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(2)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
        assert signal.getsignal(signal.SIGTERM) is recording  # the rank still records it
    finally:
        stops.restore()
        signal.signal(signal.SIGTERM, before)


def test_stop_signals_left_out_of_the_setting_keep_their_default_action():
    """training.stop_signals: SIGUSR1 and SIGUSR2 (a scheduler's warning) are stops by default; a
    recipe that leaves them out gets their previous (default) action back, in the ranks and in the
    `finetune train` wrapper alike (signals.Stops.keep_only, relay.Relay.keep_only)."""
    from finetune.launch import relay
    from finetune.training import signals

    before = signal.getsignal(signal.SIGUSR1)
    stops = signals.Stops()
    stops.install()
    try:
        assert signal.getsignal(signal.SIGUSR1) not in (before, signal.SIG_DFL)
        stops.keep_only(["SIGTERM", "SIGINT", "SIGHUP"], grace_s=30.0)
        stops.install()  # again, as the trainer does: still left out
        assert signal.getsignal(signal.SIGUSR1) is before and signal.getsignal(signal.SIGUSR2) is not None
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)  # still a stop
        assert stops.watch.grace_s == 30.0  # training.stop_grace, for the watchdog
    finally:
        stops.restore()
    with relay.Relay() as wrapper:
        assert signal.getsignal(signal.SIGUSR2) == wrapper._handler
        wrapper.keep_only(["SIGTERM"])
        assert (
            signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL and signal.getsignal(signal.SIGTERM) == wrapper._handler
        )
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


def test_a_signal_relayed_by_finetune_train_is_recorded_silently(tmp_path, monkeypatch, capfd):
    """The wrapper said it on the console already: the rank records it (and by whom) without a line;
    one sent to the rank directly afterwards is said."""
    import json
    import time

    from finetune.launch import relay
    from finetune.training import signals

    monkeypatch.setenv(relay.ENV, str(tmp_path))
    (tmp_path / relay.RELAYED).write_text(json.dumps({"signal": "SIGTERM", "pid": 4321}))
    stops = signals.Stops()
    stops.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert capfd.readouterr().err == ""
        stop = stops.describe([stops.code(), stops.code()])
        assert stop == {"signal": "SIGTERM", "ranks": [0, 1], "relayed_by": 4321}, stop
        assert signals.cause(stop) == "SIGTERM to finetune train (pid 4321), relayed to every rank"
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert "SIGTERM received again: ignored" in capfd.readouterr().err
    finally:
        stops.restore()


def test_finetune_train_passes_resume_through_to_train_py():
    from finetune.config.command_line import parse_train_args
    from finetune.launch.accelerate import launch_command

    auto = launch_command("ddp", ["--training.max_steps=3"], None, None, resume="auto")
    path = launch_command("ddp", [], None, None, resume="runs/x/checkpoint-2")
    assert auto[-2:] == ["--resume", "--training.max_steps=3"], auto
    assert "--resume=runs/x/checkpoint-2" in path and "--resume" not in path
    assert parse_train_args(["--recipe", "ddp", "--resume"])[0].resume == "auto"
    assert parse_train_args(["--recipe", "ddp", "--resume=runs/x/checkpoint-2"])[0].resume == "runs/x/checkpoint-2"
    assert parse_train_args(["--recipe", "ddp"])[0].resume is None


def test_fault_settings_are_validated_with_allowed_values():
    from finetune.config.recipe import load_recipe
    from finetune.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_recipe(
            "ddp",
            [
                "--training.on_nonfinite=ignore",
                "--training.max_nonfinite_skips=-1",
                "--training.enable_jit_checkpoint=true",
                "--training.stop_signals=[SIGTERM,SIGKILL]",
                "--training.stop_grace=0",
            ],
        )
    msg = str(err.value)
    assert (
        "training.stop_signals: got ['SIGTERM', 'SIGKILL']; allowed: a list of SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2"
        in msg
    )
    assert "training.stop_grace: must be >= 1 s, got 0" in msg, msg
    assert "training.on_nonfinite: got 'ignore'; allowed: stop, skip" in msg, msg
    assert "training.max_nonfinite_skips: must be >= 0, got -1" in msg, msg
    assert "training.enable_jit_checkpoint: not supported" in msg, msg
    cfg, _ = load_recipe("ddp", [])
    assert cfg.training.on_nonfinite == "stop" and cfg.training.args["ddp_timeout"] == 1800
    assert cfg.training.stop_signals == ["SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2"]


@pytest.mark.parametrize(
    "codes, expected",
    [
        ({0: 3, 1: -15}, 3),  # rank 0 stopped on a NaN first; torchrun SIGTERMed rank 1
        ({0: -15, 1: 75}, 75),  # preempted: one rank exited 75, the other was shut down
        ({0: 3, 1: 3}, 3),
        ({0: 1, 1: 3}, 1),  # two different real failures: no single meaning
        ({0: -9, 1: -15}, 1),  # a rank killed outright
    ],
)
def test_launcher_exit_code_is_the_ranks_real_one_not_torchruns_shutdown(codes, expected, capsys):
    from types import SimpleNamespace

    from finetune.launch.accelerate import report_failed_ranks

    failures = {
        rank: SimpleNamespace(exitcode=code, timestamp=rank, local_rank=rank, pid=100 + rank)
        for rank, code in codes.items()
    }
    assert report_failed_ranks(failures) == expected
    err = capsys.readouterr().err
    if expected == 75:  # preempted: no failure; rank 0 printed the checkpoint and the resume command
        assert err == "", err
    else:
        assert all(f"rank {rank} (local rank {rank}, pid {100 + rank}) failed" in err for rank in codes)


def _watchdog(tmp_path, tiny_model_dir):
    """Rank 1 enters a barrier no other rank enters during the evaluation after training (fault
    injection: the kind of bug that hung tensor parallelism's export), so rank 0 waits in the agreement
    after it: no progress. Before, both waited until training.ddp_timeout (30 min by default; the
    run.json said `running` all along). Now the watchdog ends them after training.finish_timeout (here
    15 s) naming each rank's collective, run.json `failed` with that cause and the newest complete
    checkpoint, kept; exit 1."""
    run_dir = tmp_path / "run"
    code, out, _ = cli_train(
        [
            "--recipe",
            "ddp",
            "--config_file",
            "accelerate_configs/cpu/ddp.yaml",
            *tiny_args(tiny_model_dir, 2),
            "--data.demo_train_size=32",
            "--training.save_strategy=steps",
            "--training.save_steps=1",
            "--training.finish_timeout=15",
        ],
        run_dir=run_dir,
        env={**CPU_ENV, faults.ENV: "stray_collective@rank1,step2"},
        timeout=300,
    )
    assert code == 1, out[-4000:]
    assert "[fault injection] rank 1 enters a barrier no other rank enters" in out, out[-4000:]
    s = json.loads((run_dir / "run.json").read_text())["summary"]
    assert s["status"] == "failed" and s["error"].startswith("stuck: rank "), s
    assert "made no progress in the evaluation" in s["error"], s
    assert "the ranks' agreement (the evaluation)" in s["error"], s  # what rank 0 waits in
    assert "torch.distributed barrier (called from finetune/training/fault_injection.py" in s["error"], s  # rank 1
    assert s["checkpoint"] == str(run_dir / "checkpoint-2") and checkpoints.problem(run_dir / "checkpoint-2") is None
    assert [c.name for c in checkpoints.checkpoints(run_dir)] == ["checkpoint-1", "checkpoint-2"]
    assert "finetune: stuck: rank" in out, out[-4000:]


def test_a_killed_one_process_run_exits_1_naming_the_signal(tmp_path, tiny_model_dir):
    """The one process of a single-device run SIGKILLs itself at step 3: `finetune train` exits 1 naming the signal,
    as it names a killed rank of many (it exited 247, -9 as a byte, without a word); its checkpoint-2 is complete
    (finetune export takes it: docs/usage.md "Export")."""
    run_dir = tmp_path / "run"
    args = ["--recipe", "demo", *tiny_args(tiny_model_dir, 4), "--training.save_strategy=steps"]
    args += ["--training.save_steps=2"]
    code, out, _ = cli_train(args, run_dir=run_dir, env={faults.ENV: "kill@rank0,step3"}, timeout=300)
    assert code == 1, out[-4000:]
    assert "finetune: rank 0 (the one process) failed: killed by SIGKILL" in out, out[-4000:]
    assert [c.name for c in checkpoints.checkpoints(run_dir)] == ["checkpoint-2"]
    assert checkpoints.problem(run_dir / "checkpoint-2") is None


# --- the launched runs, two at a time (in_lanes); each test raises its run's outcome ------------------


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, tiny_model_dir):
    def at(scenario):
        return lambda d: scenario(d, tiny_model_dir)

    # the stall alone: a rank's heartbeats, starved by another launch's ranks, would look stalled too
    alone = [[("test_a_stopped_rank_is_named_as_the_one_that_stalled", at(_stopped_rank))]]
    lanes = [
        [
            ("test_a_rank_held_in_a_collective_after_training_is_ended_by_the_watchdog", at(_watchdog)),
            ("test_a_killed_rank_ends_the_job_naming_it", at(_killed_rank)),
            ("test_a_rank_left_waiting_by_one_out_of_memory_is_ended_naming_it", at(_left_by_out_of_memory)),
        ],
        [
            ("test_nonfinite_loss_under_deepspeed_stops_before_the_engine_steps", at(_nonfinite_deepspeed)),
            ("test_nonfinite_loss_on_one_rank_is_skipped_then_stops_both_ranks", at(_nonfinite_skipped)),
            ("test_a_gpu_out_of_memory_is_said_in_one_line_with_what_makes_a_step_fit", at(_out_of_memory)),
        ],
    ]
    return {**in_lanes(request, tmp_path_factory, alone), **in_lanes(request, tmp_path_factory, lanes)}


@LANES_TIMEOUT
@pytest.mark.integration
def test_a_killed_rank_ends_the_job_naming_it(runs, request):
    outcome_of(runs, request)  # _killed_rank


@LANES_TIMEOUT
@pytest.mark.integration
def test_a_stopped_rank_is_named_as_the_one_that_stalled(runs, request):
    outcome_of(runs, request)  # _stopped_rank


@LANES_TIMEOUT
@pytest.mark.integration
def test_nonfinite_loss_on_one_rank_is_skipped_then_stops_both_ranks(runs, request):
    outcome_of(runs, request)  # _nonfinite_skipped


@LANES_TIMEOUT
@pytest.mark.integration
def test_nonfinite_loss_under_deepspeed_stops_before_the_engine_steps(runs, request):
    outcome_of(runs, request)  # _nonfinite_deepspeed


@LANES_TIMEOUT
@pytest.mark.integration
def test_a_rank_held_in_a_collective_after_training_is_ended_by_the_watchdog(runs, request):
    outcome_of(runs, request)  # _watchdog


@LANES_TIMEOUT
@pytest.mark.integration
def test_a_gpu_out_of_memory_is_said_in_one_line_with_what_makes_a_step_fit(runs, request):
    outcome_of(runs, request)  # _out_of_memory


@LANES_TIMEOUT
@pytest.mark.integration
def test_a_rank_left_waiting_by_one_out_of_memory_is_ended_naming_it(runs, request):
    outcome_of(runs, request)  # _left_by_out_of_memory
