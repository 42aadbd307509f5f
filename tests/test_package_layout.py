"""The package's shape: modules of one concern, talking to each other through public names, without
import cycles.

A module may use its own private names, and a package may import its own private helper modules
(``torchmn.communicators._wire``); what it may not do is reach into another module's private
names (``from torchmn.x import _helper``, ``comm._something``, or ``self._something`` that a base
class or mixin in another module defines), so that a maintainer can change a module's private
parts without reading the rest of the package. Modules import each other without cycles, also
counting the imports made inside functions (an import moved into a function to break a cycle
still makes one).
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "torchmn"
# A cohesive module of this size reads fine (ChainerMN's communicator base, torch's run.py); past it,
# a module holds more than one concern.
MAX_LINES = 1000


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _owners() -> dict:
    """Every private name torchmn defines (functions, classes, module variables, methods and
    attributes set on ``self``), and the modules that define it."""
    owners: dict = {}
    for path, tree in _modules():
        module = _module_name(path)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for leaf in ast.walk(t):
                        if isinstance(leaf, ast.Name):
                            names.append(leaf.id)
                        elif isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) \
                                and leaf.value.id in ("self", "cls"):
                            names.append(leaf.attr)
            for name in names:
                if _private(name):
                    owners.setdefault(name, set()).add(module)
    return owners


def _reaches():
    """(where, what) for each use of another module's private name."""
    owners = _owners()
    for path, tree in _modules():
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchmn"):
                for alias in node.names:
                    if _private(alias.name) and f"{node.module}.{alias.name}" not in owners.get(alias.name, ()):
                        # A private name imported from another module (a private *module* of the
                        # importing package is fine: it is that package's own helper).
                        if not (node.module == package and (PACKAGE.parent / node.module.replace(".", "/")
                                                            / f"{alias.name}.py").exists()):
                            yield f"{where}:{node.lineno}", f"from {node.module} import {alias.name}"
                parts = node.module.split(".")
                hidden = [i for i, p in enumerate(parts) if _private(p)]
                if hidden and ".".join(parts[:hidden[0]]) != package:
                    yield f"{where}:{node.lineno}", f"from {node.module} import ... (another package's private module)"
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in owners:
                value = node.value
                if module not in owners[node.attr]:
                    yield f"{where}:{node.lineno}", f"{ast.unparse(value)}.{node.attr}"


def _imports():
    """{module: the torchmn modules it imports}, at module level and inside functions alike; imports
    only type checkers see (``if TYPE_CHECKING:``) are left out. ``from a.b import c`` counts as
    importing ``a.b.c`` where that is a module, else ``a.b``."""
    modules = {_module_name(path): tree for path, tree in _modules()}

    def imported(module: str, name: str = "") -> str:
        return f"{module}.{name}" if f"{module}.{name}" in modules else module

    graph = {}
    for module, tree in modules.items():
        found = set()
        typing_only = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
        hidden = {id(leaf) for block in typing_only for leaf in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in hidden:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("torchmn"):
                found |= {imported(node.module, alias.name) for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {imported(alias.name) for alias in node.names if alias.name.startswith("torchmn")}
        graph[module] = {m for m in found if m in modules and m != module}
    return graph


def _cycles(graph: dict) -> list:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_module_is_over_1000_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p, _ in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def test_no_import_cycles():
    cycles = _cycles(_imports())
    assert not cycles, "modules that import each other, directly or around a cycle (move what both need " \
        "into a module below them):\n" + "\n".join(f"  {' <-> '.join(group)}" for group in cycles)


def test_no_module_reaches_into_another_modules_private_names():
    found = sorted(set(_reaches()))
    assert not found, "private names used across modules (make them public, or move the code):\n" + \
        "\n".join(f"  {where}: {what}" for where, what in found)


BUILT_IN_ERRORS = {"Exception", "ValueError", "TypeError", "RuntimeError", "OSError", "KeyError", "LookupError",
                   "NotImplementedError", "AttributeError", "IndexError", "AssertionError", "ImportError",
                   "TimeoutError", "FileNotFoundError", "PermissionError", "ConnectionError"}
# Python's protocols expect these built-ins exactly where they are raised: a module's __getattr__
# (hasattr, from-imports) and a sequence's __getitem__ (iteration ends at IndexError).
PROTOCOL_ERRORS = {"__getattr__": "AttributeError", "__getitem__": "IndexError"}


def test_every_error_torchmn_raises_on_purpose_is_a_torchmn_error():
    """``except torchmn.TorchmnError`` catches every error torchmn raises on purpose: no built-in
    exception is made in torchmn's code (outside Python's protocols), and every exception class
    torchmn defines derives from TorchmnError (besides its built-in base)."""
    bases, made = {}, []
    for path, tree in _modules():
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = ([ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases], f"{where}:{node.lineno}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                allowed = PROTOCOL_ERRORS.get(node.name)
                for call in _own_nodes(node):  # a nested function is judged by its own name
                    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) \
                            and call.func.id in BUILT_IN_ERRORS and call.func.id != allowed:
                        made.append(f"{where}:{call.lineno}: {call.func.id}(...)")

    def derives(name: str, target: str, seen=()) -> bool:
        if name == target:
            return True
        return name in bases and name not in seen and any(derives(b, target, seen + (name,)) for b in bases[name][0])

    errors = [name for name in bases if any(derives(b, "Exception") or b in BUILT_IN_ERRORS for b in bases[name][0])]
    outside = [f"{bases[name][1]}: {name}" for name in errors if name != "TorchmnError" and not derives(name, "TorchmnError")]
    assert not made, "built-in exceptions made in torchmn (use one of torchmn.errors' classes):\n  " + "\n  ".join(made)
    assert not outside, "exception classes that are not TorchmnErrors:\n  " + "\n  ".join(outside)


def _documented_in_a_base(cls: ast.ClassDef, method: str, classes: dict, seen: tuple = ()) -> bool:
    """Whether a torchmn base class of ``cls`` documents ``method`` (Python's help() shows it)."""
    for base in cls.bases:
        for parent in classes.get(ast.unparse(base).rsplit(".", 1)[-1], []):
            if parent in seen:
                continue
            if any(isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name == method
                   and ast.get_docstring(m) for m in parent.body):
                return True
            if _documented_in_a_base(parent, method, classes, seen + (parent,)):
                return True
    return False


def _own_nodes(fn):
    """The nodes of ``fn``'s body, without those of the functions and classes defined inside it."""
    stack = list(fn.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _docstring_gaps(fn, is_property: bool) -> list:
    doc = ast.get_docstring(fn)
    if not doc:
        return ["no docstring"]
    params = [a.arg for a in fn.args.args + fn.args.kwonlyargs if a.arg not in ("self", "cls")]
    params += [a.arg for a in (fn.args.vararg, fn.args.kwarg) if a is not None]
    if fn.returns is not None:
        returns = ast.unparse(fn.returns) != "None"
    else:
        returns = any(isinstance(n, ast.Return) and n.value is not None for n in _own_nodes(fn))
    gaps = []
    if doc.lstrip().startswith("Returns:"):
        gaps.append("a one-line 'Returns:' instead of a summary")
    if params and "Args:" not in doc:
        gaps.append("no Args")
    if returns and not is_property and "Returns:" not in doc and "Yields:" not in doc:
        gaps.append("no Returns")
    if not is_property and "Example" not in doc:
        gaps.append("no Example")
    return gaps


def test_public_docstrings_have_google_sections():
    """Every public function and method of a public module says what it does in a summary line,
    with ``Args:`` where it takes arguments, ``Returns:`` where it returns something, and an
    ``Example::``; a method that overrides a documented torchmn base method shares its docs, and a
    constructor is documented by its class's ``Args:`` (Python's other dunder methods need none)."""
    modules = list(_modules())
    classes: dict = {}
    for _, tree in modules:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(node)
    found = []
    for path, tree in modules:
        rel = path.relative_to(PACKAGE)
        if any(_private(part) for part in rel.with_suffix("").parts):
            continue  # a package's private helper module
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _private(node.name):
                found += [f"{rel}:{node.lineno} {node.name}: {gap}" for gap in _docstring_gaps(node, False)]
            if not isinstance(node, ast.ClassDef) or _private(node.name):
                continue
            if not ast.get_docstring(node):
                found.append(f"{rel}:{node.lineno} class {node.name}: no docstring")
            class_doc = ast.get_docstring(node) or ""
            for method in node.body:
                if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or _private(method.name):
                    continue
                if method.name.startswith("__") and (method.name != "__init__" or "Args:" in class_doc):
                    continue  # Python's protocols; a constructor the class's own Args document
                decorators = {ast.unparse(d) for d in method.decorator_list}
                if any(d.endswith(".setter") for d in decorators):
                    continue  # documented by its getter
                if not ast.get_docstring(method) and _documented_in_a_base(node, method.name, classes):
                    continue
                found += [f"{rel}:{method.lineno} {node.name}.{method.name}: {gap}"
                          for gap in _docstring_gaps(method, "property" in decorators)]
    assert not found, f"{len(found)} public docstrings without their sections:\n  " + "\n  ".join(found)


# The public calls that unpickle what other ranks send: pickle runs the sender's code.
UNPICKLING = [("communicators/communicator_base.py", "CommunicatorBase." + name)
              for name in ("send_obj", "recv_obj", "bcast_obj", "gather_obj", "allgather_obj", "scatter_obj",
                           "allreduce_obj")] + [
    ("datasets/scatter.py", "scatter_dataset"), ("iterators/multi_node_iterator.py", "create_multi_node_iterator"),
    ("datasets/elastic_part.py", "ElasticDatasetPart.follow_world"), ("datasets/transfer.py", "receive_samples"),
    ("horovod/functions.py", "broadcast_object"), ("horovod/functions.py", "allgather_object"),
    ("horovod/functions.py", "broadcast_optimizer_state")]


@pytest.mark.parametrize("path, qualname", UNPICKLING, ids=[q for _, q in UNPICKLING])
def test_calls_that_unpickle_peers_data_say_so(path, qualname):
    """As torch's *_object collectives' docstrings do: the reader learns that a peer's data is unpickled."""
    tree = ast.parse((PACKAGE / path).read_text())
    scopes = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    scopes[f"{node.name}.{item.name}"] = item
        elif isinstance(node, ast.FunctionDef):
            scopes.setdefault(node.name, node)
    doc = ast.get_docstring(scopes[qualname]) or ""
    assert "unpickle" in doc.lower() and "trust" in doc, f"{path}: {qualname} does not say it unpickles peers' data"
