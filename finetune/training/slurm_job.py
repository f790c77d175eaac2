"""What accelerate_configs/slurm_two_node.sbatch asks before and after each launch of a job, which
runs again, unchanged, after every requeue (docs/multinode.md "Preemption and requeue"):

    python -m finetune.training.slurm_job args RECIPE [OVERRIDES...]
        line 1: the run directory; then one extra train.py argument per line
    python -m finetune.training.slurm_job status RUN_DIR [--since EPOCH_S]
        how the run ended (run.json summary.status): completed, interrupted, failed, running, none
        (no record), or unchanged (not written since EPOCH_S)

Nothing heavy is imported, so it costs the batch shell well under 1 s.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def run_dir_and_args(recipe: str, args: list[str], env=os.environ) -> tuple[Path, list[str]]:
    """(the run directory of this job's run, the arguments to add to train.py's command line)."""
    from finetune.config.recipe import find_recipe, merge, parse_overrides, read_recipe_file
    from finetune.errors import UserError
    from finetune.launch.rundir import resolve_run_dir

    own = [a for a in args if a == "--overwrite" or a == "--resume" or a.startswith("--resume=")]  # train.py's flags
    overrides, _ = parse_overrides([a for a in args if a not in own], typed=False)
    run = merge(read_recipe_file(find_recipe(recipe)), overrides).get("run") or {}
    extra = []
    name, output_dir = run.get("name"), run.get("output_dir")
    if not (name or output_dir):
        name = f"{Path(recipe).stem}-slurm{env.get('SLURM_JOB_ID', 'nojob')}"
        extra.append(f"--run.name={name}")
    run_dir = resolve_run_dir(str(name), str(output_dir) if output_dir else None)
    requeued = int(env.get("SLURM_RESTART_COUNT") or 0) > 0
    if requeued and "--overwrite" in own:
        raise UserError(
            f"requeued job (restart {env['SLURM_RESTART_COUNT']}) with --overwrite: it would delete the "
            f"run directory {run_dir} it is meant to continue; submit requeueable jobs without --overwrite"
        )
    if requeued and not any(a != "--overwrite" for a in own):
        checkpoint = _newest_complete(run_dir)
        if checkpoint is not None:
            extra.append("--resume")
            print(
                f"slurm_job: requeued job (restart {env['SLURM_RESTART_COUNT']}): continuing {run_dir} from "
                f"{checkpoint.name}",
                file=sys.stderr,
            )
        else:
            print(
                f"slurm_job: requeued job (restart {env['SLURM_RESTART_COUNT']}): no complete checkpoint in "
                f"{run_dir}; starting the run as the command says",
                file=sys.stderr,
            )
    return run_dir, extra


def _newest_complete(run_dir: Path) -> Path | None:
    from finetune.checkpointing import checkpoints
    from finetune.errors import UserError

    try:
        return checkpoints.newest_valid(run_dir) if run_dir.is_dir() else None
    except UserError:
        return None


def status(run_dir: Path, since: float | None = None) -> str:
    """run.json's summary.status; `unchanged` when the record was not written since `since` (epoch
    seconds: this launch's start), so a launch that stopped before writing one (a refused resume)
    is never taken for the previous segment's preemption."""
    path = run_dir / "run.json"
    try:
        if since is not None and path.stat().st_mtime < since:
            return "unchanged"
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "none"
    return str((record.get("summary") or {}).get("status") or "none")


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "args":
        from finetune.errors import UserError

        try:
            run_dir, extra = run_dir_and_args(argv[1], argv[2:])
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print("\n".join([str(run_dir), *extra]))
        return 0
    if argv[:1] == ["status"] and len(argv) in (2, 4) and (len(argv) == 2 or argv[2] == "--since"):
        print(status(Path(argv[1]), float(argv[3]) if len(argv) == 4 else None))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
