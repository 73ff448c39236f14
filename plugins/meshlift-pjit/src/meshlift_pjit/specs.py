"""Old `pjit` spec trees in meshlift's terms, and the old and new argument names.

Old `pjit` read `None` as replicated on the mesh in context, or, with no
mesh, as the compiler's choice (meshlift's `None`), and a top-level list of
argument specs as a tuple. A spec that is not given at all stays unspecified.

Example:

```python
from jax.sharding import PartitionSpec as P
from meshlift_pjit.specs import legacy_specs, meshless_specs

assert legacy_specs([None, P("data")], arguments=True) == (P(), P("data"))
assert meshless_specs([None, P("data")], arguments=True) == (None, P("data"))
```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec

from meshlift.plans.sharding import is_spec


class _Unspecified:
    """The default of `in_axis_resources` and friends: no spec given."""

    def __repr__(self) -> str:
        return "UNSPECIFIED"


UNSPECIFIED: Any = _Unspecified()


def legacy_specs(tree: Any, *, arguments: bool = False) -> Any:
    """`tree` for a call with a mesh: `None` leaves as `P()`.

    As `meshless_specs` otherwise: UNSPECIFIED becomes None (the compiler
    chooses), and for `arguments` a top-level list is a tuple.
    """
    if tree is UNSPECIFIED:
        return None
    tree = meshless_specs(tree, arguments=arguments)
    return jax.tree.map(
        lambda leaf: PartitionSpec() if leaf is None else leaf,
        tree,
        is_leaf=lambda x: x is None or is_spec(x),
    )


def meshless_specs(tree: Any, *, arguments: bool = False) -> Any:
    """`tree` for a call with no mesh: `None` kept (the compiler chooses).

    UNSPECIFIED becomes None. For `arguments` a top-level list is a tuple, one
    spec per argument, as old pjit read it; other lists stay lists and match
    list values (an output list, a list argument).
    """
    if tree is UNSPECIFIED:
        return None
    return tuple(tree) if arguments and isinstance(tree, list) else tree


def pick(given: Mapping[str, Any], *, default: str) -> tuple[str, Any]:
    """`(name, value)` of the one name in `given` (oldest first) whose value is not
    UNSPECIFIED, `(default, UNSPECIFIED)` if none is; two given is a ValueError."""
    named = [(name, value) for name, value in given.items() if value is not UNSPECIFIED]
    if len(named) > 1:
        (first, _), (second, _) = named[:2]
        raise ValueError(
            f"pjit got both {first}= and {second}=; {first} is the old name of {second}, "
            f"so pass the specs once, under either name"
        )
    return named[0] if named else (default, UNSPECIFIED)
