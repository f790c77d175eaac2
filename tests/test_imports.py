"""The package's shape, read from its source (every import statement, the ones inside functions
too): no import cycle, dependencies pointing one way between the subpackages, nothing importing the
CLI, no private name used across modules, no module over 600 lines, no function over 80 lines, no
class defined inside a function and no state kept at module level. Each check is shown to fail on a
crafted case."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

MAX_LINES = 600  # a cap on size; cohesion decides where a module's parts live
MAX_FUNCTION_LINES = 80  # a longer function is split into named steps that read top to bottom
# Over those limits and allowed to stay (none today): each entry says why.
LONG_FUNCTIONS: set[str] = set()
CLASSES_IN_FUNCTIONS: set[str] = set()
MODULE_STATE = {
    "finetune.held_back: TRACEBACKS.handlers changed in a function": "a logger: logging's registry is process-wide "
    "by design (like os.environ), and the run directory's log file is where its records go",
    "finetune.held_back: KEPT.disabled changed in a function": "a logger, as TRACEBACKS: the notices a rank held "
    "back reach the run's log file once the run trains (keep_held), not when its directory is made",
    "finetune.fingerprints: _unwritable changed in a function": "the fingerprint cache directories this process said "
    "are unusable, so each is said once whichever Cache finds it (the inputs' work; to be handed to its Caches)",
}
# Who may import whom: a module may import from its own subpackage and from any lower layer.
# The CLI wires everything; nothing imports it (or the launch script finetune/train.py). The flag
# style and options every entry point shares live in config/command_line.py.
LAYERS = [
    {"finetune.errors", "finetune.held_back"},
    {
        "finetune.units",
        "finetune.strategies",
        "finetune.resources",
        "finetune.batch",
        "finetune.mesh",
    },
    # process-wide: the console streams, filesystem failures, the input files' content fingerprints
    {"finetune.console", "finetune.storage", "finetune.fingerprints"},
    {"finetune.precision"},  # the policy table: reads the strategy table
    {"finetune.data"},  # the data formats (config reads their table), reading, rendering
    {"finetune.config"},
    {"finetune.modeling"},
    {"finetune.launch", "finetune.telemetry", "finetune.planning"},
    {"finetune.preflight", "finetune.checkpointing"},
    {"finetune.export"},  # the check of a save and `finetune export`: reads checkpoints, used by the run's end
    {"finetune.training"},
    {"finetune.compare", "finetune.bench"},
    {"finetune.doctor"},  # runs the others through the CLI; uses compare's page style and comparability rule
    {"finetune.cli"},
    {"finetune"},  # the package's __init__: installs finetune/held_back.py's filters in every process
]


def module_files(root: Path = REPO / "finetune") -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(path: Path, name: str, known: set[str]) -> dict[str, list[str]]:
    """finetune module imported -> names taken from it (attributes used through an alias included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: dict[str, list[str]] = {}
    aliases: dict[str, str] = {}  # local name -> finetune module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if base != "finetune" and not base.startswith("finetune."):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:  # `from finetune.x import module`
                    out.setdefault(sub, [])
                    aliases[alias.asname or alias.name] = sub
                else:
                    out.setdefault(base, []).append(alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("finetune."):
                    out.setdefault(alias.name, [])
                    if alias.asname:
                        aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            out[aliases[node.value.id]].append(node.attr)
    return out


def graph() -> dict[str, dict[str, list[str]]]:
    files = module_files()
    return {name: imports(path, name, set(files)) for name, path in files.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), and self-imports."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if any(module == top or module.startswith(top + ".") for top in layer):
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_imports.py LAYERS")


def subpackage(module: str) -> str:
    return ".".join(module.split(".")[:2])


def layering_problems(g: dict[str, dict[str, list[str]]]) -> list[str]:
    problems = []
    for src, targets in g.items():
        if src == "finetune.train":
            continue  # the launch script: it only calls finetune.training.run
        for dst in targets:
            if dst == "finetune.train":
                problems.append(f"{src} imports the launch script finetune.train")
            elif dst != "finetune" and subpackage(dst) != subpackage(src) and layer_of(dst) >= layer_of(src):
                problems.append(f"{src} imports {dst}, which is not below it")
    return problems


def private_uses(g: dict[str, dict[str, list[str]]]) -> list[str]:
    return [
        f"{src} uses {dst}.{n}"
        for src, targets in g.items()
        for dst, names in targets.items()
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]


def test_no_import_cycle():
    edges = {src: set(targets) - {"finetune"} for src, targets in graph().items()}
    assert cycles(edges) == []
    # control: the cycle this project had (preflight <-> strategy, through check_world_size)
    edges["finetune.preflight.checks"].add("finetune.training.strategy_evidence")
    edges["finetune.training.strategy_evidence"].add("finetune.preflight.checks")
    assert ["finetune.preflight.checks", "finetune.training.strategy_evidence"] in cycles(edges)


def test_dependencies_point_one_way():
    g = graph()
    assert layering_problems(g) == []
    g["finetune.preflight.checks"]["finetune.cli.dispatch"] = []  # control: an edge back toward the CLI
    assert layering_problems(g) == ["finetune.preflight.checks imports finetune.cli.dispatch, which is not below it"]


def cli_importers(g: dict[str, dict[str, list[str]]]) -> list[str]:
    """Modules outside finetune/cli that import from it (the launch script and the package's __init__ too)."""
    return sorted(
        f"{src} imports {dst}"
        for src, targets in g.items()
        for dst in targets
        if subpackage(dst) == "finetune.cli" and subpackage(src) != "finetune.cli"
    )


def test_nothing_outside_the_cli_imports_it():
    g = graph()
    assert cli_importers(g) == []
    g["finetune.train"]["finetune.cli.compare"] = []  # control: the launch script is not exempt here
    assert cli_importers(g) == ["finetune.train imports finetune.cli.compare"]


def test_no_private_name_used_across_modules():
    g = graph()
    assert private_uses(g) == []
    tests = {name: imports(path, name, set(module_files())) for name, path in module_files(REPO / "tests").items()}
    assert private_uses(tests) == []
    g["finetune.bench.worker"]["finetune.data.pack"] = ["_empty_packed_row"]  # control
    assert private_uses(g) == ["finetune.bench.worker uses finetune.data.pack._empty_packed_row"]


@pytest.mark.parametrize("name, path", sorted(module_files().items()), ids=lambda v: v if isinstance(v, str) else "")
def test_module_is_small(name, path):
    assert len(path.read_text(encoding="utf-8").splitlines()) <= MAX_LINES, f"{name} is over {MAX_LINES} lines"


def long_functions(source: str, module: str) -> list[str]:
    """`module.function` (methods and nested functions too) of every function over MAX_FUNCTION_LINES."""
    return [
        f"{module}.{node.name}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def classes_in_functions(source: str, module: str) -> list[str]:
    """`module.function.Class` of every class defined inside a function (at any depth)."""
    return [
        f"{module}.{node.name}.{inner.name}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for inner in ast.walk(node)
        if isinstance(inner, ast.ClassDef)
    ]


def test_functions_are_short():
    found = {f for name, path in module_files().items() for f in long_functions(path.read_text(encoding="utf-8"), name)}
    assert found <= LONG_FUNCTIONS, f"over {MAX_FUNCTION_LINES} lines: {sorted(found - LONG_FUNCTIONS)}"
    # control: a function one line over the limit, and one at it
    over = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    at = "def g():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1)
    assert long_functions(over + at, "m") == ["m.f"]


def test_no_class_is_defined_inside_a_function():
    found = {
        c for name, path in module_files().items() for c in classes_in_functions(path.read_text(encoding="utf-8"), name)
    }
    assert found <= CLASSES_IN_FUNCTIONS, f"classes defined inside functions: {sorted(found - CLASSES_IN_FUNCTIONS)}"
    # control: the pattern the benchmark's worker had (a callback class inside its run)
    assert classes_in_functions("def run():\n    class Clock:\n        pass\n", "m") == ["m.run.Clock"]
    assert classes_in_functions("class Clock:\n    def tick(self):\n        pass\n", "m") == []


MUTATORS = {"append", "extend", "insert", "remove", "pop", "clear", "update", "setdefault", "add", "discard", "sort"}
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _base(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _bound(node) -> set[str]:
    """Names a module or a function binds in its own scope (parameters included; not in nested functions or
    comprehensions); imports are left out."""
    params = node.args if isinstance(getattr(node, "args", None), ast.arguments) else None
    names = {a.arg for a in ast.walk(params) if isinstance(a, ast.arg)} if params else set()
    todo = list(node.body) if isinstance(node.body, list) else [node.body]
    while todo:
        n = todo.pop()
        if isinstance(n, SCOPES):
            names.add(getattr(n, "name", ""))
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif not isinstance(n, COMPREHENSIONS):
            todo.extend(ast.iter_child_nodes(n))
    return names


def _finetune_imports(tree: ast.Module) -> set[str]:
    """Names bound by importing from finetune (its modules and what they hold), anywhere in the module."""
    return {
        (alias.asname or alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and (getattr(node, "module", None) or "").startswith("finetune")
        | any(a.name.startswith("finetune") for a in node.names)
        for alias in node.names
    }


def _changed(node: ast.AST) -> list[ast.expr]:
    """What a statement or call changes in place: item and attribute targets, and a mutating method's object."""
    if isinstance(node, (ast.Assign, ast.Delete)):
        return [t for t in node.targets if isinstance(t, (ast.Attribute, ast.Subscript))]
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, (ast.Attribute, ast.Subscript)):
        return [node.target]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        return [node.func.value]
    return []


def module_state(source: str, module: str) -> list[str]:
    """What keeps state at module level: a function that rebinds a global, or that changes in place a value this
    module binds at its top or one bound in another finetune module (`peers.watch.grace_s = ...`). Import-time
    set-up at the top of a module is not state; the process environment (os.environ) is how launches talk."""
    tree = ast.parse(source)
    shared = _bound(tree) | _finetune_imports(tree)
    found = []

    def visit(node: ast.AST, local: set[str] | None) -> None:  # local: None outside any function
        for child in ast.iter_child_nodes(node):
            inner = local
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = (local or set()) | _bound(child)
            elif local is not None and isinstance(child, ast.Global):
                found.extend(f"{module}: `global {name}`" for name in child.names)
            elif local is not None:
                for target in _changed(child):
                    base = _base(target)
                    if isinstance(base, ast.Name) and base.id in shared and base.id not in local:
                        found.append(f"{module}: {ast.unparse(target)} changed in a function")
            visit(child, inner)

    visit(tree, None)
    return sorted(set(found))


def test_no_state_is_kept_at_module_level():
    """The phases hand what they share to each other (the watchdog, the stop signals, the locks held): nothing
    a function changes lives at a module's top, where every caller in the process would share it."""
    found = [f for name, path in module_files().items() for f in module_state(path.read_text(encoding="utf-8"), name)]
    assert set(found) <= set(MODULE_STATE), sorted(set(found) - set(MODULE_STATE))
    # controls: the signal list and the watchdog settings this project kept at module level
    kept = "received: list[int] = []\n\ndef handler(signum, frame):\n    received.append(signum)\n"
    assert module_state(kept, "m") == ["m: received changed in a function"]
    reach = "from finetune.launch import peers\n\ndef run(cfg):\n    peers.watch.grace_s = cfg.grace\n"
    assert module_state(reach, "m") == ["m: peers.watch.grace_s changed in a function"]
    rebound = "step = 0\n\ndef done(n):\n    global step\n    step = n\n"
    assert module_state(rebound, "m") == ["m: `global step`"]
    handed = "def run(watch, cfg):\n    watch.grace_s = cfg.grace\n    seen = []\n    seen.append(1)\n"
    assert module_state(handed, "m") == []  # a parameter's and a local's: not module state


def documented_layers(text: str) -> list[set[str]]:
    """The numbered list of docs/architecture.md "The layers": each item's backticked names before its colon."""
    section = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    items = re.findall(r"^\d+\. (.+?): ", section, flags=re.MULTILINE)
    return [{f"finetune.{n}" if n != "finetune" else n for n in re.findall(r"`([^`]+)`", item)} for item in items]


def test_the_documented_layers_are_the_checked_ones():
    """The layers are written once (LAYERS above); docs/architecture.md's list is held to it, name by name and in order."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert documented_layers(text) == LAYERS
    swapped = text.replace("4. `precision`:", "4. `data`:").replace("5. `data`:", "5. `precision`:")  # control
    assert documented_layers(swapped) != LAYERS
