"""Every error and warning meshlift raises, in one place; each is also what JAX or flax
would raise for the same mistake where they have one (`PlanError` is a `ValueError`,
`TraceLeakError` is JAX's `UnexpectedTracerError`, `duplicate_axis_error()` is JAX's
`DuplicateSpecError`), so an `except` written for them catches it.

Example:

```python
import pytest
import meshlift as ml
from meshlift.errors import PlanError

assert ml.PlanError is PlanError and issubclass(PlanError, ValueError)
with pytest.raises(ml.BackendNotFoundError, match="no-such-backend"):
    ml.get_backend("no-such-backend")
```
"""

from __future__ import annotations

import functools
from typing import Any

from jax.errors import UnexpectedTracerError

from meshlift import compat


class PlanError(ValueError):
    """A sharding plan does not fit the arguments it is applied to."""


class StructureChangedError(RuntimeError):
    """A lifted function changed its arguments in a way meshlift cannot carry back."""


class TraceLeakError(UnexpectedTracerError, RuntimeError):
    """Writing back would put a tracer into the caller's objects: an outer transform's, or
    one stored in a static value. Also JAX's `UnexpectedTracerError`, which reading that
    tracer later would raise, so an `except` written for JAX catches it."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)  # as it is, without a link to JAX's error page


class RetraceWarning(UserWarning):
    """A lifted function re-traces on every call: its trace changes a static value in place."""


class AxisRuleWarning(UserWarning):
    """An axis rule was skipped because the mesh lacks one of its axes, or does nothing
    because no parameter has its logical name while a name close to it has no rule.

    A typo in a rule (`("mlp", "modle")`, `("mpl", "model")`), or rules written for
    another mesh: either way some parameters are less sharded than the rule asks.
    Silence it for rules shared across meshes with
    `warnings.filterwarnings("ignore", category=ml.AxisRuleWarning)`.
    """


class PluginError(Exception):
    """A plugin registered something meshlift cannot accept.

    Raised for a name two backends or plugins claim, a first-party name taken by
    another distribution, a registered object that is no `Backend`, and a
    backend without the front end asked for.
    """


class BackendNotFoundError(LookupError):
    """No installed backend has the requested name.

    The message lists the installed backends and the distribution to install.
    A `LookupError`.
    """


@functools.cache
def duplicate_axis_error() -> type[PlanError]:
    """The PlanError for a spec naming a mesh axis twice: also jax's `DuplicateSpecError`,
    so an `except` written for `jax.jit` catches it."""

    class DuplicateAxisError(PlanError, compat.duplicate_spec_error()):  # type: ignore[misc]
        __doc__ = duplicate_axis_error.__doc__
        __module__ = __name__
        __qualname__ = "DuplicateAxisError"

        def __init__(self, message: str, mesh: Any = None, pspec: Any = None):
            PlanError.__init__(self, message)
            self.message, self.mesh, self.pspec = message, mesh, pspec  # jax's fields

        def __str__(self) -> str:
            return self.message

    return DuplicateAxisError
