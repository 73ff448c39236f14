"""JAX's stages for a lifted function: `Traced` -> `Lowered` -> `Compiled`.

Each wraps JAX's own object (every attribute of it is reachable, and the
object itself is `jax_traced`/`jax_lowered`/`jax_compiled`). What JAX
reports per input or output (`in_avals`, `args_info`, `out_info`,
`input_shardings`...) is given in the caller's terms: `(args, kwargs)` of
the dynamic arguments, each module an `nnx.State` by Variable path. A
`Compiled` is called like the lifted function without its static
arguments, as JAX's is, modules included, writing back as a call does.

Example:

```python
mesh = ml.make_mesh({"data": 2, "model": 4})
model, batch = nnx.Linear(16, 32, rngs=nnx.Rngs(0)), jnp.ones((8, 16))
step = ml.jit(lambda model, batch: model(batch).sum(), in_shardings=(P(), P("data")), mesh=mesh)

compiled = step.lower(model, batch).compile()
(model_avals, batch_avals), _ = compiled.in_avals
loss = compiled(model, batch)
```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshlift.call import calls
from meshlift.call.arguments import insert_statics, named_statics, original_index
from meshlift.call.layout import as_state
from meshlift.call.staged_errors import named_errors
from meshlift.paths import format_path, key_name, listing


class _Stage:
    """One JAX stage object, the entry (argument layout) it was made for, and the lifted
    function it came from."""

    def __init__(self, staged: Any, entry: Any, lifted: Any):
        self._jax_stage, self._entry, self._lifted = staged, entry, lifted
        self._layout = entry.layout

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jax_stage, name)

    @property
    def in_avals(self) -> Any:
        """JAX's `in_avals` as `(args, kwargs)`, each module an `nnx.State`."""
        return self._layout.as_arguments(self._jax_stage.in_avals)

    @property
    def args_info(self) -> Any:
        """JAX's `args_info` as `(args, kwargs)`, each module an `nnx.State`."""
        return self._layout.as_arguments(self._jax_stage.args_info)

    @property
    def out_info(self) -> Any:
        """JAX's `out_info` as the caller's output, graph outputs as `nnx.State`."""
        return as_output(self._jax_stage.out_info)

    @property
    def in_tree(self) -> Any:
        """The structure of `(args, kwargs)` as the caller passed them, statics left out."""
        return jax.tree.structure(self.in_avals)

    @property
    def out_tree(self) -> Any:
        """The structure of the caller's output."""
        return jax.tree.structure(self.out_info)


class Traced(_Stage):
    """JAX's `Traced` for a lifted function; `.lower()` continues to a `Lowered`."""

    @property
    def jax_traced(self) -> Any:
        """JAX's own `Traced`, over the pure function."""
        return self._jax_stage

    @property
    def out_avals(self) -> Any:
        """JAX's `out_avals` as the caller's output."""
        return as_output(self._jax_stage.out_avals)

    def lower(self, **kwargs: Any) -> Lowered:
        """JAX's `Traced.lower`.

        Args:
            **kwargs: JAX's `lower` keywords, passed on.

        Returns:
            A `Lowered` for the same arguments.

        Raises:
            meshlift.PlanError: If a spec does not fit its argument.
        """
        with named_errors(self._layout):
            return Lowered(self._jax_stage.lower(**kwargs), self._entry, self._lifted)


class Lowered(_Stage):
    """JAX's `Lowered` for a lifted function (`as_text`, `cost_analysis`...)."""

    @property
    def jax_lowered(self) -> Any:
        """JAX's own `Lowered`, over the pure function."""
        return self._jax_stage

    def compile(self, compiler_options: dict[str, Any] | None = None, **kwargs: Any) -> Compiled:
        """JAX's `compile` (`compiler_options`, and its keywords such as `device_assignment`).

        Args:
            compiler_options: XLA compiler options, as for JAX's `compile`; None: none.
            **kwargs: JAX's other `compile` keywords, passed on.

        Returns:
            A `Compiled`, called like the lifted function without its static arguments.
        """
        compiled = self._jax_stage.compile(compiler_options, **kwargs)
        return Compiled(compiled, self._entry, self._lifted)


class Compiled(_Stage):
    """JAX's `Compiled`, called with the lifted function's dynamic arguments.

    `as_text`, `cost_analysis` and `memory_analysis` are JAX's;
    `input_shardings` and `output_shardings` are in the caller's terms.
    Calling it runs the program and writes back as a call of the lifted
    function does.

    Raises:
        TypeError: When called with another number of positional arguments or other
            keyword names than it was lowered with, or with arguments of another
            structure, shape, dtype or static value.
    """

    @property
    def jax_compiled(self) -> Any:
        """JAX's own `Compiled`, over the pure function."""
        return self._jax_stage

    @property
    def input_shardings(self) -> Any:
        """JAX's `input_shardings` as `(args, kwargs)`, each module an `nnx.State`."""
        return self._layout.as_arguments(self._jax_stage.input_shardings)

    @property
    def output_shardings(self) -> Any:
        """JAX's `output_shardings` as the caller's output."""
        return as_output(self._jax_stage.output_shardings)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layout, lifted = self._layout, self._lifted
        args = lifted._bound(args)  # a bound method's receiver first
        if len(args) != layout.arg_count or set(kwargs) != set(layout.kwarg_names):
            statics = [lifted.signature.name(where) for where, _ in layout.statics]
            raise TypeError(
                f"this Compiled takes {layout.arg_count} positional argument(s) and the keyword "
                f"argument(s) {sorted(layout.kwarg_names)}, as it was lowered, got {len(args)} "
                f"and {sorted(kwargs)}"
                + (
                    f"; static arguments ({', '.join(statics)}) are not passed again"
                    if statics
                    else ""
                )
            )
        args = tuple(insert_statics(args, layout.statics))
        kwargs = {**kwargs, **named_statics(layout.statics)}
        current, call = lifted._entry(args, kwargs, layout.mesh)
        if current.staged is not self._entry.staged:
            raise TypeError(self._mismatch(current.layout))
        try:
            return calls.run(current, self._jax_stage, call)
        except TypeError as error:  # JAX's, about its flat inputs: say it by the caller's paths
            differ = self._differences(current, call)
            if not differ:
                raise
            raise TypeError(
                f"{lifted.names.function} was compiled for other argument types: "
                + "; ".join(differ)
                + ". Call .lower(...).compile() again for these arguments"
            ) from error

    def _mismatch(self, layout: Any) -> str:
        """Why arguments laid out as `layout` cannot call this: the paths that are not the
        compiled ones (as jax.jit's Compiled says where the trees differ), else the rest."""
        compiled, given = self._layout.input_names(), layout.input_names()
        new = [p for p in given if p not in compiled]
        missing = [p for p in compiled if p not in given]
        again = "Call .lower(...).compile() again for these arguments"
        if not new and not missing:
            return (
                f"{self._lifted.names.function} was compiled for these arguments' structure "
                f"with other shardings or static values. {again}"
            )
        differ = [f"given {listing(new)}, which it was not compiled for"] if new else []
        differ += [f"not given {listing(missing)}"] if missing else []
        return (
            f"{self._lifted.names.function} was compiled for arguments of another structure: "
            f"{'; '.join(differ)}. {again}"
        )

    def _differences(self, current: Any, call: Any) -> list[str]:
        """Each argument whose shape or dtype is not what this was compiled for, by path."""
        compiled = jax.tree_util.tree_flatten_with_path(self.in_avals)[0]
        inputs = self._layout.as_arguments((calls.placed_inputs(current.layout, call), {}))
        given = jax.tree.leaves(inputs)
        out = []
        for (path, aval), value in zip(compiled, given, strict=True):
            shape, dtype = np.shape(value), jnp.result_type(value)
            if (tuple(aval.shape), aval.dtype) != (shape, dtype):
                now = f"{dtype.name}[{','.join(map(str, shape))}]"
                out.append(f"`{self._caller_path(path)}` was {aval.str_short()}, is {now}")
        return out

    def _caller_path(self, path: tuple[Any, ...]) -> str:
        """`model.linear1.kernel` for a key path into `(args, kwargs)`, statics left out."""
        group, argument, *inside = path
        if group.idx == 0:  # positional: the caller's name for it, counting statics
            index = original_index(argument.idx, self._layout.statics)
            name = self._lifted.signature.name(index)
        else:
            name = key_name(argument)
        return format_path((name, *map(key_name, inside)))


def as_output(tree: Any) -> Any:
    """A tree over the staged outputs as the caller's output, graph nodes as `nnx.State`."""
    _, _, user_out, aux = tree
    info = aux.info
    nodes = info.outputs
    if nodes.graphdefs:
        items = nodes.treedef.flatten_up_to(user_out)
        for i, paths in nodes.paths.items():
            items[i] = as_state(dict(zip(paths, items[i], strict=True)))
        user_out = nodes.treedef.unflatten(items)
    return user_out if info.container is None else info.container(user_out)
