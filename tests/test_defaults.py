"""One default per option: the communicators, their torch wrappers and the command line agree
(EASGD's tau was 4 in the wrapper and 1 elsewhere, OSGP's max_delay 1 in the
wrapper and 0 in PushSum, so `mgt.EASGD(model, comm=c)` and `train --algorithm easgd` ran
different algorithms)."""

import inspect

import pytest

import mpigossip as mg
from mpigossip.core.registry import OPTION_DEFAULTS

torch = pytest.importorskip("torch")
import mpigossip.torch as mgt  # noqa: E402


def defaults_of(cls):
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


def test_every_layer_has_the_registry_default():
    from mpigossip.__main__ import build_parser
    _, commands = build_parser()
    cli = {a.dest: a.default for a in commands["train"]._actions}
    layers = [mg.PushSum, mg.ElasticAveraging, mg.Gossip, mg.ADPSGD] + [getattr(mgt, n) for n in ("AllReduce", "GradientAllReduce", "EASGD", "ASGD", "GossipPull",
                                                                     "GossipPush", "SGP", "OSGP", "DPSGD", "ADPSGD")]
    checked = set()
    for cls in layers:
        for name, value in defaults_of(cls).items():
            if name in OPTION_DEFAULTS:
                assert value == OPTION_DEFAULTS[name], f"{cls.__qualname__}({name}={value!r})"
                checked.add((cls.__name__, name))
    for name, value in OPTION_DEFAULTS.items():
        assert cli[name] == value, f"--{name.replace('_', '-')} defaults to {cli[name]!r}"
    assert {("EASGD", "tau"), ("ElasticAveraging", "tau"), ("OSGP", "max_delay"), ("PushSum", "max_delay")} <= checked
