"""`finetune doctor`'s options, apart from the checks so that parsing them (and refusing a bad one)
imports no torch (finetune/doctor/main.py runs the checks)."""

from __future__ import annotations

import argparse

from finetune import precision
from finetune.config import command_line
from finetune.doctor import runs

DESCRIPTION = (
    "Check this machine: environment, links between GPUs, and a short run under every strategy it can run, "
    "agreeing with one process. Exit 0: no problem; 1: a problem, each named with its fix; 2: a bad option."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the environment only (seconds)")
    p.add_argument(
        "--offload",
        action="store_true",
        help="also the offload strategies; builds DeepSpeed's CPU Adam (~60 s the first time)",
    )
    p.add_argument("--build-cpu-adam", action="store_true", help="build DeepSpeed's CPU Adam even without --offload")
    p.add_argument(
        "--out",
        default="runs/doctor",
        help="where doctor.json, doctor.html, the runs and logs go (default runs/doctor)",
    )
    command_line.add_recipe(
        p,
        "also check that the accelerate default config does not refuse this recipe (a name in recipes/ or a YAML path)",
        required=False,
    )
    p.add_argument(
        "--strategies",
        help=f"comma-separated subset of {','.join(runs.names(True))} (single, the reference, always runs)",
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=precision.CHOICES,
        help="training.precision of the runs (default auto: bf16-mixed on GPUs with bf16, 32-true on CPU)",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="STRATEGY:section.key=value",
        help="for testing the doctor: one recipe override for one strategy's run only (e.g. "
        "zero2:training.learning_rate=2e-3, which the loss comparison must catch)",
    )
