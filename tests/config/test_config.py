"""Recipe loading and validation: precedence, every problem reported at once, shipped recipes valid."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from finetune.config.recipe import RECIPES_DIR, available_recipes, load_recipe, parse_overrides
from finetune.config.sections import TRAINING_DEFAULTS, Config
from finetune.config.validate import build_config
from finetune.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]  # the repository root


def write_recipe(tmp_path: Path, values: dict | str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(values if isinstance(values, str) else yaml.safe_dump(values))
    return path


def test_precedence_defaults_then_recipe_then_command_line(tmp_path):
    path = write_recipe(
        tmp_path, {"method": {"lora_r": 4, "lora_alpha": 8}, "training": {"learning_rate": 1e-3, "max_steps": 7}}
    )
    cfg, _ = load_recipe(str(path), ["--method.lora_r=32", "--training.max_steps", "9"])
    assert cfg.method.lora_r == 32  # command line beats recipe
    assert cfg.method.lora_alpha == 8  # recipe beats default (32)
    assert cfg.method.lora_dropout == Config().method.lora_dropout  # untouched default
    assert cfg.training.args["max_steps"] == 9
    assert cfg.training.args["learning_rate"] == 1e-3
    assert cfg.training.args["per_device_train_batch_size"] == TRAINING_DEFAULTS["per_device_train_batch_size"]
    assert cfg.recipe == "r"


def test_every_problem_is_reported_in_one_error(tmp_path):
    path = write_recipe(
        tmp_path,
        {
            "model": {"name_or_pth": "x"},  # unknown key (typo)
            "method": {"name": "qlora4", "lora_r": "sixteen"},  # bad value, wrong type
            "training": {"learning_rat": 1e-4, "max_steps": 2.5},  # unknown TrainingArguments field, wrong type
            "optimizer": {"lr": 1},  # unknown section
        },
    )
    with pytest.raises(ConfigError) as info:
        load_recipe(str(path), ["--data.max_length=many"])
    problems = info.value.problems
    text = str(info.value)
    for fragment in (
        "model.name_or_pth: unknown key (did you mean 'name_or_path'?)",
        "method.name: got 'qlora4'; allowed: full, lora, qlora",
        "method.lora_r: expected an integer, got string 'sixteen'",
        "training.learning_rat: unknown key (did you mean 'learning_rate'?)",
        "training.max_steps: expected an integer, got number 2.5",
        "optimizer: unknown section",
        "data.max_length: expected an integer, got string 'many'",
    ):
        assert fragment in text, f"missing {fragment!r} in:\n{text}"
    assert len(problems) == 7
    assert str(path) in text and "command-line overrides" in text


def test_reserved_training_keys_point_to_their_section(tmp_path):
    path = write_recipe(tmp_path, {"training": {"output_dir": "x", "report_to": "wandb"}})
    with pytest.raises(ConfigError) as info:
        load_recipe(str(path))
    assert "training.output_dir: set by run.output_dir" in str(info.value)
    assert "training.report_to: set by logging.report_to" in str(info.value)


def test_range_and_cross_field_checks():
    with pytest.raises(ConfigError) as info:
        build_config(
            {
                "data": {"eval_fraction": 1.5, "max_length": 4},
                "eval": {"exact_match": True},
                "training": {"per_device_train_batch_size": 0, "learning_rate": -1.0},
            }
        )
    text = str(info.value)
    assert "data.eval_fraction: must be in [0, 1), got 1.5" in text
    assert "data.max_length: must be >= 8 tokens, got 4" in text
    assert "eval.heldout_path: required when eval.exact_match is true" in text
    assert "training.per_device_train_batch_size: must be >= 1, got 0" in text
    assert "training.learning_rate: must be > 0, got -1.0" in text


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write_recipe(tmp_path, "model:\n  name_or_path: x\n method: [\n")
    with pytest.raises(ConfigError) as info:
        load_recipe(str(path))
    assert str(path) in str(info.value) and "line 3" in str(info.value)


def test_top_level_must_be_sections(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_recipe(str(write_recipe(tmp_path, "- just\n- a list\n")))
    assert "mapping of sections" in str(info.value)


def test_unknown_recipe_lists_available():
    with pytest.raises(ConfigError) as info:
        load_recipe("no-such-recipe")
    assert "no-such-recipe" in str(info.value) and "demo" in str(info.value)


@pytest.mark.parametrize(
    "arg, expected",
    [
        (["--training.max_steps=3"], {"training": {"max_steps": 3}}),
        (["--training.learning_rate=1e-4"], {"training": {"learning_rate": 1e-4}}),
        (["--data.packing=true"], {"data": {"packing": True}}),
        (["--model.revision=null"], {"model": {"revision": None}}),
        (["--method.target_modules=[q_proj, v_proj]"], {"method": {"target_modules": ["q_proj", "v_proj"]}}),
        (["--run.name", "abc"], {"run": {"name": "abc"}}),
    ],
)
def test_override_values_are_typed(arg, expected):
    values, problems = parse_overrides(arg)
    assert problems == [] and values == expected


def test_malformed_overrides_are_problems():
    _, problems = parse_overrides(["--max_steps=3", "stray", "--run.name"])
    assert len(problems) == 3
    assert "--section.key=value" in problems[0]


def test_an_override_given_twice_takes_the_last_value_in_both_spellings():
    # docs/usage.md: a script that adds to a base command relies on it
    cfg, _ = load_recipe(
        "demo", ["--training.max_steps=3", "--training.max_steps", "5", "--run.name=a", "--run.name=b"]
    )
    assert (cfg.training.args["max_steps"], cfg.run.name) == (5, "b")


def test_every_shipped_recipe_loads_and_validates():
    names = available_recipes()
    assert "demo" in names
    for name in names:
        cfg, path = load_recipe(name)
        first_line = path.read_text().splitlines()[0]
        assert first_line.startswith("#"), f"{name}: recipes open with a comment giving purpose and launch line"
        assert "accelerate launch" in path.read_text() or "finetune train" in path.read_text(), name
        if cfg.run.accelerate_config:
            assert (REPO / cfg.run.accelerate_config).is_file(), f"{name}: {cfg.run.accelerate_config} missing"


def test_every_shipped_launch_config_parses():
    configs = sorted((REPO / "accelerate_configs").rglob("*.yaml"))
    assert configs, "no accelerate configs shipped"
    for path in configs:
        values = yaml.safe_load(path.read_text())
        assert values["distributed_type"] in {"NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP"}, path
        ds = values.get("deepspeed_config", {}).get("deepspeed_config_file")
        if ds:
            assert (REPO / ds).is_file(), f"{path}: {ds} missing"
    for path in sorted((REPO / "ds_configs").glob("*.json")):
        json.loads(path.read_text())


def run_script(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "finetune" / "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bad_recipe_exits_2_with_one_message_and_no_traceback(tmp_path):
    path = write_recipe(tmp_path, {"model": {"dtyp": "float32"}, "training": {"max_step": 3}})
    proc = run_script(["--recipe", str(path)], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "2 problems" in proc.stderr
    assert "model.dtyp" in proc.stderr and "training.max_step" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing was created


def test_existing_run_directory_is_not_touched(tmp_path):
    run_dir = tmp_path / "runs" / "mine"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text('{"precious": true}')
    proc = run_script(["--recipe", "demo", "--run.name=mine"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "already exists" in proc.stderr and "--overwrite" in proc.stderr
    assert (run_dir / "run.json").read_text() == '{"precious": true}'
    assert sorted(p.name for p in run_dir.iterdir()) == ["run.json"]


def test_recipes_dir_is_in_the_repo():
    assert RECIPES_DIR == REPO / "recipes"


def test_a_recipe_without_a_training_section_gets_the_training_defaults(tmp_path):
    """Issue 15 item 6: the section defaults applied only when `training:` was present, so a recipe
    without one crashed later with KeyError 'ddp_timeout'."""
    for values in ({"method": {"name": "lora"}}, {"training": None}, {}):
        cfg = build_config(values)
        assert cfg.training.args == TRAINING_DEFAULTS, values
        assert cfg.training.args["ddp_timeout"] == 1800
    cfg, _ = load_recipe(str(write_recipe(tmp_path, "model:\n  dtype: float32\n")))
    assert cfg.training.args["per_device_train_batch_size"] == TRAINING_DEFAULTS["per_device_train_batch_size"]


@pytest.mark.parametrize("rule", ["linear", "sqrt"])
def test_lr_scaling_without_a_reference_batch_is_an_error_naming_both_keys(rule):
    """Issue 15 item 9: it silently gave factor 1 (the run's own batch was the reference)."""
    with pytest.raises(ConfigError) as info:
        build_config({"training": {"lr_scaling": rule}})
    text = str(info.value)
    assert f"training.lr_scaling: '{rule}' needs training.lr_reference_batch_size" in text
    assert "lr_scaling: none" in text
    cfg = build_config({"training": {"lr_scaling": rule, "lr_reference_batch_size": 4}})  # with one: fine
    assert cfg.training.lr_reference_batch_size == 4
    assert build_config({"training": {"lr_scaling": "none"}}).training.lr_reference_batch_size is None
    from finetune import batch

    with pytest.raises(ValueError, match="needs a reference batch"):
        batch.lr_scaling(1e-3, rule, 8, None)


def test_yes_no_on_off_stay_strings_and_true_false_are_booleans(tmp_path):
    """TrainingArguments takes save_strategy/eval_strategy "no"; YAML 1.1 (PyYAML's safe_load, the
    control here) reads it as False, which TrainingArguments refuses. Recipes and overrides read
    booleans as YAML 1.2 does: only true/false."""
    assert yaml.safe_load("no") is False  # the trap, in the library itself
    path = write_recipe(tmp_path, "training:\n  save_strategy: no\n  gradient_checkpointing: true\n")
    cfg, _ = load_recipe(str(path), ["--training.eval_strategy=no", "--data.packing=False"])
    assert cfg.training.args["save_strategy"] == "no" and cfg.training.args["eval_strategy"] == "no"
    assert cfg.training.args["gradient_checkpointing"] is True and cfg.data.packing is False
    with pytest.raises(ConfigError, match="data.packing"):
        load_recipe(str(path), ["--data.packing=yes"])  # a string now, and packing wants a boolean


# --- issue 23 category 6: a key given twice, values out of range -----------------------------------


def test_a_key_given_twice_is_refused_naming_file_line_and_key(tmp_path):
    """On main the last value silently won (YAML loaders keep it)."""
    path = tmp_path / "twice.yaml"
    path.write_text(
        "training:\n  max_steps: 3\n  learning_rate: 1.0e-4\n  max_steps: 30\n"
        "data:\n  path: x.jsonl\ntraining:\n  seed: 1\n"
        "method:\n  target_modules: [{q: 1, q: 2}]\n"
    )
    with pytest.raises(ConfigError) as err:
        load_recipe(str(path))
    assert str(path) in str(err.value)
    assert err.value.problems == [
        "line 4: key 'training.max_steps' is given twice (first at line 2); only one value can apply: remove the other",
        "line 7: key 'training' is given twice (first at line 1); only one value can apply: remove the other",
        "line 10: key 'method.target_modules[0].q' is given twice (first at line 10); only one value can apply: "
        "remove the other",
    ]
    path.write_text("training:\n  max_steps: 3\n  seed: 3\ndata:\n  max_steps: 3\n")  # control: one per mapping
    with pytest.raises(ConfigError) as err:
        load_recipe(str(path))
    assert "given twice" not in str(err.value) and "data.max_steps: unknown key" in str(err.value)


def test_a_key_given_twice_in_a_launch_config_is_refused(tmp_path):
    from finetune.errors import UserError
    from finetune.launch.configs import read_deepspeed_json, read_yaml

    launch = tmp_path / "launch.yaml"
    launch.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nnum_processes: 4\n")
    with pytest.raises(UserError) as err:
        read_yaml(launch)
    assert f"accelerate config {launch}: line 3: key 'num_processes' is given twice (first at line 2)" in str(err.value)
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2, "stage": 3}, "train_batch_size": "auto"}')
    with pytest.raises(UserError) as err:
        read_deepspeed_json(ds, "the test")
    assert f"DeepSpeed config {ds}: key(s) 'stage' given twice in one object" in str(err.value)
    ds.write_text('{"zero_optimization": {"stage": 2}, "train_batch_size": "auto"}')  # control
    assert read_deepspeed_json(ds, "the test")["zero_optimization"] == {"stage": 2}


@pytest.mark.parametrize(
    "key,value,allowed",
    [
        # each was accepted on main, and trained something else than asked (or nothing)
        ("training.max_steps", -5, ">= 1, or -1 (unset: training.num_train_epochs decides)"),
        ("training.max_steps", 0, ">= 1, or -1 (unset: training.num_train_epochs decides)"),
        ("training.num_train_epochs", 0, "> 0"),
        ("training.learning_rate", 0, "> 0"),
        ("training.warmup_steps", 2.5, "a whole number of steps >= 0, or a ratio of the total steps in [0, 1)"),
        ("training.max_grad_norm", -1.0, ">= 0 (0 turns gradient clipping off)"),
        ("training.weight_decay", -0.1, ">= 0"),
        ("training.adam_beta2", 1.0, "in [0, 1)"),
        ("training.adam_epsilon", 0, "> 0"),
        ("training.label_smoothing_factor", 1.5, "in [0, 1)"),
        ("training.per_device_eval_batch_size", 0, ">= 1"),
        ("training.gradient_accumulation_steps", 0, ">= 1"),
        ("training.save_steps", 0, "a whole number of steps >= 1, or a ratio of the total steps in (0, 1)"),
        ("training.save_total_limit", 0, ">= 1"),
        ("training.seed", -1, "in [0, 2**32)"),
        ("training.dataloader_num_workers", -2, ">= 0"),
        ("training.ddp_timeout", 0, ">= 1 s"),
        ("training.throughput_warmup_steps", -1, ">= 0"),
        ("training.collapse_windows", 0, ">= 1"),
        ("method.lora_alpha", 0, "> 0"),
        ("data.max_length", 0, ">= 8 tokens"),
        ("data.max_empty_target_share", 1.5, "in [0, 1]"),
        ("eval.batch_size", 0, ">= 1"),
    ],
)
def test_values_out_of_range_are_refused_naming_key_and_range(key, value, allowed):
    section, name = key.split(".")
    with pytest.raises(ConfigError) as err:
        build_config({section: {name: value}})
    assert err.value.problems == [f"{key}: must be {allowed}, got {value}"]


@pytest.mark.parametrize(
    "key,value",
    [
        ("training.max_steps", -1),  # the documented "unset"
        ("training.max_steps", 1),
        ("training.warmup_steps", 0.1),  # a ratio
        ("training.warmup_steps", 10),
        ("training.max_grad_norm", 0.0),
        ("training.save_steps", 0.25),
        ("training.save_total_limit", None),
        ("data.max_empty_target_share", 1.0),
    ],
)
def test_values_at_the_edges_of_their_range_are_accepted(key, value):
    section, name = key.split(".")
    build_config({section: {name: value}})


# --- values are what the user typed; a run name is a name ---------------------------------------------

AS_TYPED = object()


@pytest.mark.parametrize(
    "arg, key, expected",
    [
        ("--run.name=keep #2", ("run", "name"), "keep #2"),  # YAML cut it at the comment: `keep`
        ("--run.output_dir=out #1", ("run", "output_dir"), "out #1"),
        ("--data.system_prompt=Answer: briefly. 'Quote' \"it\" #1", ("data", "system_prompt"), AS_TYPED),
        ("--run.name=1e5", ("run", "name"), "1e5"),  # a string key keeps a number-like name a string
        ("--run.name=123", ("run", "name"), "123"),
        ("--run.name=~", ("run", "name"), "~"),  # YAML read `~` as null
        ("--training.learning_rate=1e-4", ("training", "args", "learning_rate"), 1e-4),
        ("--training.max_steps=10", ("training", "args", "max_steps"), 10),
        ("--training.save_strategy=no", ("training", "args", "save_strategy"), "no"),
        ("--data.pad_to_multiple_of=null", ("data", "pad_to_multiple_of"), None),
        ("--logging.report_to=[]", ("logging", "report_to"), []),
    ],
)
def test_an_override_is_read_by_its_keys_type_never_as_yaml(arg, key, expected):
    cfg, _ = load_recipe("demo", [arg])
    value = cfg
    for part in key:
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    expected = arg.split("=", 1)[1] if expected is AS_TYPED else expected
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    "arg, problem",
    [
        ("--data.max_length=512 #tokens", "data.max_length: expected an integer, got string '512 #tokens'"),
        ("--training.max_steps=ten", "training.max_steps: expected an integer, got string 'ten'"),
        ("--data.packing=yes", "data.packing: expected true/false, got string 'yes'"),
        ("--data.eval_fraction=0.1: x", "data.eval_fraction: expected a number, got string '0.1: x'"),
    ],
)
def test_a_value_its_type_cannot_hold_is_refused_naming_key_value_and_type(arg, problem):
    with pytest.raises(ConfigError) as err:
        load_recipe("demo", [arg])
    assert problem in err.value.problems


@pytest.mark.parametrize(
    "name, why",
    [
        ("../../escape", "contains a path separator"),
        ("/tmp/elsewhere", "contains a path separator (an absolute path)"),
        ("a/b", "contains a path separator"),
        ("a\\b", "contains a path separator"),
        ("..", "is the current or the parent folder"),
        (".", "is the current or the parent folder"),
        ("", "is empty"),
        ("line\nbreak", "contains a control character"),
        ("x" * 256, "is 256 bytes long; a folder name holds at most 255"),
    ],
)
def test_a_run_name_that_is_no_folder_name_is_refused_with_the_reason(name, why):
    """Before: `--run.name=../../escape` wrote the run two levels above runs/, an absolute name at that path."""
    with pytest.raises(ConfigError) as err:
        load_recipe("demo", [f"--run.name={name}"])
    (problem,) = [p for p in err.value.problems if p.startswith("run.name:")]
    assert why in problem and "run.output_dir" in problem, problem


@pytest.mark.parametrize("name", ["keep #2", "a: b", "my run", "1e5", "ünïcode 名前", "v1..v2", "-dash", "~"])
def test_a_valid_run_name_with_spaces_hashes_colons_or_unicode_survives_save_and_resume(tmp_path, name):
    """The run directory is runs/<name> exactly, and the saved config.yaml reads back (what --resume
    continues with) with the same name: YAML would have read `1e5` as a number."""
    from finetune.checkpointing import resume_config
    from finetune.launch import rundir

    cfg, _ = load_recipe("demo", [f"--run.name={name}"])
    assert cfg.run.name == name and rundir.resolve_run_dir(cfg.run.name, None) == Path("runs") / name
    run_dir = tmp_path / "runs" / name
    run_dir.mkdir(parents=True)
    rundir.save_resolved_config(run_dir, cfg.to_dict())
    values, _ = resume_config.saved_values(run_dir)
    values.pop("recipe")
    assert values["run"]["name"] == name and build_config(values).run.name == name


def test_training_arguments_fields_read_from_source_match_the_imported_class():
    """The launcher validates TrainingArguments keys from transformers' source (no torch import); the
    names must be the class's init fields, and each type the class's own, with the types the file takes
    from elsewhere (its enums, ParallelismConfig) read as Any."""
    import dataclasses
    import typing

    from transformers import TrainingArguments

    from finetune.config.validate import training_arguments_hints

    ours, real = training_arguments_hints(), typing.get_type_hints(TrainingArguments)
    assert set(ours) == {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    differ = {k for k in ours if ours[k] != real[k]}
    foreign = {k for k in ours if "transformers." in str(real[k]) or "accelerate." in str(real[k])}
    assert differ == foreign and {"optim", "lr_scheduler_type"} <= foreign
    assert typing.Any in typing.get_args(ours["optim"]) and str in typing.get_args(ours["optim"])


def test_training_arguments_moved_out_of_their_file_are_read_from_the_imported_class(tmp_path):
    """A transformers release that moves TrainingArguments out of training_args.py: before, the launcher's
    validation failed with a bare "not enough values to unpack"; now the imported class's fields answer."""
    import dataclasses
    import typing

    from transformers import TrainingArguments

    from finetune.config.validate import training_arguments_hints

    real = typing.get_type_hints(TrainingArguments)
    expected = {f.name: real[f.name] for f in dataclasses.fields(TrainingArguments) if f.init}
    moved = tmp_path / "training_args.py"
    moved.write_text("from .args import TrainingArguments  # moved\n")
    assert training_arguments_hints(moved) == expected
    assert training_arguments_hints(tmp_path / "absent.py") == expected
    assert training_arguments_hints() != expected  # the control: the installed file is read, not imported


def test_a_recipe_with_training_arguments_keys_validates_without_importing_torch():
    """Preflight of `finetune train` (the launcher process) answers a typo without torch's 10+ s import."""
    code = (
        "import sys\n"
        "from finetune.config.recipe import load_recipe\n"
        "problems = []\n"
        "load_recipe('demo', ['--training.lr_scheduler_type=cosine', '--training.warmup_step=1',"
        " '--training.max_grad_norm=big'], problems)\n"
        "print(problems)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    problems, torch_imported = out.strip().splitlines()
    assert "training.warmup_step: unknown key (did you mean 'warmup_steps'?)" in problems
    assert "training.max_grad_norm: expected a number, got string 'big'" in problems
    assert "lr_scheduler_type" not in problems
    assert torch_imported == "False"


@pytest.mark.parametrize(
    ("arg", "problem"),
    [
        ("--data.path=", "data.path: '' is blank; it is required"),
        ("--data.path= ", "data.path: ' ' is blank; it is required"),
        ("--model.name_or_path=", "model.name_or_path: '' is blank; it is required"),
        ("--data.cache_dir=  ", "data.cache_dir: '  ' is blank; leave it out (unset) or give a path"),
        ("--run.output_dir=\t", "run.output_dir: '\\t' is blank; leave it out (unset) or give a path"),
    ],
)
def test_a_blank_path_is_refused_before_anything_starts(arg, problem):
    """Before: data.path '' passed preflight, was launched and looked up on the Hub ('list index out of range');
    model.name_or_path '' said the directory '' exists; data.cache_dir ' ' made a folder ' ' in the working directory."""
    with pytest.raises(ConfigError) as err:
        load_recipe("demo", [arg, "--eval.exact_match=false"])
    assert problem in err.value.problems, err.value.problems


def test_an_empty_optional_path_is_unset():
    """Control: '' stays what it was for the optional paths, the default (the runs use it so, e.g. output_dir)."""
    cfg, _ = load_recipe("demo", ["--data.cache_dir=", "--model.tokenizer_name_or_path=", "--run.output_dir="])
    assert (cfg.data.cache_dir, cfg.model.tokenizer_name_or_path, cfg.run.output_dir) == ("", "", "")
