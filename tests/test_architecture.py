"""The layering docs/architecture.md states, checked on the code (the import graph of hetccl's
Python modules, read with ast, and the transports' names in the data path), so that a change
that breaks it fails here instead of leaving the document wrong.

Layers, top to bottom: the torch face (backend.py, face_capi.py), scheduling (engine.py,
checks.py, algorithms/), the bridge (bridge.py, transports.py: the registry), the core's
bindings (_core.py, capi.py). Data goes down; no module imports a layer above its own."""
from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
PKG = os.path.join(ROOT, "hetccl")

LAYERS = [  # top to bottom
    ("face", {"hetccl.backend", "hetccl.face_capi"}),
    ("scheduling", {"hetccl.engine", "hetccl.checks", "hetccl.algorithms"}),
    ("bridge", {"hetccl.bridge", "hetccl.transports"}),
    ("bindings", {"hetccl._core", "hetccl.capi"}),
]
TRANSPORT_NAMES = ("shm", "tcp", "ucx")


def _module_of(path: str) -> tuple[str, str]:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    if rel.endswith(".__init__"):
        return rel[: -len(".__init__")], rel[: -len(".__init__")]
    return rel, rel.rsplit(".", 1)[0]


def import_graph() -> dict[str, set[str]]:
    """hetccl module -> the hetccl modules it imports (anywhere in the file, lazy imports too)."""
    graph = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            mod, pkg = _module_of(path)
            deps = set()
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    if node.module:
                        deps.add(".".join(base + [node.module]))
                    else:
                        deps.update(".".join(base + [a.name]) for a in node.names)
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hetccl"):
                    deps.add(node.module)
                elif isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names if a.name.startswith("hetccl"))
            graph[mod] = deps
    return graph


def layer_of(mod: str) -> int | None:
    for i, (_, mods) in enumerate(LAYERS):
        if any(mod == m or mod.startswith(m + ".") for m in mods):
            return i
    return None


def test_the_graph_is_read():
    """The reader finds what it must (so the checks below can fail): the engine imports the
    bridge, the face imports the engine, relative imports of a subpackage resolve."""
    g = import_graph()
    assert "hetccl.bridge" in g["hetccl.engine"] and "hetccl.engine" in g["hetccl.backend"]
    assert "hetccl.algorithms.common" in g["hetccl.algorithms.allreduce"]
    assert layer_of("hetccl.algorithms.allreduce") == 1 and layer_of("hetccl.config") is None


def test_no_module_imports_a_layer_above_its_own():
    bad = []
    for mod, deps in import_graph().items():
        mine = layer_of(mod)
        if mine is None:
            continue
        for d in deps:
            theirs = layer_of(d)
            if theirs is not None and theirs < mine:
                bad.append(f"{mod} ({LAYERS[mine][0]}) imports {d} ({LAYERS[theirs][0]})")
    assert not bad, "\n".join(bad)


def test_the_face_reaches_transports_only_through_the_engine():
    g = import_graph()
    for face in LAYERS[0][1]:
        assert not {d for d in g[face] if layer_of(d) == 2}, f"{face} imports the bridge directly"
    # and the layers below the face are imported by nothing but the package's faces and tools
    users = {m for m, deps in g.items() if "hetccl.engine" in deps}
    assert users == {"hetccl.backend"}, users
    # nor through an attribute: no face module reaches the engine's bridge (`engine.bridge`);
    # point-to-point of host memory goes through the engine's host_send / host_recv
    reached = []
    for face in LAYERS[0][1]:
        path = os.path.join(PKG, face.split(".", 1)[1] + ".py")
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Attribute) and node.attr == "bridge":
                reached.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not reached, reached


def test_bindings_are_leaves():
    g = import_graph()
    assert g["hetccl._core"] <= {"hetccl._C", "hetccl.config"}, g["hetccl._core"]
    assert not g["hetccl.capi"], g["hetccl.capi"]


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS[:2]] + ["bridge.py"])
def test_no_transport_name_in_the_data_path(layer):
    """Transports are chosen from their capability tables (hetccl/transports.py, the registry,
    is the one Python module that knows their names and options): the face, the scheduling
    layer and bridge.py hold no transport name as a string."""
    if layer == "bridge.py":
        files = [os.path.join(PKG, "bridge.py")]
    else:
        mods = dict(LAYERS)[layer]
        files = []
        for dirpath, _, fs in os.walk(PKG):
            for f in fs:
                path = os.path.join(dirpath, f)
                if f.endswith(".py") and layer_of(_module_of(path)[0]) == [n for n, _ in LAYERS].index(layer):
                    files.append(path)
        assert files and mods
    found = []
    for path in files:
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Constant) and node.value in TRANSPORT_NAMES:
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, "\n".join(found)


def test_no_transport_name_in_the_cpp_engine_or_c_api():
    """The C++ engine (csrc/engine*.cc) drives transports through the Transport interface only,
    and the C API (csrc/api/) chooses its two transports from the registry by capability
    (comm.cc: zero-copy rings on one host, lazy connections elsewhere): neither holds a
    transport's name as a string; only each transport's file does (and the registry's example
    in transport.h's comment)."""
    csrc = os.path.join(ROOT, "csrc")
    files = [f for f in os.listdir(csrc) if re.fullmatch(r"engine\w*\.(cc|h)", f)]
    assert "engine.cc" in files
    api = [os.path.join("api", f) for f in os.listdir(os.path.join(csrc, "api")) if f.endswith((".cc", ".h"))]
    assert os.path.join("api", "comm.cc") in api
    found = [f"{f}: {m.group(0)}" for f in files + api
             for m in re.finditer(r'"(shm|tcp|ucx)"', open(os.path.join(csrc, f)).read())]
    assert not found, found
