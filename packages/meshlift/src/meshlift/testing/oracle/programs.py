"""Hypothesis strategies for oracle programs, each a small Python function as source text.

A program is the body of `def program(rec):`. It builds its models, defines
the function, lifts it with `rec.lift`, and calls it with `rec.call`,
changing the models between calls. `rec` decides what lifting means (eager,
`jax.jit`, a meshlift backend) and records what each call gives, so the same
source runs under the reference and the target. Two families:

* `graph_programs`: NNX models (nested modules, `nnx.List`, shared
  submodules and Variables, BatchNorm, Dropout, `Rngs`, custom Variable
  types, Variables holding pytrees, `nnx.data` arrays, static values of
  every kind in `vocabulary.STATICS`) passed in varying argument layouts
  (graph nodes and arrays at varying positions, by keyword, in dicts and
  tuples, static arguments of many types, donation by position and by name,
  a bound method, `nnx.cached_partial`), changed inside the function (new values,
  replace, swap, alias, add and delete attributes, a Variable given a value
  of another pytree structure, static values changed in place,
  `eval()`/`train()`) and between calls (the same, plus a Variable's type,
  metadata or shape changed, an object's class or attribute dict swapped).
  The reference is eager execution.
* `array_programs`: functions of arrays and Python values under every
  combination of `static_argnums`/`static_argnames`/`donate_argnums`/
  `donate_argnames`, valid or not, called positionally and by keyword.
  The reference is `jax.jit`.

Example:

```python
from hypothesis import given, settings
from meshlift.testing.oracle.programs import graph_programs

@settings(max_examples=3, database=None)
@given(graph_programs())
def test_sources_compile(program):
    compile(program.source(), "<program>", "exec")

test_sources_compile()
```
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from typing import Any

import attrs
from hypothesis import strategies as st

from meshlift.testing.corpus.objects import READS_VALUES
from meshlift.testing.corpus.objects import TRANSFORMATIONS as _CORPUS
from meshlift.testing.oracle.vocabulary import STATICS

SEEDS = st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0, 1.5])
VARIABLE_TYPES = ["nnx.Param", "nnx.BatchStat", "Stat", "nnx.Variable"]
SHAPES = {"w": "(2, 8)", "b": "(8,)"}  # the plan shards these over `model`
# An argument array's length: another length between calls makes JAX trace a repeated
# call's program again (4: the plan still shards it; 1: it replicates it).
LENGTHS = st.sampled_from([8, 8, 8, 4, 1])
_LENGTH = re.compile(r"grid\(\(\d+,\)")
# `touch`'s condition: only the traces for an argument of length 1 change the static value
WHEN_LENGTH_1 = ", any(getattr(x, 'shape', 0) == (1,) for x in args)"
PREFIXES = "wbwbt"  # a Variable `t<n>` holds a pytree (`nested`)
STATIC_ARGUMENTS = ["1", "True", "1.0", "0", "False", '"s"', "None", "(1, 2)", "Color.RED"]
STATIC_ARGUMENTS += ["Frozen(1.5)", "2", "2.0"]
IMMUTABLE = ["int", "float", "bool", "str", "none", "tuple", "enum", "frozen"]
MUTABLE = sorted(set(STATICS) - set(IMMUTABLE))  # what `touch` changes in place
# A training program's optimizer: an optax object of the ecosystem corpus (those that read
# the loss, which `learn` does not give, left out).
TRANSFORMATIONS = sorted(set(_CORPUS) - READS_VALUES)
# reached through another object: a proxy's dict, a method's object, a closure's cell...
INDIRECT = ["proxy", "method", "closure", "key", "config", "namespace"]
# What a program is about: its ingredients are always there, the rest is drawn freely.
# (The themes whose ingredients are rarer have more weight.)
THEMES = ["layout", "statics", "variables", "inside", "method", "partial", "training", "refs"]
THEMES += ["layout", "statics", "variables", "refs"]


@attrs.frozen
class Program:
    """The source of `def program(rec):`."""

    lines: tuple[str, ...]

    def source(self) -> str:
        body = textwrap.indent("\n".join(self.lines), "    ")
        return f"def program(rec):\n{body}\n"


@attrs.define
class _Model:
    """A model being drawn: its source and the names operations can aim at."""

    name: str
    variables: list[str] = attrs.Factory(list)
    statics: list[str] = attrs.Factory(list)
    children: list[str] = attrs.Factory(list)
    attributes: list[str] = attrs.Factory(list)

    def names(self) -> list[str]:
        return self.variables + self.statics + self.children

    def line(self) -> str:
        return f"{self.name} = Box({', '.join(self.attributes)})"


def _static(kinds: list[str] | None = None) -> st.SearchStrategy[str]:
    return st.sampled_from(kinds or sorted(STATICS)).map(STATICS.__getitem__)


@st.composite
def _model(draw: Any, name: str, theme: str) -> _Model:
    model = _Model(name)
    refs = theme == "refs" or draw(st.integers(0, 9)) == 0
    for prefix in draw(st.lists(st.sampled_from(PREFIXES), min_size=1, max_size=3)):
        var = f"{prefix}{sum(v.startswith(prefix) for v in model.variables)}"
        kind = draw(st.sampled_from(VARIABLE_TYPES + ["nnx.Param"] * (theme == "variables")))
        ref = ", ref=True" if refs and prefix == "b" and theme != "training" else ""
        value = (
            f"nested({draw(SEEDS)})" if prefix == "t" else f"grid({SHAPES[prefix]}, {draw(SEEDS)})"
        )
        model.variables.append(var)
        model.attributes.append(f"{var}={kind}({value}{ref})")
    kinds = MUTABLE + INDIRECT * 6 if theme == "statics" else sorted(STATICS)
    count = draw(st.integers(1 if theme in ("statics", "inside") else 0, 2))
    for i in range(count):
        model.statics.append(f"k{i}")
        model.attributes.append(
            f"k{i}={draw(_static(kinds if i else INDIRECT * (theme == 'statics') or kinds))}"
        )
    children = ["sub", "items", "bn", "drop", "lin", "arr", "pair"]
    if theme == "training":
        children = ["bn", "drop", "lin"]
    seed, number = draw(SEEDS), int(name[1:])
    child = draw(st.sampled_from(children + ([""] * 3 if theme != "training" else [])))
    made = {
        "sub": f"Box(w0=nnx.Param(grid((2, 8), {seed})), k0={draw(_static())})",
        "items": f"nnx.List([Box(b0=Stat(grid((8,), {seed}))), Box(b0=Stat(grid((8,), 1.0)))])",
        "bn": f"nnx.BatchNorm(8, rngs=nnx.Rngs({number}))",
        "drop": f"nnx.Dropout(0.5, rngs=nnx.Rngs({number}))",
        "lin": f"nnx.Linear(8, 8, rngs=nnx.Rngs({number}))",
        "arr": f"nnx.data(grid((8,), {seed}))",
        "pair": f"nnx.data((Stat(grid((8,), {seed})), nnx.Param(grid((8,), 0.5))))",  # a tuple
    }
    if child:
        model.attributes.append(f"{child}={made[child]}")
        model.variables += {"sub": ["sub.w0"], "items": ["items.0.b0", "items.1.b0"]}.get(child, [])
        model.statics += ["sub.k0"] if child == "sub" else []
        model.children += [child] if child in ("sub", "items", "bn", "drop", "lin") else []
    return model


@st.composite
def _models(draw: Any, theme: str) -> tuple[list[_Model], list[str]]:
    """One or two models (maybe built alike), maybe sharing parts (and maybe an optimizer
    `o0` of the first), and the lines that make them."""
    models = [draw(_model(f"m{i}", theme)) for i in range(draw(st.integers(1, 2)))]
    first = models[0]
    twins = draw(st.integers(0, 1 if theme == "statics" else 3)) == 0
    if len(models) > 1 and twins:  # built alike: one staged function serves both
        models[1] = _Model("m1", *(list(part) for part in attrs.astuple(first, recurse=False)[1:]))
    lines = [m.line() for m in models]
    sharing = draw(st.sampled_from(["", "", "variable", "module", "across", "array"]))
    if theme == "layout" and draw(st.booleans()):
        sharing = "array"
    if theme == "partial" and sharing == "across":
        # nnx.cached_partial calls with a copy of m0: a module m1 shares with it is
        # another object inside the function than the copy's, under nnx.jit as well
        sharing = ""
    if sharing == "array":  # one array object stored on two modules (or twice on one)
        lines.append(
            "m0.t0 = m1.t0 = grid((8,), 0.5)"
            if len(models) > 1
            else "m0.t0 = m0.t1 = grid((8,), 0.5)"
        )
    elif sharing == "variable":
        lines.insert(1, f"m0.alias = m0.{first.variables[0]}")
        first.variables.append("alias")
    elif sharing == "module" and first.children:
        lines.insert(1, f"m0.again = m0.{first.children[0]}")
        first.children.append("again")
    elif sharing == "across" and len(models) > 1 and first.children:
        lines.append(f"m1.shared = m0.{first.children[0]}")
        models[1].children.append("shared")
    if theme == "training":  # optax's own objects (a cosine schedule changes itself)
        tx = draw(st.sampled_from(TRANSFORMATIONS))
        lines.append(f"o0 = nnx.Optimizer(m0, transformation({tx!r}), wrt=nnx.Param)")
    return models, lines


@st.composite
def _inside(draw: Any, models: list[_Model], theme: str) -> str:
    """One operation of the function body on graph node `i` of its arguments."""
    i = draw(st.integers(0, 1))
    model = models[min(i, len(models) - 1)]
    where = f"node(args, {i})"
    pick = st.sampled_from(model.names())
    kinds = ["bump", "layers", "params"]
    if theme != "partial":  # nnx.cached_partial keeps the structure it was given
        kinds += ["swap", "alias", "replace", "add", "delete", "mode", "set"]
    kinds += ["touch"] * (3 if theme == "statics" else 1)  # a static changed in place: retraced
    if theme == "training":
        kinds += ["learn"] * 3
    if theme == "variables":  # by type: a Variable's type changed in place matters
        kinds += ["params"] * 8
    if theme not in ("partial", "training"):  # (an optimizer's state keeps its structure)
        kinds.append("restructure")
    if theme == "statics" and len(model.statics) > 1:  # one static object where two were
        kinds += ["statics"] * 2
    kind = draw(st.sampled_from(kinds))
    if kind == "bump":
        return f"bump({where}, {draw(st.sampled_from(model.variables))!r}, {draw(SEEDS)})"
    if kind == "params":
        return f"bump_params({where}, {draw(SEEDS)})"
    if kind == "restructure":
        variable = draw(st.sampled_from(model.variables))
        return f"restructure({where}, {variable!r}, {draw(SEEDS)})"
    if kind == "statics":
        first, second = draw(st.permutations(model.statics))[:2]
        return f"alias({where}, {first!r}, {second!r})"
    if kind in ("layers", "learn"):
        return "layers(node(args, 0))" if kind == "layers" else "learn(args)"
    if kind in ("swap", "alias"):
        return f"{kind}({where}, {draw(pick)!r}, {draw(pick)!r})"
    if kind in ("replace", "add"):
        target = draw(pick) if kind == "replace" else draw(st.sampled_from(["new", "w9"]))
        return f"{kind}({where}, {target!r}, {draw(SEEDS)})"
    if kind == "delete":
        return f"delete({where}, {draw(pick)!r})"
    if kind == "mode":
        return f"mode({where}, train={draw(st.booleans())})"
    if kind == "set":
        return f"setattr_if({where}, {draw(pick)!r}, {draw(_static())})"
    if not model.statics:
        return f"layers({where})"
    static = draw(st.sampled_from(model.statics))
    return f"touch({where}, {static!r}{draw(st.sampled_from(['', '', WHEN_LENGTH_1]))})"


@st.composite
def _between(draw: Any, models: list[_Model], theme: str) -> str:
    """One change the caller makes to a model between calls."""
    model = draw(st.sampled_from(models))
    name, variable = model.name, draw(st.sampled_from(model.variables))
    kinds = {
        "statics": ["static"],
        "variables": ["variable"],
        "partial": ["bump"],
        "method": ["bump", "static", "variable"],
    }.get(theme, ["bump", "static", "variable", "structure"])
    kind = draw(st.sampled_from(kinds))
    if kind == "bump":
        return f"bump({name}, {variable!r}, {draw(SEEDS)})"
    if kind == "static":
        static = draw(st.sampled_from(model.statics + ["k0"] * (theme == "statics") or ["k0"]))
        touches = ["touch"] * (6 if theme == "statics" else 3)
        change = draw(st.sampled_from([*touches, "swap_class", "swap_dict", "set"]))
        if change == "set":
            return f"setattr_if({name}, {static!r}, {draw(_static())})"
        return f"{change}({name}, {static!r})"
    if kind == "variable":
        changes = ["retype", "remeta", "reshape", "bump"]
        changes += ["restructure"] * (theme not in ("partial", "training"))
        change = draw(st.sampled_from(changes + ["retype"] * (4 if theme == "variables" else 1)))
        if change == "retype":
            return f"retype({name}, {variable!r}, {draw(st.sampled_from(VARIABLE_TYPES))})"
        if change == "remeta":
            return f"remeta({name}, {variable!r}, {draw(st.sampled_from(['x', 'y']))!r})"
        seeded = change in ("bump", "restructure")
        return f"{change}({name}, {variable!r}" + (f", {draw(SEEDS)})" if seeded else ")")
    pick = st.sampled_from(model.names())
    change = draw(st.sampled_from(["replace", "swap", "alias", "add", "delete", "mode"]))
    if change in ("swap", "alias"):
        return f"{change}({name}, {draw(pick)!r}, {draw(pick)!r})"
    if change in ("replace", "add"):
        target = draw(pick) if change == "replace" else "w9"
        return f"{change}({name}, {target!r}, {draw(SEEDS)})"
    if change == "delete":
        return f"delete({name}, {draw(pick)!r})"
    return f"mode({name}, train={draw(st.booleans())})"


@st.composite
def _argument(draw: Any, models: list[_Model], static: bool, optimizer: bool) -> str:
    """One argument's source: a static value, or a graph node, an array or a container."""
    if static:
        return draw(st.sampled_from(STATIC_ARGUMENTS))
    array = f"grid(({draw(LENGTHS)},), {draw(SEEDS)})"
    if not models:
        return array
    model = draw(st.sampled_from(models))
    nodes = [model.name] * 3 + [f"at({model.name}, {c!r})" for c in model.children]
    nodes += ["o0"] * 3 if optimizer else []
    node = draw(st.sampled_from(nodes))
    kind = draw(st.sampled_from(["node", "node", "node", "array", "array", "dict", "tuple"]))
    if kind == "node":
        return node
    if kind == "array":
        return array
    if kind == "dict":
        return f'{{"x": {node}, "y": {array}}}'
    return f"({array}, {node})"


_CONTAINERS = (
    (re.compile(r'\{"x": (.+), "y": (grid\(\([0-9]+,\), [0-9.]+\))\}'), '{{"x": {1}, "y": {0}}}'),
    (re.compile(r"\((grid\(\([0-9]+,\), [0-9.]+\)), (.+)\)"), "({1}, {0})"),
)


def _swapped(argument: str) -> str:
    """An argument with its container's two entries exchanged (the node where the array was)."""
    for pattern, swapped in _CONTAINERS:
        match = pattern.fullmatch(argument)
        if match:
            return swapped.format(*match.groups())
    return argument


def _call(draw: Any, target: str, params: Sequence[str], values: Sequence[str]) -> str:
    """`rec.call(target, ...)` with the first arguments positional, the rest by keyword."""
    split = draw(st.integers(0, len(params))) if draw(st.integers(0, 3)) == 0 else len(params)
    positional = list(values[:split])
    keywords = [f"{p}={v}" for p, v in zip(params[split:], values[split:], strict=True)]
    keywords = draw(st.permutations(keywords)) if keywords else []
    return f"rec.call({', '.join([target, *positional, *keywords])})"


@st.composite
def graph_programs(draw: Any) -> Program:
    """A program of NNX models, an argument layout and changes; see the module docstring."""
    theme = draw(st.sampled_from(THEMES))
    models, lines = draw(_models(theme))
    optimizer = theme == "training"
    params = ["a", "b", "c"][: draw(st.integers(2, 3))]
    lifted_params = params if theme not in ("method", "partial") else params[1:]
    # Values changed, and a static value by some traces only, with arrays passed as they
    # are: calls like the last run on its plan, whose program traces again for a new length.
    retraced = theme == "statics" and draw(st.booleans())
    static = None if retraced else draw(st.sampled_from([None, *lifted_params[1:]]))
    donated = draw(st.sampled_from([None, None, *[p for p in lifted_params if p != static]]))
    indices = params if theme == "partial" else lifted_params
    options = _options(draw, indices, static, donated)

    count = draw(st.integers(2 if theme in ("inside", "refs") else 1, 3))
    operations = [draw(_inside(models, theme)) for _ in range(count)]
    if retraced:
        model = models[0]
        arrays = [v for v in model.variables if not v.startswith("t")] or model.variables
        bumped = draw(st.lists(st.sampled_from(arrays), min_size=1, max_size=3, unique=True))
        operations = [  # several Variables written back by the plan's C step, in any order
            *(f"bump(node(args, 0), {variable!r}, {draw(SEEDS)})" for variable in bumped),
            f"touch(node(args, 0), {draw(st.sampled_from(model.statics))!r}{WHEN_LENGTH_1})",
        ]
    header = f"def fn({', '.join(params)}):"
    body = [
        "    rec.trace()",
        f"    args = ({', '.join(params)},)",
        *(f"    {line}" for line in operations),
        "    return probe(args)",
    ]
    roots = ", ".join(f"{m.name}={m.name}" for m in models) + (", o0=o0" if optimizer else "")
    if theme == "method":
        method = [header.replace("(a, ", "(self, "), *(b.replace("(a, ", "(self, ") for b in body)]
        lines = ["class Model(Box):", *(f"    {line}" for line in method), *lines]
        lines[len(method) + 1] = lines[len(method) + 1].replace("m0 = Box(", "m0 = Model(", 1)
        lines += [f"rec.start({roots})", f"f = rec.lift(m0.fn{options})"]
    else:
        lines += [f"rec.start({roots})", header, *body, f"f = rec.lift(fn{options})"]
    if theme == "partial":
        lines.append("f = rec.partial(f, m0)")

    # nnx.cached_partial calls with a copy of m0 (sharing its Variables): not m0 again
    passed = models[1:] if theme == "partial" else models
    base = [draw(_argument(passed, p == static, optimizer)) for p in lifted_params]
    if theme in ("statics", "variables"):  # what changes between calls reaches the function
        base[0] = passed[0].name
    if retraced:
        base[1:] = [f"grid((8,), {draw(SEEDS)})" for _ in base[1:]]
    for step in range(draw(st.integers(3 if retraced else 2, 4))):
        if step and not retraced and draw(st.integers(0, 3)):
            lines.append(draw(_between(models, theme)))
        values = list(base)
        if step and not retraced and (theme == "layout" or draw(st.integers(0, 2)) == 0):
            if draw(st.integers(0, 3)):  # the same arguments in other places: nodes move
                dynamic = [i for i, p in enumerate(lifted_params) if p != static]
                for i, j in zip(dynamic, draw(st.permutations(dynamic)), strict=True):
                    values[i] = _swapped(base[j])
            else:
                values = [draw(_argument(passed, p == static, optimizer)) for p in lifted_params]
        if step and draw(st.integers(0, 1 if retraced and step > 1 else 2)) == 0:
            length = 1 if retraced else draw(LENGTHS)  # arrays of another length: traced again
            values = [_LENGTH.sub(f"grid(({length},)", value) for value in values]
        call = f"rec.call(f, {', '.join(values)})" if retraced else None
        lines.append(call or _call(draw, "f", lifted_params, values))
    return Program(tuple(lines))


def _options(draw: Any, params: Sequence[str], static: str | None, donated: str | None) -> str:
    """`, static_argnums=...` and `, donate_argnames=...` as source, by position or name."""
    text = ""
    for option, param in (("static", static), ("donate", donated)):
        if param is None:
            continue
        if draw(st.booleans()):
            text += f", {option}_argnums={params.index(param)}"
        else:
            text += f", {option}_argnames={param!r}"
    return text


# -- array programs ------------------------------------------------------------------------

# Values that are good both as static arguments (hashable) and as dynamic ones (JAX types),
# arrays (dynamic only), and the values that make a call wrong in one way.
EITHER = ["1", "True", "1.0", "0", "2.0", "(1, 2)", "None"]
ARRAYS = ["grid((3,), 0.5)", "grid((2, 3), 1.0)", "grid((3,), 0.0, jnp.int32)"]
FAULTS = ['"s"', "Color.RED", "grid((3,), 0.25)"]  # not a JAX type; as a static: unhashable


@st.composite
def _array_options(draw: Any, params: list[str], names: list[str]) -> tuple[str, set, set]:
    """jit's argnum/argname options as source, valid or (one time in five) not; and the
    parameters static and donated by them, where valid."""
    static: set[str] = set()
    donated: set[str] = set()
    options: dict[str, Any] = {}
    for kind, chosen in (("static", static), ("donate", donated)):
        which = draw(st.sampled_from(["", "", "nums", "names"]))
        picked = draw(st.lists(st.sampled_from(params), max_size=2, unique=True))
        picked = [p for p in picked if p not in static]
        if which == "nums":
            negative = kind == "static" and draw(st.booleans())
            nums = tuple(params.index(p) - (len(params) if negative else 0) for p in picked)
            options[f"{kind}_argnums"] = nums
        elif which == "names":
            options[f"{kind}_argnames"] = tuple(picked)
        if which:
            chosen.update(picked)
    if draw(st.integers(0, 4)) == 0:
        fault = draw(st.sampled_from(["range", "unknown", "unknown donated", "both"]))
        faults: dict[str, dict[str, Any]] = {
            "range": {"static_argnums": (5,)},
            "unknown": {"static_argnames": ("z",)},
            "unknown donated": {"donate_argnames": ("z",)},
            "both": {"static_argnames": (names[0],), "donate_argnames": (names[0],)},
        }
        options |= faults[fault]
    text = "".join(f", {option}={value!r}" for option, value in options.items())
    return text, static, donated


@st.composite
def array_programs(draw: Any) -> Program:
    """A function of arrays and Python values, `jax.jit`'s argument options (valid or
    not), and calls: positional or by keyword, now and then with one thing wrong."""
    params = ["a", "b", "c"][: draw(st.integers(1, 3))]
    keyword_only = draw(st.booleans())
    everything = params + (["k"] if keyword_only else [])
    signature = params + (["*", "k=None"] if keyword_only else [])
    options, static, donated = draw(_array_options(params, everything))
    lines = [
        f"def fn({', '.join(signature)}):",
        "    rec.trace()",
        f"    return probe(({', '.join(everything)},))",
        f"f = rec.lift(fn{options})",
    ]
    for _ in range(draw(st.integers(1, 4))):
        values = {}
        for p in everything:
            pool = EITHER if p in static else EITHER + ARRAYS * 2
            values[p] = draw(st.sampled_from(pool if p not in donated else ARRAYS))
        fault = draw(st.sampled_from(["", "", "", "", "", "value", "missing"]))
        if fault == "value":
            values[draw(st.sampled_from(everything))] = draw(st.sampled_from(FAULTS))
        elif fault == "missing" and len(params) > 1:
            del values[params[-1]]
        split = draw(st.integers(0, len(params)))
        positional = [values[p] for p in params[:split] if p in values]
        keywords = [f"{p}={values[p]}" for p in everything[split:] if p in values]
        if len(positional) < split:  # a missing argument: the rest go by keyword
            keywords = [f"{p}={values[p]}" for p in everything if p in values]
            positional = []
        lines.append(f"rec.call({', '.join(['f', *positional, *draw(st.permutations(keywords))])})")
    return Program(tuple(lines))
