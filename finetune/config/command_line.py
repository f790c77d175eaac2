"""The command-line options every entry point shares: the flag style, `--recipe`, the run options of `train`, and the
launch script's own parser. Read by the `finetune` command, the launch script, preflight and the benchmarks.

Flag style: words joined by hyphens (`--gpu-memory`, `--config-file`); every such flag also answers
to its underscore spelling (`--config_file`, as `accelerate launch` spells it), kept out of the help.
Recipe overrides are not flags: `--section.key=value` uses the recipe's own key names.
"""

from __future__ import annotations

import argparse
import sys

from finetune.config.sections import SECTION_CLASSES

TRAIN_EPILOG = f"""overrides: any recipe value as --section.key=value, e.g.
  --training.max_steps=20 --method.name=full --data.path=my.jsonl --run.name=try1
sections: {", ".join(SECTION_CLASSES)} (training: also any TrainingArguments field)"""


def _alias(flag: str) -> str | None:
    """The underscore spelling of a multi-word long flag (`--gpu-memory` -> `--gpu_memory`)."""
    if flag.startswith("--") and "-" in flag[2:]:
        return "--" + flag[2:].replace("-", "_")
    return None


class HelpFormatter(argparse.HelpFormatter):
    """Paragraphs of descriptions and epilogs wrapped, indented lines (examples) kept as written;
    each flag under its hyphen spelling only."""

    def _fill_text(self, text, width, indent):
        import textwrap

        paragraphs = []
        for para in text.split("\n\n"):
            lines = para.splitlines()
            if any(line.startswith(" ") for line in lines):
                paragraphs.append("\n".join(indent + line for line in lines))
            else:
                paragraphs.append(
                    textwrap.fill(" ".join(para.split()), width, initial_indent=indent, subsequent_indent=indent)
                )
        return "\n\n".join(paragraphs)

    def _format_action_invocation(self, action):
        shown = [s for s in action.option_strings if not (s.startswith("--") and "_" in s[2:])]
        if not action.option_strings or shown == action.option_strings:
            return super()._format_action_invocation(action)
        import copy

        visible = copy.copy(action)
        visible.option_strings = shown
        return super()._format_action_invocation(visible)


class Parser(argparse.ArgumentParser):
    """argparse with the project's flag style: declare `--multi-word` flags; `--multi_word` is accepted
    too. No abbreviations (`--out` must never be taken for `--output-dir`). Subcommands' parsers are
    Parsers as well (add_subparsers uses the parent's class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        self.long_flags: list[str] = []  # as declared (hyphens), for did-you-mean on a bad flag
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        # argparse takes an argument holding a space (`--run.name=my run`) for the value of a flag
        # before it whose value is optional (--resume): such a flag followed by an option gets its const.
        args = list(sys.argv[1:] if args is None else args)
        consts = {flag: a.const for a in self._actions if a.nargs == "?" for flag in a.option_strings}
        args = [
            f"{a}={consts[a]}" if a in consts and args[i + 1 : i + 2] and args[i + 1].startswith("-") else a
            for i, a in enumerate(args)
        ]
        return super().parse_known_args(args, namespace)

    def add_argument(self, *names, **kwargs):
        if any(n.startswith("--") and "_" in n[2:] for n in names):
            raise ValueError(f"{names}: declare flags with hyphens; the underscore spelling is added")
        aliases = [a for a in map(_alias, names) if a]
        self.long_flags += [n for n in names if n.startswith("--")]
        return super().add_argument(*names, *aliases, **kwargs)


def add_recipe(
    parser: argparse.ArgumentParser,
    text: str = "recipe name in recipes/ (e.g. demo) or a YAML path",
    *,
    required: bool = True,
) -> None:
    parser.add_argument("--recipe", required=required, help=text)


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """--overwrite, --resume, --allow-config-change and --allow-input-change: what a run does with an existing run
    directory."""
    parser.add_argument("--overwrite", action="store_true", help="replace an existing run directory of the same name")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        metavar="PATH",
        help="continue the run in its run directory from its newest complete checkpoint, or from "
        "PATH (a checkpoint-N directory), with the configuration the run saved; see docs/faults.md",
    )
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: apply command-line overrides that differ from the run's saved configuration "
        "(refused otherwise) and record them in run.json",
    )
    parser.add_argument(
        "--allow-input-change",
        action="store_true",
        help="with --resume: continue although the base weights, tokenizer, chat template or data differ from the "
        "ones the checkpoint was trained on (refused otherwise, naming what changed); recorded in run.json",
    )


def parse_train_args(argv: list[str] | None = None):
    """(known args, override strings); overrides are validated with the recipe."""
    p = Parser(prog="finetune/train.py", description="Fine-tune a causal LM from a recipe.", epilog=TRAIN_EPILOG)
    add_recipe(p)
    add_run_options(p)
    return p.parse_known_args(argv)
