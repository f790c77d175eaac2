"""Issue 27 item 6: one flag style across subcommands (hyphens; the underscore spelling accepted too),
`finetune --version`, help texts whole, and a bad flag refused before torch is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import finetune
from finetune.cli import dispatch
from finetune.config.sections import SECTION_CLASSES
from tests.conftest import REPO


def _parse(argv):
    args, _ = dispatch.parse(argv)
    return args


def _exit(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        dispatch.main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def test_version_is_the_package_version(capsys):
    code, out = _exit(["--version"], capsys)
    assert code == 0 and out.strip() == f"finetune {finetune.__version__}"
    text = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text and 'attr = "finetune.__version__"' in text  # one source


@pytest.mark.parametrize(
    "argv, dest, value",
    [
        (["train", "--recipe", "demo", "{}", "cfg.yaml"], "config_file", "cfg.yaml"),
        (["train", "--recipe", "demo", "{}", "3"], "num_processes", 3),
        (["plan", "--recipe", "demo", "{}", "80GiB"], "gpu_memory", "80GiB"),
        (["compare", "runs/a", "{}", "2.5"], "gpu_hour_price", 2.5),
        (["bench", "{}", "64"], "seq_len", 64),
        (["bench-comm", "{}", "4"], "num_processes", 4),
        (["sweep", "--recipe", "demo", "--strategies", "ddp", "{}", "ddp"], "baseline_strategy", "ddp"),
        (["doctor", "{}"], "build_cpu_adam", True),
    ],
)
def test_each_flag_takes_both_spellings(argv, dest, value):
    flag = "--" + dest.replace("_", "-")
    for spelling in (flag, flag.replace("-", "_").replace("__", "--", 1)):
        args = _parse([spelling if a == "{}" else a for a in argv])
        assert getattr(args, dest) == value, spelling


def test_help_shows_only_the_hyphen_spelling_and_no_flag_is_declared_with_underscores(capsys):
    parser = dispatch.build_parser()
    for name, sub in parser.commands.items():
        for flag in sub.long_flags:
            assert "_" not in flag, f"finetune {name} {flag}: flags are declared with hyphens"
        text = sub.format_help()
        assert "--config_file" not in text and "--num_processes" not in text and "--gpu_memory" not in text, name
    with pytest.raises(ValueError, match="hyphens"):  # the control: an underscore declaration is refused
        parser.commands["recipes"].add_argument("--some_flag")


def test_help_texts_are_whole(capsys):
    code, out = _exit(["bench", "--help"], capsys)
    assert code == 0 and "peak memory and the ratios ours / each baseline" in " ".join(out.split())
    code, out = _exit(["bench-comm", "--help"], capsys)
    assert code == 0 and "--out" in out and "--sizes" in out and "--num-processes" in out
    code, out = _exit(["sweep", "--help"], capsys)
    assert "--baseline-strategy STRATEGY" in out
    code, out = _exit(["doctor", "--help"], capsys)
    assert code == 0 and "2: a bad option." in " ".join(out.split()) and "--build-cpu-adam" in out
    code, out = _exit(["train", "--help"], capsys)
    sections = next(line for line in out.splitlines() if line.startswith("sections: "))
    assert code == 0 and all(f" {name}" in sections for name in SECTION_CLASSES), sections  # parallel was left out
    assert dispatch.main(["recipes"]) == 0
    listed = " ".join(capsys.readouterr().out.split())
    for purpose in (
        "the export gathers a full state dict into one adapter.",  # the fsdp recipe's second line
        "Reports exact match of greedy answers on 100 held-out prompts before and after training.",  # demo's third
        "the export gathers 16-bit weights into one adapter.",  # zero3's second
    ):
        assert purpose in listed


BAD = [
    ["sweep", "--recipe", "demo", "--strategies", "ddp", "--bogus"],
    ["bench", "--bogus"],
    ["bench", "--steps", "0"],
    ["bench-comm", "--bogus"],
    ["compare", "runs/a", "--bogus"],
    ["recipes", "--bogus"],
    ["doctor", "--quick", "--bogus"],
    ["doctor", "--precision", "fp8"],
]
CHECK = """
import json, sys
from finetune.cli import main
out = []
for argv in {bad!r}:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out.append([argv, code, sorted(m for m in ("torch", "transformers", "deepspeed") if m in sys.modules)])
print("RESULT", json.dumps(out))
"""


def test_a_bad_flag_is_refused_before_torch_is_imported(tmp_path):
    """Every bad flag in one fresh process, in turn; after each: exit 2 and no torch in sys.modules.
    (No timing: the import is what costs the seconds.) Every subcommand is tried with an unknown flag
    too, so one added later (`finetune doctor`) is held to the same. train and plan report a bad flag
    with every other problem instead (test_train_and_plan_report_every_problem_in_one_message)."""
    every = [[name, "--no-such-flag"] for name in dispatch.build_parser().commands]
    proc = subprocess.run(
        [sys.executable, "-c", CHECK.format(bad=BAD + every)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    results = json.loads(line[len("RESULT ") :])
    assert [r[1] for r in results] == [2] * len(results), proc.stderr[-3000:]
    assert all(r[2] == [] for r in results), results


def test_train_and_plan_report_every_problem_in_one_message(tmp_path, monkeypatch, capsys):
    """The command line's, the recipe's, the accelerate config's, the model's and the data's problems,
    in one message and one exit 2: each fix used to reveal the next (~55 s a try)."""
    monkeypatch.chdir(tmp_path)
    code, out = _exit(
        ["train", "--recipe", "demo", "--num-procesess", "2", "--bogus-flag", "--trainig.learning_rate=1e-4"]
        + ["--training.max_step=5", "--data.path=data/train.jsonl", "--model.name_or_path=/nope"]
        + ["--config-file", "nope.yaml"],
        capsys,
    )
    assert code == 2 and out.count("error:") == 1 and "8 problems" in out, out
    for problem in (
        "--num-procesess: unknown option (did you mean --num-processes?)",
        "--bogus-flag: unknown option;",  # not "missing value"
        "--trainig.*: unknown section (did you mean 'training'?)",
        "training.max_step: unknown key (did you mean 'max_steps'?)",
        "eval.heldout_path: 'demo' is the demo data's held-out split",
        "accelerate config 'nope.yaml' not found",
        "model.name_or_path: '/nope': no such local directory",
        "data.path: data/train.jsonl: file not found",
    ):
        assert problem in out, (problem, out)
    code, out = _exit(["plan", "--recipe", "demo", "--gpu-memroy", "3GiB", "--training.max_step=5", "--gpus=0"], capsys)
    assert code == 2 and out.count("error:") == 1 and "3 problems" in out, out
    assert "did you mean --gpu-memory?" in out and "did you mean 'max_steps'?" in out and "--gpus and --nodes" in out


def test_an_override_holding_a_space_after_a_bare_resume_stays_an_override():
    """argparse took `--run.name=my run` (an argument with a space) for --resume's PATH, so the run to
    resume had no name; `finetune train` puts --resume before the overrides when it launches."""
    from finetune.cli import dispatch
    from finetune.config.command_line import parse_train_args

    for parse in (lambda a: parse_train_args(a), lambda a: dispatch.parse(["train", *a])):
        args, rest = parse(["--recipe", "demo", "--resume", "--run.name=my run #2"])
        assert args.resume == "auto" and rest == ["--run.name=my run #2"]
        args, rest = parse(["--recipe", "demo", "--resume", "runs/a b/checkpoint-2", "--run.name=x y"])
        assert args.resume == "runs/a b/checkpoint-2" and rest == ["--run.name=x y"]
