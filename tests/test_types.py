"""The public API carries type hints (#46): every public function, method and property of the
communicators, the torch wrappers, ``failures`` and the topologies is annotated, parameters
and return; the package ships ``py.typed``. (``mypy``, run by the test command's "types" step,
checks the bodies of what is annotated.)"""

import inspect
import os

import mpigossip as mg
import mpigossip.torch as mgt
from mpigossip import topology
from mpigossip.resilience import failures


def _members(owner):
    """``(qualified name, function)`` of ``owner``'s public callables defined in mpigossip."""
    for attr, member in inspect.getmembers(owner):
        if attr.startswith("_") and attr != "__init__":
            continue
        fn = member.fget if isinstance(member, property) else member
        if (inspect.isfunction(fn) or inspect.ismethod(fn)) and (fn.__module__ or "").startswith("mpigossip"):
            yield f"{fn.__module__}.{fn.__qualname__}", fn


def public_api():
    seen = set()
    roots = [(mg, mg.__all__), (mgt, mgt.__all__), (topology, topology.__all__),
             (failures, [n for n in dir(failures) if not n.startswith("_")
                         and getattr(getattr(failures, n), "__module__", None) == failures.__name__])]
    for module, names in roots:
        for name in names:
            obj = getattr(module, name)
            found = _members(obj) if inspect.isclass(obj) else \
                [(f"{obj.__module__}.{obj.__qualname__}", obj)] if inspect.isfunction(obj) else []
            for qual, fn in found:
                if fn not in seen:
                    seen.add(fn)
                    yield qual, fn


def unannotated(fn):
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls") and params[0].annotation is inspect.Parameter.empty:
        params = params[1:]
    missing = [p.name for p in params if p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def test_every_public_callable_is_annotated():
    api = dict(public_api())
    assert len(api) > 200   # the walk reaches the classes' methods, not only the names
    for name in ("mpigossip.decentralized.pushsum.PushSum.__init__", "mpigossip.torch.base._Wrapper.step",
                 "mpigossip.resilience.failures.shrink", "mpigossip.topology.base.Topology.out_peers"):
        assert name in api, name
    missing = {qual: m for qual, fn in api.items() if (m := unannotated(fn))}
    assert not missing, missing


def test_an_unannotated_function_is_seen():
    def f(x, *, y: int = 0):
        return x
    assert unannotated(f) == ["x", "return"]


def test_the_package_says_it_is_typed():
    assert os.path.isfile(os.path.join(os.path.dirname(mg.__file__), "py.typed"))
