"""The package's folders are its layers (docs/DESIGN.md): every import between them
points down. Read from the source (no import runs): a module that imports a layer above its
own, or a communicator that imports torch, matplotlib or the training job, fails here."""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(__file__), os.pardir, "mpigossip")

#: The layers each layer may import (besides itself and the package's top: its version).
ALLOWED = {
    "core": set(),
    "topology": {"core"},
    "resilience": {"core"},
    "exact": {"core", "topology", "resilience"},
    "onesided": {"core", "topology", "resilience"},
    "decentralized": {"core", "topology", "resilience", "onesided"},
    "launch": {"core", "onesided"},
    "torch": {"core", "topology", "resilience", "exact", "onesided", "decentralized"},
    "sim": {"core", "topology"},
    "train": {"core", "topology", "resilience", "exact", "onesided", "decentralized", "launch", "torch"},
    "reproduce": {"core", "topology", "sim", "train"},
}
#: Libraries a layer must not import (communicators work on any flat buffer, need neither
#: torch nor matplotlib; the simulator and the topologies need no MPI). ``core`` reads torch
#: tensors lazily, inside the functions that meet one.
FORBIDDEN = {
    "topology": {"mpi4py", "torch", "matplotlib"},
    "resilience": {"torch", "matplotlib"},
    "exact": {"torch", "matplotlib"},
    "onesided": {"torch", "matplotlib"},
    "decentralized": {"torch", "matplotlib"},
    "sim": {"mpi4py", "torch"},
    "core": {"matplotlib"},
}


def _modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, PACKAGE)[:-3].split(os.sep)
                yield path, ["mpigossip", *(rel[:-1] if rel[-1] == "__init__" else rel)], rel[-1] == "__init__"


def imports(path, module, is_package):
    """Every ``mpigossip.*`` module and outside library that the file at ``path`` imports,
    anywhere in it (a lazy import inside a function counts)."""
    package = module if is_package else module[:-1]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            else:
                base = node.module.split(".")
            if base == ["mpigossip"]:
                found.update(f"mpigossip.{a.name}" for a in node.names)
            else:
                found.add(".".join(base))
    return found


def layer_of(name):
    parts = name.split(".")
    return parts[1] if parts[0] == "mpigossip" and len(parts) > 1 else None


CASES = [(path, module, pkg) for path, module, pkg in _modules() if len(module) > 2 or pkg and len(module) == 2]


@pytest.mark.parametrize("path, module, is_package", CASES, ids=[".".join(m) for _, m, _ in CASES])
def test_imports_point_down(path, module, is_package):
    layer = module[1]
    if layer not in ALLOWED:
        pytest.fail(f"{'.'.join(module)}: the folder {layer!r} is not a layer of docs/ARCHITECTURE.md's "
                    "(add it to tests/test_layers.py with the layers it may import)")
    wrong = set()
    for name in imports(path, module, is_package):
        target = layer_of(name)
        top = name.split(".")[0]
        if target is not None and target != layer and target not in ALLOWED[layer] and target != "__version__":
            wrong.add(f"{name} (layer {target!r})")
        if top in FORBIDDEN.get(layer, ()):
            wrong.add(name)
    assert not wrong, f"{'.'.join(module)} ({layer}) imports {sorted(wrong)}"


def test_every_layer_is_a_folder_and_the_top_holds_only_the_public_face():
    """The package's top keeps ``__init__`` (the public names) and ``__main__`` (the command
    line); everything else lives in a layer's folder."""
    top = sorted(n for n in os.listdir(PACKAGE) if n.endswith(".py"))
    assert top == ["__init__.py", "__main__.py"], top
    folders = {n for n in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, n, "__init__.py"))}
    assert folders == set(ALLOWED), folders ^ set(ALLOWED)


def test_the_check_sees_an_upward_import(tmp_path):
    """A core module importing a communicator, and a communicator importing torch, are found."""
    bad = tmp_path / "bad.py"
    bad.write_text("from ..decentralized import pushsum\n\ndef f():\n    import torch\n")
    found = imports(str(bad), ["mpigossip", "core", "bad"], False)
    assert found == {"mpigossip.decentralized", "torch"}
    assert layer_of("mpigossip.decentralized") not in ALLOWED["core"]
