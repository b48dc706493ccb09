"""The weights options are declared once (methods/weights_options.py): every registered method whose options
take a hub ``revision`` inherits it, with its weights option, from that module, and the revision's help names
the option it applies to (``Drafter.resolve_weights`` applies it to the first of ``weight_options``)."""

from __future__ import annotations

import dataclasses

from specbench import options as opts
from specbench.engine.registry import available_methods, method_class


def test_every_revision_comes_from_the_shared_declaration():
    with_revision = []
    for name in available_methods():
        cls = method_class(name)
        fields = {f.name for f in dataclasses.fields(cls.Options)}
        if "revision" not in fields:
            continue
        with_revision.append(name)
        shared = [base for base in cls.Options.__mro__ if base.__module__ == "methods.weights_options"]
        assert shared, f"{name}: revision is declared outside methods/weights_options.py"
        first = cls.weight_options[0]
        again = [c.__name__ for c in cls.Options.__mro__ if c is not shared[0]
                 and {first, "revision"} & set(vars(c).get("__annotations__", {}))]
        assert not again, f"{name}: {again} declare {first}/revision again"
        assert [f.name for f in dataclasses.fields(shared[0])] == [first, "revision"]
        declared = opts.declared_by_name(cls.Options)
        assert declared["revision"].help == f"Hub revision of {first}; empty = main."
        assert declared[first].default == declared["revision"].default == ""  # empty = the shipped drafter, main
    # the trained methods and their ablations, at least
    assert {"sps", "specblock", "dflash", "ddtree", "eagle3", "medusa", "pacer"} <= set(with_revision)
