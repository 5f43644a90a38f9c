"""The shape the code keeps: a module that reads like the algorithm, short functions, files split by concern, and
layers that import downwards only (no import circle; nothing below the CLI imports the module)."""

import ast
import os
import re
import subprocess
import sys

from conftest import RECIPES

ROOT = os.path.dirname(RECIPES)
PACKAGES = {"rllight": "rllight", "callbacks": "rllight.callbacks"}  # folder -> import name

MAX_FILE_LINES = 500
LONG_FILES: dict[str, str] = {}  # a file of rllight/, callbacks/ or tools/ over MAX_FILE_LINES -> why it stays long


def _modules() -> dict[str, str]:
    """Import name -> file, for every module of rllight (callbacks/ is rllight.callbacks)."""
    found = {}
    for folder, package in PACKAGES.items():
        for path, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(path, f), os.path.join(ROOT, folder))[:-3]
                    parts = [p for p in rel.split(os.sep) if p != "__init__"]
                    found[".".join([package, *parts])] = os.path.join(path, f)
    return found


def _imports(path: str, known: dict[str, str]) -> set[str]:
    """The rllight modules a file imports anywhere in it (top level, TYPE_CHECKING blocks, function bodies)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rllight"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("rllight"))
    return {m for m in out if m in known}


def test_the_module_stays_short_and_no_function_is_long():
    with open(os.path.join(ROOT, "rllight", "module.py")) as f:
        assert len(f.readlines()) <= 450
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 70:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_no_file_is_over_500_lines_unless_listed_with_its_reason():
    """A file over ``MAX_FILE_LINES`` usually holds several concerns: split it along them, or list it in
    ``LONG_FILES`` with the reason it stays long. A listed file that is no longer long leaves the list."""
    sizes = {}
    for folder in ("rllight", "callbacks", "tools"):
        for path, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(path, f)) as source:
                        rel = os.path.relpath(os.path.join(path, f), ROOT).replace(os.sep, "/")
                        sizes[rel] = len(source.readlines())
    long = {rel: n for rel, n in sizes.items() if n > MAX_FILE_LINES}
    assert {rel: n for rel, n in long.items() if rel not in LONG_FILES} == {}, "split by concern, or list with a reason"
    assert [rel for rel in LONG_FILES if rel not in long] == [], "no longer over the limit: strike from LONG_FILES"
    assert all(isinstance(why, str) and why.strip() for why in LONG_FILES.values())


def test_no_import_circle_only_the_cli_imports_the_module_and_the_core_not_the_desk():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert sorted(m for m, deps in graph.items() if "rllight.module" in deps) == ["rllight.app.cli"]
    # The front desk (rllight.app) stands above the core: nothing below it imports it.
    desk = {m for m in graph if m == "rllight.app" or m.startswith("rllight.app.")}
    assert {m: sorted(deps & desk) for m, deps in graph.items() if m not in desk | {"rllight.__main__"} and deps & desk} \
        == {}, "the core imports nothing from rllight.app"
    # Depth-first search for a cycle; on finding one, report it.
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state:
            assert visit(start) is None, " -> ".join(path)



def _private(name: str) -> bool:
    """A name kept to its own file: one leading underscore, not a dunder; ``_compat`` is the one compat module."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name != "_compat"


def _private_imports(path: str, known: dict[str, str]) -> list[str]:
    """Each private name of another rllight module that the file at ``path`` uses: ``from rllight.x import _y``,
    and ``x._y`` (or ``rllight.x._y``) on an rllight module it imported, as ``line: module._name``."""
    tree = ast.parse(open(path).read())
    bound: dict[str, str] = {}  # local name -> the rllight module it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rllight"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if name in known:
                    bound[alias.asname or alias.name] = name
                if _private(alias.name):
                    found.append(f"{node.lineno}: {name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("rllight"):
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "rllight"
                    found += [f"{node.lineno}: {alias.name}" for part in alias.name.split(".") if _private(part)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            parts, value = [], node.value
            while isinstance(value, ast.Attribute):
                parts.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                module = ".".join([bound[value.id], *parts])
                if module in known:
                    found.append(f"{node.lineno}: {module}.{node.attr}")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def test_no_private_name_is_imported_from_another_file():
    """A name with one leading underscore stays in its file: a helper another file needs is made public (or moves
    to where it is used). Neither ``from rllight.x import _y`` nor ``x._y`` on an imported rllight module is
    allowed in rllight/, callbacks/ or tools/ (dunders are public; ``rllight._compat`` is the compat module)."""
    modules = _modules()
    files = list(modules.values())
    for path, _, names in os.walk(os.path.join(ROOT, "tools")):
        files += [os.path.join(path, f) for f in names if f.endswith(".py")]
    offenders = [f"{os.path.relpath(path, ROOT)}:{line}" for path in sorted(files)
                 for line in _private_imports(path, modules)]
    assert offenders == [], "make the name public where it is shared, or move the code to where it is used"


def test_the_private_import_check_sees_both_spellings(tmp_path):
    """The check above can fail: a ``from`` import of a private name and an attribute on an imported module."""
    source = tmp_path / "user.py"
    source.write_text("from rllight.errors import _hidden, one_line\nimport rllight.errors as errors\n"
                      "import rllight.errors\nfrom rllight import errors as e2\nfrom rllight import _compat\n"
                      "errors._a\nrllight.errors._b\ne2._c\nerrors.__name__\n_compat.x\none_line._d\n")
    assert _private_imports(str(source), _modules()) == [
        "1: rllight.errors._hidden", "6: rllight.errors._a", "7: rllight.errors._b", "8: rllight.errors._c"]


def test_a_vllm_test_skips_where_vllm_is_not_installed(tmp_path):
    """The ``vllm`` marker skips the test without vLLM (tests/conftest.py), also one whose body would fail before
    an importorskip: here vLLM is hidden from a child pytest on tests/rollout/test_vllm_lora.py."""
    (tmp_path / "hide_vllm.py").write_text('import sys\n\nsys.modules["vllm"] = None  # import vllm fails\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    tests = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-rs", "-m", "vllm", "-p", "hide_vllm",
                          "-p", "no:cacheprovider", os.path.join(tests, "rollout", "test_vllm_lora.py")], cwd=tests, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:]
    assert re.search(r"test_a_rollout_worker_running_vllm_gets_the_base_weights_once_and_then_the_adapter "
                     r"SKIPPED", run.stdout), run.stdout[-3000:]
    assert re.search(r"SKIPPED \[\d+\] (rollout/)?test_vllm_lora.py:\d+: vLLM is not installed", run.stdout), run.stdout[-3000:]
    assert not re.search(r"\b(FAILED|ERROR)\b", run.stdout), run.stdout[-3000:]


def test_tests_mirror_the_package_layout():
    """The tests of ``rllight/<sub>/`` live in ``tests/<sub>/`` (and those of ``tools/``, ``recipes/`` and ``docs/``
    in folders of those names); tests of rllight's top-level modules and of whole runs stay in ``tests/``. A test
    file named after a module of a subpackage (``test_worker.py`` for ``rllight/rollout/worker.py``) lives in that
    subpackage's folder; fixture files live in ``tests/assets/``."""
    tests = os.path.join(ROOT, "tests")
    subpackages = {name for name in os.listdir(os.path.join(ROOT, "rllight"))
                   if os.path.isfile(os.path.join(ROOT, "rllight", name, "__init__.py"))}
    folders = {name for name in os.listdir(tests) if os.path.isdir(os.path.join(tests, name))} - {"__pycache__"}
    assert folders - {"assets"} <= subpackages | {"tools", "recipes", "docs", "callbacks"}
    top_level = {name[:-3] for name in os.listdir(os.path.join(ROOT, "rllight")) if name.endswith(".py")}
    home = {name[:-3]: sub for sub in subpackages for name in os.listdir(os.path.join(ROOT, "rllight", sub))
            if name.endswith(".py") and name != "__init__.py"}
    home.update({sub: sub for sub in subpackages})  # test_<subpackage>.py belongs in its folder too
    misplaced = [name for name in os.listdir(tests) if name.startswith("test_") and name.endswith(".py")
                 and name[5:-3] in home and name[5:-3] not in top_level]
    assert misplaced == [], "move them into the folder of the subpackage they test"
    for folder in folders - {"assets"}:  # no two test files of one name: pytest imports them by their base name
        for name in os.listdir(os.path.join(tests, folder)):
            assert not os.path.exists(os.path.join(tests, name)) or not name.startswith("test_"), name
