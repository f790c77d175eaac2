"""The mutation check: deliberate one-line defects across the product, each applied to a copy of a
repository, and only the tests docs/testing.md names for the claim the defect breaks run against it.
A defect those tests let pass is a claim the suite does not prove.

    python -m tests.mutations [--repo DIR] [--only NAME[,NAME...]] [--list] [--no-clean]

--repo: the repository to mutate (default: this one); its tests run against its own copy, so the same
defects can be checked on an earlier commit (`git worktree add /tmp/before COMMIT`). The claims' tests
are read from this repository's docs/testing.md; a test the other repository lacks is left out and
said. First the named tests run once without any defect (the clean run): a test that fails then
proves nothing about a defect, and its defects are reported `invalid`.

Per defect: `caught` (the tests failed), `NOT CAUGHT` (they passed), `does not apply` (the line is not
in the file, or none of the claim's tests exists there), `error` (pytest could not run them). Exit 0
only when every defect was caught. Not collected by pytest (no test_ prefix).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
TESTING_DOC = HERE / "docs" / "testing.md"
CLAIM = re.compile(r"^- \*\*([a-z0-9-]+)\*\*:")
NODE = re.compile(r"`(tests/[\w/]+\.py(?:::[^`\s]+)?)`")
TIMEOUT_S = 3600  # one defect's tests; launched ones take minutes on 2 cores


@dataclass(frozen=True)
class Mutation:
    name: str
    claim: str  # the id of a claim in docs/testing.md
    path: str
    old: tuple[str, ...]  # the line as it reads, in one version of the file or another
    new: tuple[str, ...]  # what it becomes (same index as `old`)
    what: str
    select: dict  # test function -> the parameter its items must name (the claim's other tests all run)


def _m(name, claim, path, old, new, what, select=None) -> Mutation:
    old, new = (old,) if isinstance(old, str) else old, (new,) if isinstance(new, str) else new
    return Mutation(name, claim, path, old, new, what, select or {})


RECORD_DDP = {"test_batch_lr_tokens_and_memory_per_rank": "[ddp]"}
MUTATIONS = [
    _m(
        "lr-linear-off",
        "lr-scaling",
        "finetune/batch.py",
        '"linear": ratio, "sqrt"',
        '"linear": 1.0, "sqrt"',
        "linear LR scaling applies factor 1",
        RECORD_DDP,
    ),
    _m(
        "effective-batch-without-accumulation",
        "effective-batch",
        "finetune/batch.py",
        "return per_device * grad_accum * data_parallel_size",
        "return per_device * data_parallel_size",
        "the effective batch leaves the accumulation out",
        RECORD_DDP,
    ),
    _m(
        "trained-tokens-off-by-one",
        "tokens-counted",
        "finetune/telemetry/meter.py",
        "n_trained = (labels[..., 1:] != -100).sum()",
        "n_trained = (labels != -100).sum()",
        "trained tokens count each row's first label, which no loss scores",
        RECORD_DDP,
    ),
    _m(
        "label-mask-boundary",
        "label-mask",
        "finetune/data/render.py",
        "if j < len(spans) and spans[j][0] <= start and end <= spans[j][1]:",
        "if j < len(spans) and spans[j][0] < start and end <= spans[j][1]:",
        "a trained span's first token is masked",
    ),
    _m(
        "signal-ignored",
        "signals-recorded",
        "finetune/training/signals.py",
        ("        self.received.append(signum)", "    received.append(signum)"),
        ("        pass  # the signal is not recorded", "    pass  # the signal is not recorded"),
        "a stop signal is not recorded",
    ),
    _m(
        "failure-not-agreed",
        "agreement",
        "finetune/training/signals.py",
        "failed = [r for r, n in enumerate(flags) if n >= FAILED]",
        "failed = [r for r, n in enumerate(flags) if n > FAILED]",
        "a failure on one rank is not agreed by the others",
        {"test_a_failure_on_one_rank_after_training_is_agreed_by_every_rank": "[ddp]"},
    ),
    _m(
        "overwrite-deletes-user-files",
        "overwrite-keeps-user-files",
        "finetune/launch/rundir.py",
        "if not owned(entry):",
        "if False:",
        "--overwrite deletes every file of the directory, the user's too",
    ),
    _m(
        "bf16-autocast-off",
        "precision-policy",
        "finetune/precision.py",
        'return {"bf16": self.torch_autocast == "bfloat16", "fp16"',
        'return {"bf16": False, "fp16"',
        "bf16-mixed runs without autocast under DDP and one process",
    ),
    _m(
        "zero3-runs-as-zero2",
        "strategy-engaged",
        "ds_configs/zero3.json",
        '"stage": 3,',
        '"stage": 2,',
        "the zero3 recipe's DeepSpeed config says stage 2",
        {"test_strategy_engaged_from_the_live_engine": "[zero3]"},
    ),
    _m(
        "export-skipped",
        "export-written",
        "finetune/training/run.py",
        "if cfg.run.save_model:",
        "if not cfg.run.save_model:",
        "the final export is skipped",
        {
            "test_checkpoint_and_export_written": "[ddp]",
            "test_export_reloads_in_a_plain_process_and_matches_single": "[fsdp]",
        },
    ),
    _m(
        "saved-tensors-unchecked",
        "export-verified",
        "finetune/export/figures.py",
        "for key, want in expected.items():",
        "for key, want in {}.items():",
        "the check of a save (and of an export) compares no tensor: an empty, missing or zeroed one passes",
        {"test_checkpoint_and_export_written": "[ddp]"},
    ),
    _m(
        "torn-checkpoint-accepted",
        "checkpoint-valid",
        "finetune/checkpointing/checkpoints.py",
        "if f.stat().st_size != size:",
        "if False:",
        "a checkpoint file cut short is resumed from",
    ),
    _m(
        "rng-not-restored",
        "resume-rng",
        "finetune/checkpointing/resume_plan.py",
        'torch.random.set_rng_state(state["cpu"])',
        "pass  # torch's stream not restored",
        "a resume under another world size keeps torch's fresh RNG stream",
    ),
    _m(
        "scheduler-not-resumed",
        "resume-other-world",
        "finetune/checkpointing/universal.py",
        'TRAINER_FILES = ("trainer_state.json", "scheduler.pt", "scaler.pt",',
        'TRAINER_FILES = ("trainer_state.json", "scaler.pt",',
        "a ZeRO resume under another world size starts the LR schedule afresh",
        {"test_two_ranks_resumed_on_one_process_keep_the_effective_batch_and_the_losses": "[zero2]"},
    ),
    _m(
        "strategy-check-dropped",
        "launch-refused",
        "finetune/preflight/checks.py",
        "        strategy_matches_recipe,",
        "        # strategy_matches_recipe,",
        "preflight no longer compares the launch's strategy with the recipe's",
    ),
    _m(
        "cpu-opt-in-assumed",
        "cpu-opt-in",
        "finetune/launch/cpu_rehearsal.py",
        'return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")',
        "return True",
        "CPU processes are taken as opted in to gloo without FINETUNE_CPU_DISTRIBUTED",
    ),
    _m(
        "speedup-inverted",
        "compare",
        "finetune/compare/table.py",
        'row["speedup"] = tps / base_tps',
        'row["speedup"] = base_tps / tps',
        "compare's speedup is the baseline's tokens/s over the run's",
    ),
    _m(
        "frozen-weights-unsharded",
        "planner",
        "finetune/planning/memory.py",
        "shard_p = n if st.shards_params else 1",
        "shard_p = 1",
        "the planner holds whole frozen weights on each ZeRO-3 / FSDP2 rank",
    ),
    _m(
        "gc-left-off",
        "rank-imports",
        "finetune/errors.py",
        "        gc.enable()",
        "        pass",
        "the garbage collector stays off after a rank's imports",
        {"test_a_rank_trains_with_the_garbage_collector_on_and_its_imports_frozen": "[ddp]"},
    ),
    _m(
        "lost-rank-traceback",
        "lost-rank",
        "finetune/training/endings.py",
        "    return Ending(1, summary), None if (lost or oom) and log_file else failure or e",
        "    return Ending(1, summary), None if oom and log_file else failure or e",
        "a rank whose peers stopped answering raises its backend error, traceback on the console",
    ),
    _m(
        "oom-unsaid",
        "out-of-memory",
        "finetune/training/endings.py",
        "    oom = out_of_memory(e, run.cfg, rank, log_file) if log_file else None",
        "    oom = None",
        "a GPU out of memory goes on as a traceback, without the levers",
    ),
    _m(
        "oom-peer-unread",
        "out-of-memory",
        "finetune/training/endings.py",
        '    elif log_file and heartbeat and not run.stops.failures_agreed and (told := heartbeat.told("oom")):',
        "    elif False:",
        "rank 0 records another rank's out of memory as that rank stopped answering",
    ),
    _m(
        "left-unread",
        "out-of-memory",
        "finetune/launch/peers.py",
        '        if not watch.left_by and self.store.check([f"{PREFIX}ended"]):',
        "        if False:",
        "a rank left waiting by another's out of memory waits until torchrun kills it, its run.json `running`",
    ),
]


def claims(doc: Path = TESTING_DOC) -> dict[str, list[str]]:
    """claim id -> the node ids docs/testing.md names for it, in order."""
    out: dict[str, list[str]] = {}
    current = None
    for line in doc.read_text(encoding="utf-8").splitlines():
        m = CLAIM.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
        elif not line.startswith("  "):
            current = None if line.startswith(("#", "- ")) or not line.strip() else current
        if current is not None:
            current += [n for n in NODE.findall(line) if n not in current]
    return out


def copy_repo(repo: Path, dest: Path) -> Path:
    ignore = shutil.ignore_patterns(".git", "runs", "wandb", "__pycache__", "*.egg-info", ".pytest_cache", "build")
    shutil.copytree(repo, dest, ignore=ignore, symlinks=True)
    return dest


def apply(copy: Path, m: Mutation) -> str | None:
    """Write the defect into the copy; the line it replaced, or None when no version of it is there."""
    path = copy / m.path
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    for old, new in zip(m.old, m.new):
        assert "\n" not in old and "\n" not in new, f"{m.name}: a one-line defect"
        if text.count(old) == 1:
            path.write_text(text.replace(old, new), encoding="utf-8")
            return old
    return None


def pytest(copy: Path, nodes: list[str], *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", *nodes, "-q", "-p", "no:cacheprovider", "-o", "addopts=", *extra]
    return subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def collect(copy: Path, nodes: list[str]) -> list[str]:
    """The test items the copy's suite has under these node ids (collected there; one pytest does not know
    would stop the collection, so those whose file or function the copy lacks are left out first)."""

    def there(node: str) -> bool:
        path, _, function = node.partition("::")
        if not (copy / path).is_file():
            return False
        tree = ast.parse((copy / path).read_text(encoding="utf-8"))
        return not function or function.split("[")[0] in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}

    proc = pytest(copy, [n for n in nodes if there(n)], "--collect-only")
    return [line.strip() for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def items_of(m: Mutation | None, nodes: list[str], collected: list[str]) -> list[str]:
    """The collected items of the claim's node ids, narrowed by the defect's `select`."""
    select = m.select if m else {}

    def named(item: str) -> bool:
        return any(item == n or item.startswith((n + "[", n + "::")) for n in nodes)

    def selected(item: str) -> bool:
        function = item.split("::")[-1].split("[")[0]
        return function not in select or select[function] in item

    return [i for i in collected if named(i) and selected(i)]


def summary_line(out: str) -> str:
    lines = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    if lines:
        return lines[-1].strip("= ")
    return out.strip().splitlines()[-1][:120] if out.strip() else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=HERE)
    parser.add_argument("--only", default="", help="comma-separated defect names")
    parser.add_argument("--list", action="store_true", help="list the defects and their tests, run nothing")
    parser.add_argument("--no-clean", action="store_true", help="skip the clean run")
    args = parser.parse_args(argv)
    table = claims()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only.split(",")]
    nodes = {m.name: table.get(m.claim, []) for m in chosen}
    if args.list:
        for m in chosen:
            narrowed = "".join(f"\n    of {f}: only {p}" for f, p in m.select.items())
            tests = "\n    ".join(nodes[m.name] or ["(no tests)"])
            print(f"{m.name}  [{m.claim}] {m.path}: {m.what}\n    {tests}{narrowed}")
        return 0
    repo = args.repo.resolve()
    print(f"mutation check of {repo}: {len(chosen)} defect(s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="mutations-") as tmp:
        clean = copy_repo(repo, Path(tmp) / "clean")
        union = list(dict.fromkeys(n for m in chosen for n in nodes[m.name]))
        collected = collect(clean, union)
        for n in union:
            if not items_of(None, [n], collected):
                print(f"  not in {repo.name}: {n}")
        items = {m.name: items_of(m, nodes[m.name], collected) for m in chosen}
        failing = (
            set() if args.no_clean else clean_run(clean, list(dict.fromkeys(i for v in items.values() for i in v)))
        )
        if failing is None:
            return 2
        results = [run_one(m, repo, Path(tmp), items[m.name], failing) for m in chosen]
    print("\n| defect | claim | tests | result | seconds |\n| --- | --- | --- | --- | --- |")
    for m, (result, ran, seconds) in zip(chosen, results):
        print(f"| {m.name}: {m.what} | {m.claim} | {ran} | {result} | {seconds:.0f} |")
    caught = sum(r[0].startswith("caught") for r in results)
    print(f"\n{caught} of {len(chosen)} defects caught")
    return 0 if caught == len(chosen) else 1


def clean_run(clean: Path, items: list[str]) -> set[str] | None:
    """Every chosen defect's tests once without a defect: the ones that fail (None: pytest could not run)."""
    started = time.monotonic()
    proc = pytest(clean, items, "-rf")
    print(f"  clean run of {len(items)} tests: {summary_line(proc.stdout)} in {time.monotonic() - started:.0f} s")
    if proc.returncode not in (0, 1):
        print(proc.stdout[-3000:] + proc.stderr[-3000:])
        return None
    return {i for i in items if f"FAILED {i}" in proc.stdout}


def run_one(m: Mutation, repo: Path, tmp: Path, items: list[str], failing: set[str]) -> tuple[str, int, float]:
    started = time.monotonic()
    if not items:
        return "does not apply (none of its tests here)", 0, 0.0
    if failing & set(items):
        return f"invalid (fails without the defect: {sorted(failing & set(items))})", 0, 0.0
    copy = copy_repo(repo, tmp / m.name)
    try:
        if apply(copy, m) is None:
            return f"does not apply (line not in {m.path})", 0, 0.0
        proc = pytest(copy, items, "-x")
    except subprocess.TimeoutExpired:
        return "error (timed out)", len(items), time.monotonic() - started
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    seconds = time.monotonic() - started
    result = {0: "NOT CAUGHT", 1: "caught"}.get(proc.returncode, f"error (pytest exit {proc.returncode})")
    first = re.search(r"^FAILED (\S+)", proc.stdout, re.M)
    by = f" by {first.group(1)}" if first else ""
    print(f"  {m.name}: {result}{by} ({summary_line(proc.stdout)}, {seconds:.0f} s)", flush=True)
    return result + by, len(items), seconds


if __name__ == "__main__":
    sys.exit(main())
