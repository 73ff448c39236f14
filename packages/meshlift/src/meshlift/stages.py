"""JAX's stages for a lifted function: ``Traced`` -> ``Lowered`` -> ``Compiled``.

Each wraps JAX's own object (every attribute of it is reachable), and a
``Compiled`` is called with the same arguments as the lifted function,
modules included, writing back as a call does.

Example:

```python
compiled = step.lower(model, batch).compile()
loss = compiled(model, batch)
```
"""

from __future__ import annotations

from typing import Any


class _Stage:
    """One JAX stage object and the argument layout it was made for."""

    def __init__(self, staged: Any, layout: Any):
        self._jax_stage, self._layout = staged, layout

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jax_stage, name)


class Traced(_Stage):
    """JAX's ``Traced`` for a lifted function; ``.lower()`` continues to a ``Lowered``."""

    @property
    def jax_traced(self) -> Any:
        return self._jax_stage

    def lower(self, **kwargs: Any) -> Lowered:
        return Lowered(self._jax_stage.lower(**kwargs), self._layout)


class Lowered(_Stage):
    """JAX's ``Lowered`` for a lifted function (``as_text``, ``cost_analysis``...)."""

    @property
    def jax_lowered(self) -> Any:
        return self._jax_stage

    def compile(self, compiler_options: dict[str, Any] | None = None) -> Compiled:
        return Compiled(self._jax_stage.compile(compiler_options), self._layout)


class Compiled(_Stage):
    """JAX's ``Compiled``, called with the same kind of arguments as the lifted function.

    ``as_text``, ``cost_analysis``, ``memory_analysis``, ``input_shardings`` and
    ``output_shardings`` are JAX's, in terms of the staged function's flat inputs.
    """

    @property
    def jax_compiled(self) -> Any:
        return self._jax_stage

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layout = self._layout
        current, call = layout.lifted._layout(args, kwargs, layout.mesh)
        if current.staged is not layout.staged:
            raise TypeError(
                "these arguments differ in structure, shardings or static values from the ones "
                "this function was compiled for; call .lower(...).compile() again for them"
            )
        return current.run(self._jax_stage, call)
