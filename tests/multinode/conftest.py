"""Fixtures of the two-node tests: the SLURM cluster (tests/multinode/cluster.py), started once per
session and stopped by PID at its end, also when a test failed; and job helpers around it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port
from tests.multinode.cluster import CannotRun, Cluster
from tests.training.test_faults import tiny_args

SCRIPT = "accelerate_configs/slurm_two_node.sbatch"
REQUIRED = "FINETUNE_REQUIRE_SLURM"  # set (by .ci/run): a machine that cannot host the cluster fails, not skips
# The README's rehearsal options: no GPU on the nodes, one CPU per task (the nodes have two each).
CPU_NODES = ["--gpus-per-node=0", "--cpus-per-task=1"]
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except CannotRun as e:
        if os.environ.get(REQUIRED):  # CI: root on Debian, where the cluster must run
            pytest.fail(f"{REQUIRED} is set but no SLURM cluster can run here: {e}")
        pytest.skip(f"no SLURM cluster on this machine: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()


def job_args(model_dir: Path, *, steps: int = 6) -> list[str]:
    """A tiny ZeRO-3 LoRA run: effective batch 8 = 4 per device x 2 ranks, fp32 (the CPU's policy),
    a step per log so every loss is recorded, no dropout (the losses continue exactly on resume), the
    adapter exported at the end (the default)."""
    return tiny_args(model_dir, steps)


class Jobs:
    """sbatch the shipped script on the cluster and watch its jobs (the submit directory is given:
    runs/ lands there when no --run.output_dir is)."""

    def __init__(self, cluster: Cluster, log_dir: Path):
        self.cluster, self.log_dir = cluster, log_dir

    def submit(
        self, *args: str, sbatch: list[str] = (), env: dict | None = None, cwd: Path = REPO, port: bool = True
    ) -> str:
        """`port`: pass a free MASTER_PORT (else the script derives one from the job id)."""
        cmd = ["sbatch", "--parsable", f"--output={self.log_dir}/job-%j.out", *CPU_NODES, *sbatch, SCRIPT, *args]
        full_env = {
            **{k: v for k, v in self.cluster.env.items() if k != "MASTER_PORT"},
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **({"MASTER_PORT": str(free_port())} if port else {}),
            **(env or {}),
        }
        p = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, f"sbatch failed: {p.stderr}"
        return p.stdout.strip().split(";")[0]

    def wait(self, job_id: str, timeout: float = 480) -> dict:
        """The job's final `scontrol show job` fields (polled every 0.5 s); fails on timeout after
        cancelling the job, with its log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.cluster.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            time.sleep(0.5)
        subprocess.run(["scancel", job_id], env=self.cluster.env)
        pytest.fail(
            f"job {job_id} did not end within {timeout} s: {self.cluster.job(job_id)}\n{self.log(job_id)[-4000:]}"
        )

    def log(self, job_id: str) -> str:
        path = self.log_dir / f"job-{job_id}.out"
        return path.read_text(errors="replace") if path.is_file() else "(no log)"

    def tasks(self, job_id: str, node: str) -> list:
        """The processes of the job's training step on one node (its launcher and its rank)."""
        import psutil

        found = []
        for p in psutil.process_iter():
            try:
                env = p.environ()
            except (psutil.Error, OSError):
                continue
            if (
                env.get("SLURM_JOB_ID") == job_id
                and env.get("SLURMD_NODENAME") == node
                and env.get("SLURM_STEP_ID") == "0"
            ):
                found.append(p)
        return found


@pytest.fixture(scope="session")
def jobs(slurm, tmp_path_factory) -> Jobs:
    return Jobs(slurm, tmp_path_factory.mktemp("slurm-logs"))


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def wait_for_step(run_dir: Path, step: int, jobs: Jobs, job_id: str, timeout: float = 300) -> None:
    """Until run.json has logged `step` (the run is inside the next step's pause)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(s["step"] >= step for s in record(run_dir)["steps"]):
                return
        except (OSError, ValueError, KeyError):
            pass
        if jobs.cluster.job(job_id).get("JobState") in FINAL_STATES:
            break
        time.sleep(0.2)
    pytest.fail(f"step {step} never logged in {run_dir}: {jobs.cluster.job(job_id)}\n{jobs.log(job_id)[-4000:]}")


def losses(rec: dict) -> dict[int, float]:
    return {s["step"]: s["loss"] for s in rec["steps"] if s.get("loss") is not None}


def relative_differences(got: dict[int, float], want: dict[int, float], steps) -> dict[int, float]:
    return {k: abs(got[k] - want[k]) / abs(want[k]) for k in steps}


def submit_dir(tmp_path: Path) -> Path:
    """A directory to submit from, as a user's project directory: the script and configs it names
    (links into this repository); the run directories land here."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("accelerate_configs", "ds_configs", "finetune"):
        (tmp_path / name).symlink_to(REPO / name)
    return tmp_path


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


class RssSampler:
    """An independent count of the ranks' host memory: the resident set of every training rank of a
    job (a process with RANK and SLURMD_NODENAME in its environment), read from /proc by psutil
    every 0.1 s from this test process, its maximum kept per node. A sampled peak can only be at
    most the kernel's high-water mark (what the run records) and misses what lives between samples.
    The record's peak spans the rank's life up to the end of training: sampling stops once `until` exists
    (the run's trainer_state.json, written as training ends; the export that follows gathers ZeRO-3's
    partitions and holds more: sampled until model/ appeared, a loaded machine once saw 12 MB above the record)."""

    def __init__(self, job_id: str, until: Path):
        import threading

        self.job_id, self.until, self.peak = job_id, until, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        import psutil

        while not self._stop.is_set() and not self.until.exists():
            for p in psutil.process_iter(["name"]):
                try:
                    if not (p.info["name"] or "").startswith("python"):
                        continue
                    env = p.environ()
                    if env.get("SLURM_JOB_ID") == self.job_id and "RANK" in env and "SLURMD_NODENAME" in env:
                        node = env["SLURMD_NODENAME"]
                        self.peak[node] = max(self.peak.get(node, 0), p.memory_info().rss)
                except (psutil.Error, OSError):
                    continue
            self._stop.wait(0.1)
