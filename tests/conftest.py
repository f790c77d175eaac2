"""Shared fixtures: the real tokenizer (from the bundled model), tiny random models built from a
config, and a launcher that runs finetune/train.py through `accelerate launch` in a subprocess.

The bundled model is fetched and converted once per machine (~1.5 min, cached in
$FINETUNE_CACHE or ~/.cache/finetune); its tokenizer and chat template are what the tests use.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = REPO / "finetune" / "train.py"
# Fixtures that start training processes: a test using one is an integration test, like those
# marked by hand (`python -m pytest -m "not integration"` is the fast unit set).
LAUNCHING_FIXTURES = {"launch", "runs", "sweep", "strategy_runs"}


def pytest_configure(config):
    """Collecting imports torch, transformers, peft and every test module: without the cyclic garbage collector, as a
    rank imports (finetune/errors.py imports_without_gc); on again, with what was collected frozen, once collection
    ends (pytest_collection_finish). Measured: `pytest --collect-only` 16.5 s -> 8.9 s on the 2-core machine."""
    gc.disable()


def pytest_collection_modifyitems(items):
    for item in items:
        if LAUNCHING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


def pytest_collection_finish(session):
    """DeepSpeed's CPU ops (the host-offloaded optimizer, the CPU collectives) compile on first use, once per
    machine (~/.cache/torch_extensions): 205 s for cpu_adam on the 2-core machine under load, 5-9 s to load once
    built. Built here, before the first launched test, so that no launch compiles inside its timeout; only when a
    launched test was collected (the unit set never pays it)."""
    gc.freeze()  # the collector off while collecting (pytest_configure): on again
    gc.enable()
    if not any(item.get_closest_marker("integration") for item in session.items):
        return
    import importlib.util

    if importlib.util.find_spec("deepspeed"):  # without it, the DeepSpeed tests say so themselves
        from finetune.training.rank_imports import OP_BUILDERS, load_ops

        load_ops(list(OP_BUILDERS))  # a real build is announced on stderr, as a run announces it


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    from finetune.modeling.bundled import ensure_bundled_model

    return ensure_bundled_model()


@pytest.fixture(scope="session")
def tokenizer(bundled_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_model_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    from finetune.modeling.bundled import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer)


@dataclass
class Launch:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def record(self) -> dict:
        return json.loads((self.run_dir / "run.json").read_text())

    def explain(self) -> str:
        return f"exit {self.returncode}\n--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-6000:]}"


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a started command's process group and every process below it: ranks run in sessions
    of their own (torchrun, finetune/launch/relay.py), out of the group's reach."""
    import psutil

    try:
        below = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        below = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in below:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.wait()


def run_process_group(
    cmd: list[str], *, cwd: Path, env: dict, timeout: float, merge_stderr: bool = False
) -> tuple[int, str, str]:
    """Run cmd in a new process group. On timeout the whole group (launcher and ranks) is killed
    and the test fails, so a hung job never hangs the suite; a launcher killed by a signal fails
    it too. Returns (exit code, stdout, stderr; stderr is "" when merged into stdout)."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(
            f"timed out after {timeout} s (the job hung): {' '.join(cmd)}\n{out[-3000:]}\n{(err or '')[-3000:]}"
        )
    if proc.returncode < 0:
        pytest.fail(
            f"launcher killed by signal {-proc.returncode}: {' '.join(cmd)}\n{out[-3000:]}\n{(err or '')[-3000:]}"
        )
    return proc.returncode, out, err or ""


def launch_train(
    args: list[str],
    *,
    run_dir: Path,
    cwd: Path,
    num_processes: int = 1,
    config_file: str | None = None,
    launch_args: list[str] = (),
    timeout: float = 600,
    env: dict | None = None,
    unset_env_prefix: str | None = None,
    script: Path = TRAIN_SCRIPT,
) -> Launch:
    """`accelerate launch [...] finetune/train.py ARGS --run.output_dir=RUN_DIR` in a new process
    group; on timeout the whole group is killed and the test fails (never hangs). `script`: another
    launch script (one that changes a table of the package before it runs the launch script's main)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if config_file:
        cmd += ["--config_file", str(REPO / config_file) if not Path(config_file).is_absolute() else config_file]
    else:
        cmd += [
            "--num_processes",
            str(num_processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
        ]
        # `--cpu --num_processes 2` starts ONE process (docs/preflight.md): multi-process CPU
        # launches must come from a config file with distributed_type MULTI_CPU / use_cpu.
        assert num_processes == 1, "pass config_file for multi-process launches"
    cmd += list(launch_args) + [str(script), *args, f"--run.output_dir={run_dir}"]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    if unset_env_prefix:
        full_env = {k: v for k, v in full_env.items() if not k.startswith(unset_env_prefix)}
    code, out, err = run_process_group(cmd, cwd=cwd, env=full_env, timeout=timeout)
    return Launch(code, out, err, run_dir)


def finetune_train(args: list[str], cwd: Path, timeout: float = 900) -> tuple[int, str]:
    """`finetune train ARGS` as a user types it, in `cwd`, without the launcher's or our environment variables
    of this process: (exit code, stdout and stderr together)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FINETUNE_"))}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "finetune.cli", "train", *args]
    code, out, _ = run_process_group(cmd, cwd=cwd, env=env, timeout=timeout, merge_stderr=True)
    return code, out


def short_demo(tiny_model_dir, steps: int, *extra: str) -> list[str]:
    """A short run's command line: the demo recipe on the tiny model, 16 rows, no exact-match evaluation."""
    return [
        "--recipe",
        "demo",
        f"--model.name_or_path={tiny_model_dir}",
        "--data.demo_train_size=16",
        "--eval.exact_match=false",
        f"--training.max_steps={steps}",
        *extra,
    ]


def logged_steps(record: dict, steps: int) -> list[dict]:
    """A run record's steps[] entries with a loss: exactly steps 1..`steps`, each once."""
    out = [s for s in record["steps"] if s.get("loss") is not None]
    assert [s["step"] for s in out] == list(range(1, steps + 1)), record["steps"]
    return out


@pytest.fixture
def launch():
    return launch_train


@pytest.fixture(scope="session")
def strategy_runs(request, tmp_path_factory, tiny_model_dir):
    """name -> finished Launch: the session's one run per strategy, each launched on first use and read by every
    test file with a claim about it (tests/training/strategy_runs.py); the 2-rank ones in pairs."""
    from tests.training.strategy_runs import PAIRED, StrategyRuns

    want = wanted(request, "strategy_runs", lambda item: [n for n in params(item, "name", "recipe") if n in PAIRED])
    return StrategyRuns(tmp_path_factory.mktemp("strategies"), tiny_model_dir, want)


class InPairs:
    """name -> what `start(name)` returned, each started once, on first use, side by side with the next name the
    session's tests want (`wanted`, in their order) that has not started: a launch spends much of its time in one
    process (imports, the launcher, rank 0's saves) or waiting, so two fill a 2-core machine (measured: four 2-rank
    strategy launches in 73 s in pairs, 107 s one after the other, at the same load). What `start` raised is
    raised to the test that asked for that name."""

    def __init__(self, start, wanted=()):
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self.start, self.wanted, self.done = start, list(dict.fromkeys(wanted)), {}
        self.pool, self.lock = ThreadPoolExecutor(2), threading.Lock()

    def __call__(self, name: str):
        with self.lock:  # a name asked for from two threads at once starts once
            if name not in self.done:
                partner = next((n for n in self.wanted if n != name and n not in self.done), None)
                for n in [name] + ([partner] if partner else []):
                    self.done[n] = self.pool.submit(self.start, n)
        return self.done[name].result()


def wanted(request, fixture: str, names) -> list[str]:
    """What the session's tests that use `fixture` (the requesting module's, for a module-scoped fixture) will
    ask it for, in their order: names(item) of each."""
    items = [i for i in request.session.items if request.scope != "module" or i.module is request.module]
    return [n for item in items if fixture in item.fixturenames for n in names(item)]


def params(item, *keys: str) -> list:
    """The values of a parametrized item's parameters `keys` (none for an item without them)."""
    callspec = getattr(item, "callspec", None)
    return [callspec.params[k] for k in keys if callspec and k in callspec.params]


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (other processes on this machine may rendezvous too)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def own_port() -> list[str]:
    """`accelerate launch` options giving a launch a rendezvous port of its own: two launches started at once
    would both find accelerate's default (29500) free and then both bind it."""
    return ["--main_process_port", str(free_port())]


# Runs the command as a terminal starts a foreground job: SIGINT and SIGQUIT at their default (exec keeps an ignored
# signal ignored, and a suite started as a background job of a non-interactive shell, as CI may start it, ignores
# both: then a pipeline's tee outlived the Ctrl-C drill's SIGINT). Not preexec_fn: tests start commands from threads.
_AS_A_TERMINAL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); signal.signal(signal.SIGQUIT, "
    "signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"
)


class Started:
    """A command started in its own session, as a terminal starts it (_AS_A_TERMINAL), for tests that act on it while
    it runs (signal it, or one of its processes). Its output goes to a file; leaving the `with` block kills the whole
    session (launcher, ranks, a pipeline's other end) by process group, also when the test failed."""

    def __init__(self, cmd: list[str], *, cwd: Path, env: dict, out: Path):
        self.out_path = out
        self._out = open(out, "w")  # noqa: SIM115 - closed in __exit__
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **env}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _AS_A_TERMINAL, *cmd],
            cwd=cwd,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc) -> None:
        kill_tree(self.proc)
        self._out.close()

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_until(self, ready, what: str, timeout: float = 400) -> None:
        """Poll `ready()` (exceptions count as not yet) until it holds; fail if the command ended first."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except (OSError, ValueError, KeyError, IndexError):
                pass
            if self.proc.poll() is not None:
                pytest.fail(f"ended (exit {self.proc.returncode}) before {what}:\n{self.output[-4000:]}")
            time.sleep(0.2)
        pytest.fail(f"not {what} after {timeout} s:\n{self.output[-4000:]}")

    def finish(self, timeout: float = 400) -> int:
        """The exit code; a command still running after `timeout` s fails the test (it hung)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {timeout} s later (hung):\n{self.output[-4000:]}")

    def processes(self) -> list:
        """Every process of the session now (psutil), the command's own first."""
        import psutil

        top = psutil.Process(self.proc.pid)
        return [top, *top.children(recursive=True)]


def steps_logged(run_dir: Path) -> int:
    """How many steps run.json lists (0 before it exists)."""
    return len(json.loads((run_dir / "run.json").read_text())["steps"])


def continue_record(rec, run_dir: Path, ckpt: Path, plan=None) -> None:
    """The earlier run.json carried into `rec`, as finetune/training/run.py prepare hands it over."""
    from finetune.checkpointing import resume

    sections, summary = resume.continued(run_dir, ckpt, plan, created=rec.view.get("created"))
    for name, value in sections.items():
        rec.set(name, value)
    rec.update("summary", **summary)


def save_record(rec) -> None:
    """`rec` into its run.json, as a run's RunJson sink saves it."""
    from finetune.telemetry.sinks import RunJson

    RunJson(rec).save()
