"""The package's layout: sub-packages by stage, dependencies running one way, no import cycle.

Imports are read from the source (module level and inside functions alike), so a lazy import
cannot hide a cycle."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "workflow" / "eagleflow"

# Lower stages first; a sub-package may import only from itself and the ones before it.
ORDER = [
    "logs",
    "target",
    "engine",
    "data",
    "store",
    "capture",
    "serve",
    "regenerate",
    "extract",
    "draft",
    "plan",
    "train",
    "export",
    "evaluate",
    "embedded",
]


def imported_modules(path: Path) -> set[str]:
    """The absolute imports of the source file `path`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def module_imports() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[name] = {m for m in imported_modules(path) if m.split(".")[0] == "eagleflow"}
    return graph


def stage(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_sub_packages_mirror_the_stages():
    subs = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    # Every stage is named once, and is a sub-package or a single module; every sub-package and
    # top-level module is a stage.
    assert len(ORDER) == len(set(ORDER)), ORDER
    assert subs == set(ORDER) - modules, sorted(subs ^ (set(ORDER) - modules))
    assert modules <= set(ORDER), sorted(modules - set(ORDER))


def test_dependencies_run_one_way():
    wrong = []
    for module, imports in module_imports().items():
        for imported in imports:
            a, b = stage(module), stage(imported)
            if a and b and a != b and ORDER.index(b) > ORDER.index(a):
                wrong.append(f"{module} imports {imported} ({a} comes before {b})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph = module_imports()
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(module, stack):
        if state.get(module) == 1:
            raise AssertionError(" -> ".join(stack[stack.index(module) :] + [module]))
        if state.get(module) == 2 or module not in graph:
            return
        state[module] = 1
        for imported in sorted(graph[module]):
            visit(imported, stack + [module])
        state[module] = 2

    for module in sorted(graph):
        visit(module, [])


def test_test_modules_do_not_import_each_other():
    """What tests share lives in tests/support/: a test module (or conftest, pytest's plugin) is
    not a library, and a helper in one is found by reading the wrong file."""
    tests = Path(__file__).resolve().parent
    test_modules = {p.stem for p in tests.glob("test_*.py")} | {"conftest"}
    wrong = [
        f"{path.relative_to(tests)} imports {module}"
        for path in sorted(tests.rglob("*.py"))
        for module in sorted(imported_modules(path))
        if module.split(".")[0] in test_modules
    ]
    assert not wrong, "\n".join(wrong)


# Planning runs where the workflow does (Snakemake's process, a login node): no torch there.
TORCH_FREE = ["plan"]


def test_planning_imports_no_torch():
    """No module of a torch-free stage imports torch, itself or through the eagleflow modules it
    imports (lazy imports included)."""
    graph = module_imports()
    paths = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    wrong = []
    for start in sorted(m for m in graph if stage(m) in TORCH_FREE):
        seen, todo = set(), [[start]]
        while todo:
            route = todo.pop()
            module = route[-1]
            if module in seen or module not in graph:
                continue
            seen.add(module)
            if any(m.split(".")[0] == "torch" for m in imported_modules(paths[module])):
                wrong.append(" -> ".join(route) + " -> torch")
            todo.extend(route + [m] for m in sorted(graph[module]))
    assert not wrong, "\n".join(wrong)


# The trainer stage reads as a set of components: no function longer than this (issue 35).
LONGEST_FUNCTION = {"train": 80}


def test_the_trainers_functions_are_short():
    wrong = []
    for stage_name, limit in LONGEST_FUNCTION.items():
        for path in sorted((PACKAGE / stage_name).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        wrong.append(f"{path.name}:{node.lineno} {node.name}: {lines} lines")
    assert not wrong, "\n".join(wrong)


# The `draft:` section has one reader: the typed record (`eagleflow.plan.settings.DraftSettings`)
# that every rule, script and check is given (issue 35).
DRAFT_SECTION_READER = PACKAGE / "plan" / "settings.py"


def reads_the_draft_section(node: ast.AST) -> bool:
    """`config["draft"]` or `<...>.config["draft"]` (snakemake.config), or `.get("draft")`
    on either; `evaluate.draft` is another key, read from `config["evaluate"]`."""

    def is_config(value):
        return (isinstance(value, ast.Name) and value.id == "config") or (
            isinstance(value, ast.Attribute) and value.attr == "config"
        )

    if isinstance(node, ast.Subscript) and is_config(node.value):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "draft"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        f = node.func
        return (
            f.attr == "get"
            and is_config(f.value)
            and bool(node.args)
            and (isinstance(node.args[0], ast.Constant) and node.args[0].value == "draft")
        )
    return False


def test_the_draft_section_is_read_by_its_typed_record_alone():
    workflow = PACKAGE.parent
    repo = workflow.parent
    sources = [*workflow.rglob("*.py"), *workflow.rglob("*.smk"), repo / "Snakefile"]
    sources += repo.glob("benchmarks/*.py")  # they read the workflow's config too
    wrong = []
    for path in sorted(sources):
        text = path.read_text()
        if path.suffix == ".py":
            hits = [n.lineno for n in ast.walk(ast.parse(text)) if reads_the_draft_section(n)]
        else:  # Snakemake's grammar is not Python's: the same reads, by their text
            hits = [
                i
                for i, line in enumerate(text.splitlines(), 1)
                if 'config["draft"]' in line or 'config.get("draft"' in line
            ]
        if path != DRAFT_SECTION_READER:
            wrong += [f"{path.relative_to(repo)}:{line}" for line in hits]
    assert not wrong, "read DraftSettings instead:\n" + "\n".join(wrong)
