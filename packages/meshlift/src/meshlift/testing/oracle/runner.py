"""Running one program two ways, and what may differ between them.

A `Lifting` says what `rec.lift` does: eager (the function itself),
`jax.jit`, or a meshlift backend with or without a plan. `run` executes a
program's source under one lifting and returns its records: per call, the
output and the state of every model (values and object identities), the
arrays it deleted, how often the function was traced, or the error. `compare`
runs a reference and a target and says where their records differ:

* outputs, final state and identities must be equal, values to 1e-5; between
  two meshlift runs (its fast paths against its slow path), each output array
  placed alike, as the layout each call ran on decides;
* a call must delete no array its caller did not donate (and, against
  `jax.jit`, exactly the arrays `jax.jit` deletes, after the same number of
  traces);
* both raise, the target an instance of the reference's exception; or the
  target refuses what `jax.jit` refuses (keyword arguments next to
  `in_shardings`, one donated buffer given twice), which the reference
  then skips; any other refusal is a difference, as a wrong answer is;
* a call that raised changed nothing the caller can see.

Example:

```python
from meshlift.testing.oracle.programs import Program
from meshlift.testing.oracle.runner import compare, lifting

program = Program((
    "m0 = Box(w0=nnx.Param(grid((8,), 0.5)))",
    "rec.start(m0=m0)",
    "def fn(a, x):",
    "    args = (a, x)",
    "    bump(node(args, 0), 'w0', 1.0)",
    "    return probe(args)",
    "f = rec.lift(fn)",
    "rec.call(f, m0, grid((8,), 0.0))",
    "rec.call(f, grid((8,), 0.0), m0)",
))
assert compare(program, lifting("ml.jit"), lifting("eager")) == []
```
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift import compat, modes
from meshlift.graph.split import is_graph_leaf
from meshlift.testing.models import graph_mode_cached_partial
from meshlift.testing.oracle import vocabulary
from meshlift.testing.oracle.observe import Identities, differences
from meshlift.testing.oracle.programs import Program


def _matrix(path: Any, variable: Any) -> bool:
    return getattr(variable, "ndim", 0) == 2 and variable.shape[1] % 4 == 0


def _vector(path: Any, variable: Any) -> bool:
    return getattr(variable, "ndim", 0) == 1 and variable.shape[0] % 4 == 0


# The oracle's plan on a 2x4 mesh: matrices split over `model` by column, vectors by row.
PLAN = ml.StateSharding({_matrix: P(None, "model"), _vector: P("model"), ...: P()})


@attrs.frozen
class Lifting:
    """What `rec.lift(fn, **options)` makes of a function, and how a run is set up.

    `keywords` is False where `jax.jit` refuses keyword arguments (next to
    `in_shardings`); `context` is entered around the whole run.
    """

    name: str
    lift: Callable[..., Any]
    partial: Callable[..., Any] = graph_mode_cached_partial
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    keywords: bool = True
    reference: bool = False


EAGER = Lifting("eager", lambda fn, **options: fn, functools.partial, reference=True)
JAX_JIT = Lifting("jax.jit", jax.jit, functools.partial, reference=True)
MODIFIERS = {  # a name's suffixes: how meshlift's own switches are set for the run
    "slow": modes.slow_path,
    "checked": modes.checked_fast_paths,
    "python": modes.python_loops,
}


def lifting(name: str | ml.Backend | Lifting) -> Lifting:
    """A lifting by name: `eager`, `jax.jit`, `ml.jit` (no shardings), or a backend (its
    name, or the object), run as the conformance kit runs it (the oracle's `PLAN` on a
    2x4 mesh, or everything replicated for a backend that runs per shard). Suffixes
    switch meshlift's fast paths off (`+slow`), check them (`+checked`), or use the
    Python twins of its C loops (`+python`): `"jit+slow"`.
    """
    if isinstance(name, Lifting):
        return name
    base: str | ml.Backend
    if isinstance(name, ml.Backend):
        base, suffixes, name = name, [], name.name
    else:
        base, *suffixes = name.split("+")
    if base in ("eager", "jax.jit"):
        return EAGER if base == "eager" else JAX_JIT
    if base == "ml.jit":
        chosen = Lifting(name, ml.jit)
    else:
        backend = ml.get_backend(base)
        per_shard = "manual-collectives" in backend.capabilities
        specs = {"in_specs": P(), "out_specs": P()} if per_shard else {"in_specs": PLAN}
        lift = functools.partial(ml.transform, backend, mesh=mesh(), **specs)
        chosen = Lifting(name, lift, keywords=False)
    switches = [MODIFIERS[suffix] for suffix in suffixes]
    return attrs.evolve(chosen, context=lambda: _entered(switches))


@contextlib.contextmanager
def _entered(contexts: Sequence[Callable[[], contextlib.AbstractContextManager]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context())
        yield


@functools.cache
def mesh() -> Any:
    """The oracle's `{"data": 2, "model": 4}` mesh (of CPU devices where fewer accelerators)."""
    devices = jax.devices()
    if len(devices) < 8:
        devices = jax.devices("cpu")
    return ml.make_mesh({"data": 2, "model": 4}, devices=devices[:8])


class _Stop(Exception):
    """The program cannot go on in this run (a call raised)."""


class Recorder:
    """The `rec` a program is run with: lifts, calls, and records what happens.

    `rules` is the target's lifting: both runs predict from it which calls
    `jax.jit` would refuse. The target must refuse keyword arguments next to
    specs, and may refuse a donated array that another input holds (placing
    it onto a plan may have copied it); a reference skips the calls the
    target must refuse and those it did refuse (`refused`, by call number).
    """

    def __init__(self, lifting: Lifting, rules: Lifting, refused: frozenset[int] = frozenset()):
        self.lifting, self.rules, self.refused = lifting, rules, refused
        self.calls = 0
        self.records: list[tuple] = []
        self.traces = 0
        self.roots: dict[str, Any] = {}
        self.identities = Identities({})
        self._prefix: tuple[Any, ...] = ()

    def start(self, **roots: Any) -> None:
        """Name the models whose state is compared."""
        self.roots, self.identities = roots, Identities(roots)

    def trace(self) -> None:
        """Called by the function's body: counts how often its Python runs."""
        self.traces += 1

    def lift(self, fn: Callable[..., Any], **options: Any) -> Any:
        self.fn, self.options = fn, options
        try:
            return self.lifting.lift(fn, **options)
        except Exception as error:
            self.records.append(("lift", type(error).__name__, str(error)))
            raise _Stop from error

    def partial(self, f: Callable[..., Any], *nodes: Any) -> Any:
        self._prefix = nodes
        return self.lifting.partial(f, *nodes)

    def call(self, f: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.calls += 1
        arguments = self._arguments((*self._prefix, *args), kwargs)
        refusal = self._refusal(arguments, kwargs) if arguments is not None else None
        if self.lifting.reference and (refusal == "keywords" or self.calls in self.refused):
            self.records.append(("skipped", refusal))
            return
        donated, kept = _arrays(arguments or [])
        before = self.identities.describe(self.roots)
        try:
            out = f(*args, **kwargs)
        except Exception as error:
            after = self.identities.describe(self.roots)
            changed = differences(before, after)
            self.records.append(("error", type(error), str(error), refusal, changed, self.calls))
            if refusal is None:
                raise _Stop from error
            return
        deleted = {i for i, x in (*donated, *kept) if _deleted(x)}
        self.records.append(
            (
                "call",
                self.identities.describe_output(out),
                self.identities.describe(self.roots),
                sorted(deleted),
                sorted(deleted - {i for i, _ in donated}),
                self.traces,
                refusal,
                None if self.lifting.reference else _shardings(out),
            )
        )

    def _arguments(self, args: tuple, kwargs: dict) -> list[tuple[str, bool, bool, Any]] | None:
        """`(parameter, static, donated, value)` per argument, in the order JAX flattens
        them (positional, then keywords by name); None if they do not bind."""
        try:
            signature = inspect.signature(self.fn)
            bound = signature.bind(*args, **kwargs)
        except (TypeError, ValueError):
            return None
        names = list(signature.parameters)
        options = self.options

        def chosen(kind: str) -> set[str]:
            nums = options.get(f"{kind}_argnums", ())
            nums = (nums,) if isinstance(nums, int) else nums or ()
            named = options.get(f"{kind}_argnames", ())
            named = (named,) if isinstance(named, str) else named or ()
            return {names[i] for i in nums if -len(names) <= i < len(names)} | set(named)

        static, donated = chosen("static"), chosen("donate")
        positional = [(names[i], value) for i, value in enumerate(bound.args)]
        keywords = sorted(bound.kwargs.items())
        receiver = getattr(self.fn, "__self__", None)  # a bound method's module is an input
        lifted = [("self", False, False, receiver)] if is_graph_leaf(receiver) else []
        return lifted + [(n, n in static, n in donated, v) for n, v in positional + keywords]

    def _refusal(self, arguments: list, kwargs: dict) -> str | None:
        """What `jax.jit` would refuse in this call: keyword arguments next to shardings,
        or a donated array that another input holds too."""
        statics = {name for name, static, _, _ in arguments if static}
        if not self.rules.keywords and set(kwargs) - statics:
            return "keywords"
        donated, kept = _arrays(arguments)
        if any(compat.is_ref(x) for _, x in kept + donated):
            return None  # meshlift donates nothing beside a reference (ref=True)
        donated_ids = [id(x) for _, x in donated]
        every = donated_ids + [id(x) for _, x in kept]
        if len(set(donated_ids)) < len(donated_ids) or any(every.count(i) > 1 for i in donated_ids):
            return "donation"
        return None


def _arrays(arguments: list) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """The staged inputs a call's arguments make, `(path, array)`, donated and kept: one
    per Variable (where it is first met) and one per array where it is held."""
    seen: set[int] = set()  # graph nodes and Variables, counted once
    donated: list[tuple[str, Any]] = []
    kept: list[tuple[str, Any]] = []

    def visit(x: Any, path: str, holder: list) -> None:
        if is_graph_leaf(x):
            if id(x) in seen:
                return
            seen.add(id(x))
            if isinstance(x, nnx.Variable):
                x = x.get_raw_value()
            else:
                for name, value in sorted(vocabulary.attributes(x).items()):
                    visit(value, f"{path}.{name}", holder)
                return
        if isinstance(x, jax.Array) or compat.is_ref(x):
            holder.append((path, x))

    for name, static, donate, value in arguments:
        if not static:
            leaves = jax.tree_util.tree_flatten_with_path(value, is_leaf=is_graph_leaf)[0]
            for keys, leaf in leaves:
                visit(leaf, name + jax.tree_util.keystr(keys), donated if donate else kept)
    return donated, kept


def _deleted(x: Any) -> bool:
    return isinstance(x, jax.Array) and x.is_deleted()


def _shardings(out: Any) -> dict[str, Any]:
    """The sharding (and rank) of each array in an output, by path: what the layout made."""
    leaves = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_graph_leaf)[0]
    return {
        "out" + jax.tree_util.keystr(keys): (leaf.sharding, leaf.ndim)
        for keys, leaf in leaves
        if isinstance(leaf, jax.Array) and not leaf.is_deleted()
    }


_NAMESPACE = {name: getattr(vocabulary, name) for name in vocabulary.__all__}


def run(
    program: Program | Callable[[Recorder], None],
    lifting: Lifting,
    rules: Lifting,
    refused: frozenset[int] = frozenset(),
) -> list:
    """The records of `program` run under `lifting`, refusals predicted from `rules` (a
    reference skips the calls `refused` by the target)."""
    body = program
    if isinstance(program, Program):
        namespace = dict(_NAMESPACE)
        exec(compile(program.source(), "<oracle program>", "exec"), namespace)
        body = namespace["program"]
    recorder = Recorder(lifting, rules, refused)
    with lifting.context(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a plan's unmatched filter, say: what runs is compared
        try:
            body(recorder)  # type: ignore[operator]
        except _Stop:
            pass
        except Exception as error:  # outside a call (flax refusing a model, say): both must
            recorder.records.append(("program", type(error).__name__, str(error)))
    return recorder.records


def compare(
    program: Program | Callable[[Recorder], None],
    target: Lifting,
    reference: Lifting = EAGER,
) -> list[str]:
    """Where `target`'s run of `program` differs from `reference`'s (empty: they agree)."""
    actual = run(program, target, target)
    refused = frozenset(r[5] for r in actual if r[0] == "error" and r[3] is not None)
    expected = run(program, reference, target, refused)
    exact = reference is JAX_JIT
    for step, (want, got) in enumerate(zip(expected, actual, strict=False)):
        problems = _step_differences(want, got, exact)
        if problems:
            return [f"step {step + 1} ({_describe(want)} -> {_describe(got)}):", *problems]
        if got[0] == "error" and got[3] is None:
            return []  # both stopped, as they should
    if len(expected) != len(actual):
        return [f"the runs made {len(expected)} and {len(actual)} records"]
    return []


def check(program: Program, target: str | ml.Backend | Lifting, reference: str = "eager") -> None:
    """Raise AssertionError if `program` runs otherwise under `target` than under
    `reference` (`lifting` names, or a backend), with a snippet that reproduces it."""
    chosen = lifting(target)
    problems = compare(program, chosen, lifting(reference))
    if problems:
        shown = "\n".join(problems)
        raise AssertionError(
            f"{chosen.name} differs from {reference}:\n{shown}\n\nTo reproduce:\n\n"
            + snippet(program, chosen.name, reference)
        )


def replay(program: Callable[[Recorder], None], target: str, reference: str = "eager") -> None:
    """Run a snippet's `program` both ways; print that they agree, or raise AssertionError
    listing where they differ."""
    problems = compare(program, lifting(target), lifting(reference))
    if problems:
        raise AssertionError(f"{target} differs from {reference}:\n" + "\n".join(problems))
    print(f"{target} agrees with {reference}")


def _describe(record: tuple) -> str:
    kind = record[0]
    if kind == "error":
        return f"raised {record[1].__name__}"
    if kind in ("lift", "program"):
        return f"{'lifting' if kind == 'lift' else 'the program'} raised {record[1]}"
    return {"call": "returned", "skipped": f"skipped ({record[1]})"}[kind]


def _step_differences(want: tuple, got: tuple, exact: bool) -> list[str]:
    if want[0] == "skipped":  # the target refuses this call, changing nothing
        if got[0] != "error" or not issubclass(got[1], ValueError):
            return [f"the target should refuse this call as jax.jit does ({want[1]})"]
        return [f"the refused call changed: {line}" for line in got[4]]
    if want[0] in ("lift", "program") or got[0] in ("lift", "program"):
        if want[:2] != got[:2] or (exact and want[2] != got[2]):
            return [f"{want[0]}: expected {want[1:]}, got {got[1:]}"]
        return []
    if got[0] == "error":
        problems = [f"the failed call changed: {line}" for line in got[4]]
        if want[0] == "error":
            if not issubclass(got[1], want[1]):
                problems.append(f"raised {got[1].__name__}, not {want[1].__name__}: {got[2]}")
            return problems
        return [*problems, f"raised {got[1].__name__}: {got[2]}"]
    if want[0] == "error":
        return [f"the reference raised {want[1].__name__} ({want[2]}); the target returned"]
    _, want_out, want_state, want_deleted, _, want_traces, _, want_shardings = want
    _, got_out, got_state, got_deleted, undonated, got_traces, _, got_shardings = got
    problems = [f"output {line}" for line in differences(want_out, got_out)]
    if want_shardings is not None and got_shardings is not None:  # two meshlift runs
        problems += _sharding_differences(want_shardings, got_shardings)
    problems += [f"state {line}" for line in differences(want_state, got_state)]
    problems += [f"deleted `{path}`, which was not donated" for path in undonated]
    if exact and want_deleted != got_deleted:
        problems.append(f"deleted {got_deleted}, where jax.jit deletes {want_deleted}")
    if exact and want_traces != got_traces:
        problems.append(f"traced {got_traces} times so far, jax.jit {want_traces}")
    return problems


def _sharding_differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Output arrays that two meshlift runs of one program placed otherwise."""
    return [
        f"`{path}` is placed {actual[path][0]}, where the reference placed it {sharding}"
        for path, (sharding, ndim) in expected.items()
        if path in actual and not sharding.is_equivalent_to(actual[path][0], ndim)
    ]


def snippet(program: Program, target: str, reference: str = "eager") -> str:
    """`program` as a script that runs it both ways and prints where they differ."""
    return (
        "import os\n"
        'os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")\n'
        "from meshlift.testing.oracle.runner import replay\n"
        "from meshlift.testing.oracle.vocabulary import *\n\n"
        f"{program.source()}\n"
        f"replay(program, {target!r}, {reference!r})\n"
    )
