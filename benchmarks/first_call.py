#!/usr/bin/env python
"""Which modules one first call enters, and how often: meshlift against jax.jit and nnx.jit.

A first call (`ml.jit(forward)(model, x)`, the lift included) is recorded
with `sys.setprofile`. Every call from one module of the library into
another is a *call across modules*; one whose callee goes on to call into a
third module (or back) is a *hop* of the control flow, and a module is
*entered* once per hop into it. A call into a leaf helper (a path formatter,
`is_graph_leaf` per leaf) is a call across modules but no hop. Calls inside
one module, and into other libraries (jax from meshlift), are not counted.
The same step under `jax.jit` (over the model's arrays, counted inside
`jax._src`) and `nnx.jit` (inside `flax.nnx`) is the reference; theirs
include tracing the model's own operations, meshlift's do not (jax does that
work for it).

    python benchmarks/first_call.py            # a table per library
    python benchmarks/first_call.py --json     # the counts, on stdout

integration_tests/test_first_call.py holds meshlift to entering no module
more than 3 times: a first call that reads one way.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import collections
import json
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from rich.console import Console
from rich.table import Table

import meshlift as ml

# The library each run is measured in: module name prefixes.
LIBRARIES = {
    "meshlift": ("meshlift", "meshlift_jit"),
    "jax.jit": ("jax._src",),
    "nnx.jit": ("flax.nnx",),
}


def hops(run: Callable[[], Any], prefixes: tuple[str, ...]) -> list[tuple[str, str, bool]]:
    """The calls of `run` that cross modules of the library (`prefixes`), in order: (caller
    module, callee module, whether the callee went on to cross into another module: a hop
    of the control flow, not a leaf helper such as a path formatter)."""
    crossed: list[list[Any]] = []
    open_hops: dict[int, int] = {}  # id(frame) of a callee -> its hop's index

    def module_of(frame: Any) -> str | None:
        name = frame.f_globals.get("__name__", "")
        return name if name.startswith(prefixes) else None

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "return":
            open_hops.pop(id(frame), None)
            return
        if event != "call":
            return
        callee = module_of(frame)
        outer = frame.f_back
        while outer is not None and module_of(outer) is None:
            outer = outer.f_back  # through jax, numpy, builtins: the last own frame
        caller = module_of(outer) if outer is not None else None
        if callee is None or caller is None or callee == caller:
            return
        parent = outer
        while parent is not None and id(parent) not in open_hops:
            parent = parent.f_back
        if parent is not None:
            crossed[open_hops[id(parent)]][2] = True
        open_hops[id(frame)] = len(crossed)
        crossed.append([caller, callee, False])

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return [(caller, callee, further) for caller, callee, further in crossed]


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear1 = nnx.Linear(16, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(nnx.relu(self.linear1(x)))


def forward(model: MLP, x: jax.Array) -> jax.Array:
    return model(x)


def first_calls() -> dict[str, Callable[[], Any]]:
    """One fresh first call per library, each on its own new model."""
    x = jnp.ones((8, 16))
    models = {name: MLP(nnx.Rngs(0)) for name in LIBRARIES}
    graphdef, state = nnx.split(models["jax.jit"])

    def pure(state: Any, x: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(x)

    return {
        "meshlift": lambda: ml.jit(forward)(models["meshlift"], x),
        "jax.jit": lambda: jax.jit(pure)(state, x),
        "nnx.jit": lambda: nnx.jit(forward)(models["nnx.jit"], x),
    }


def measure() -> dict[str, dict[str, Any]]:
    ml.jit(forward)(MLP(nnx.Rngs(1)), jnp.ones((8, 16)))  # imports and plugin loading first
    results = {}
    for name, run in first_calls().items():
        crossed = hops(run, LIBRARIES[name])
        flow = [(caller, callee) for caller, callee, further in crossed if further]
        entered = collections.Counter(callee for _, callee in flow)
        results[name] = {
            "calls across modules": len(crossed),
            "hops": len(flow),
            "modules": dict(entered.most_common()),
        }
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = parser.parse_args(argv)
    results = measure()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    console = Console()
    for name, result in results.items():
        modules = result["modules"]
        table = Table(
            "module",
            "entered",
            title=f"{name}: {result['hops']} hops over {len(modules)} modules "
            f"({result['calls across modules']} calls across modules)",
        )
        for module, count in modules.items():
            table.add_row(module, str(count))
        console.print(table)


if __name__ == "__main__":
    main()
