"""The shape of the package: no import cycles, names only in the registries."""

from __future__ import annotations

import ast
from pathlib import Path

import protofl

SRC = Path(protofl.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth (functions too); those under ``if TYPE_CHECKING:``
    only with ``type_checking``."""
    out: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if (
                not type_checking
                and isinstance(child, ast.If)
                and "TYPE_CHECKING" in ast.unparse(child.test)
            ):
                for alt in child.orelse:
                    walk(alt)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                out.append(child)
            walk(child)

    walk(tree)
    return out


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the protofl modules it imports (a package import counts as its __init__);
    ``type_checking`` counts the imports under ``if TYPE_CHECKING:`` too."""
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text()), type_checking):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                while t and t not in files and "." in t:
                    t = t.rpartition(".")[0]
                if t in files and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert graph.get("protofl.engine.simulation")
    assert cycles(graph) == [], "import cycles (imports inside functions count too)"


def test_no_import_cycles_even_for_type_checking() -> None:
    """The annotations too: a cycle through ``if TYPE_CHECKING:`` imports is a real one."""
    assert cycles(import_graph(type_checking=True)) == [], "import cycles (TYPE_CHECKING counts)"


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_engine_does_not_import_the_attacks() -> None:
    graph = import_graph(type_checking=True)
    for mod in (m for m in graph if m.startswith("protofl.engine")):
        assert not any(t.startswith("protofl.attacks") for t in graph[mod]), mod


# ----- layers that point one way ----------------------------------------------------------------
# low -> high: a module imports modules of its own layer or of lower ones (a package stands for
# its modules; the longest name that matches places a module)
LAYERS: list[set[str]] = [
    {"protofl", "protofl.errors", "protofl.registry", "protofl.seeding", "protofl.yamlio"}
    | {"protofl._version", "protofl.extras", "protofl.progress"},
    {"protofl.presets", "protofl.privacy"},
    {"protofl.config"},  # composes protofl.privacy.config
    {"protofl.models"},
    {"protofl.data"},  # data.features runs the backbones
    {"protofl.methods"},
    {"protofl.engine"},
    {"protofl.sweeps"},  # runs grid points through the engine registry
    {"protofl.attacks"},  # registers its hooks with protofl.engine.hooks
    {"protofl.report"},
    {"protofl.api", "protofl.cli"},
]
# the upward edges that remain, each with its reason: this list may only shrink
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    ("protofl", "protofl.api"): (
        "protofl.run, loaded on first use (a module __getattr__): no module imports the package"
    ),
    ("protofl.engine.runner", "protofl.report.tensorboard"): (
        "run.tensorboard's per-round scalars; the logger could move into the engine"
    ),
}


def layer_of(module: str) -> int:
    matches = [
        (len(name), i)
        for i, names in enumerate(LAYERS)
        for name in names
        if module == name or (name != "protofl" and module.startswith(name + "."))
    ]
    assert matches, f"{module} is in no layer: add it to LAYERS"
    return max(matches)[1]


def test_layers_point_one_way() -> None:
    """No module imports a module of a higher layer (inside functions and under
    ``if TYPE_CHECKING:`` too) except the listed ALLOWED_UPWARD edges."""
    graph = import_graph(type_checking=True)
    upward = {
        (mod, target)
        for mod, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(mod)
    }
    assert sorted(upward - set(ALLOWED_UPWARD)) == [], "imports of a higher layer"
    assert sorted(set(ALLOWED_UPWARD) - upward) == [], "ALLOWED_UPWARD names a removed edge"


def test_the_layer_check_sees_an_upward_import() -> None:
    assert layer_of("protofl.engine.runner") > layer_of("protofl.methods.base")
    assert layer_of("protofl.attacks.mia") > layer_of("protofl.engine.hooks")
    assert layer_of("protofl.progress") == 0 < layer_of("protofl.report.html")


def test_code_shape_measures_functions_and_methods() -> None:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "code_shape.py"
    spec = importlib.util.spec_from_file_location("code_shape", path)
    assert spec is not None and spec.loader is not None
    code_shape = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(code_shape)
    source = (
        "def f():\n    return 1\n\n\n"
        "class C:\n    @staticmethod\n    def g():\n        x = 1\n        return x\n"
    )
    assert sorted(code_shape.function_lengths(source)) == [(2, "f"), (4, "C.g")]


def test_cli_choices_come_from_the_registries() -> None:
    from protofl.cli import build_parser
    from protofl.engine.engines import ENGINE_REGISTRY
    from protofl.privacy.base import private_mechanisms, sum_mechanisms

    parser = build_parser()
    actions = {a.dest: a for a in parser._subparsers._group_actions[0].choices["run"]._actions}  # type: ignore[union-attr]
    assert list(actions["engine"].choices) == ENGINE_REGISTRY.names()
    audit = parser._subparsers._group_actions[0].choices["audit"]  # type: ignore[union-attr]
    mech = {a.dest: a for a in audit._actions}["mechanism"]
    assert private_mechanisms() == ["igpp", "vpdr", "vpp"]
    assert list(mech.choices) == [*private_mechanisms(), *sum_mechanisms()]
    assert sum_mechanisms() == ["ddg"]


def test_an_unknown_engine_or_mechanism_is_named_by_its_registry() -> None:
    import pytest

    from protofl.config import ExperimentConfig
    from protofl.engine.engines import run_engine
    from protofl.engine.federated_data import preflight

    with pytest.raises(ValueError, match=r"unknown engine 'flwr'.*valid engines: flower"):
        run_engine(ExperimentConfig().with_overrides(["run.engine=flwr"]))
    with pytest.raises(ValueError, match=r"unknown mechanism 'igppp'.*did you mean 'igpp'"):
        preflight(ExperimentConfig().with_overrides(["privacy.mechanism=igppp"]))


# ----- tests follow the source layout ------------------------------------------------------------
TESTS = Path(__file__).resolve().parent
# behaviour across modules: whole runs under faults, the engines' parity, real images through
# every loader, the examples, the installed package and this file
CROSS_CUTTING = {
    "test_architecture",
    "test_benchmarks",  # benchmarks/ (as test_examples tests examples/)
    "test_examples",
    "test_packaging",
    "engine/test_faults",
    "engine/test_offload_state",  # run.client_state=disk: engine/batched.py and simulation.py
    "engine/flower/test_engine",
    "engine/flower/test_weights",
    "engine/flower/test_flower_app",  # the generated app: flower/app/__init__.py and run.py
    "engine/flower/test_node_ledger",  # privacy/node_ledger.py through the Flower client app
    "engine/test_client_local",  # the client-local folder: engine/rundir.py and runner.py
    "data/test_real_images",
    "engine/test_preflight",  # federated_data.preflight through run_experiment and the CLI
    "privacy/test_sampling",  # privacy.sample_rate: accounting.py, prototype.py, igpp.py, audit
}


def test_every_test_module_names_the_source_module_it_tests() -> None:
    """``tests/<package>/test_<module>.py`` tests ``src/protofl/<package>/<module>.py``."""
    orphans = []
    for path in sorted(TESTS.rglob("test_*.py")):
        rel = path.relative_to(TESTS).with_suffix("")
        key = rel.as_posix()
        source = SRC.joinpath(*rel.parts[:-1], rel.name.removeprefix("test_") + ".py")
        if key not in CROSS_CUTTING and not source.is_file():
            orphans.append(key)
    assert not orphans, f"test modules without a source module of that name: {orphans}"
    missing = sorted(c for c in CROSS_CUTTING if not (TESTS / f"{c}.py").is_file())
    assert not missing, f"CROSS_CUTTING names test modules that do not exist: {missing}"
