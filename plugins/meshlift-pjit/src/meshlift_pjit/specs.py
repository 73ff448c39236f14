"""Old ``pjit`` spec trees in meshlift's terms, and the old and new argument names.

Old ``pjit`` read ``None`` as replicated (meshlift's ``None`` leaves the
choice to the compiler) and lists as tuples. A spec that is not given at all
stays unspecified.

Example::

    from jax.sharding import PartitionSpec as P
    from meshlift_pjit.specs import legacy_specs

    assert legacy_specs([None, P("data")]) == (P(), P("data"))
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec

from meshlift.sharding import is_spec


class _Unspecified:
    """The default of ``in_axis_resources`` and friends: no spec given."""

    def __repr__(self) -> str:
        return "UNSPECIFIED"


UNSPECIFIED: Any = _Unspecified()


def legacy_specs(tree: Any) -> Any:
    """``tree`` with ``None`` leaves as ``P()`` and lists as tuples; UNSPECIFIED as None."""
    if tree is UNSPECIFIED:
        return None
    return jax.tree.map(_legacy_leaf, tree, is_leaf=lambda x: is_spec(x) or isinstance(x, list))


def _legacy_leaf(leaf: Any) -> Any:
    if leaf is None:
        return PartitionSpec()
    if isinstance(leaf, list):
        return tuple(legacy_specs(item) for item in leaf)
    return leaf


def pick(old_name: str, old: Any, new_name: str, new: Any) -> tuple[str, Any]:
    """``(name, value)`` of whichever of the two names was given; both is a TypeError."""
    if old is not UNSPECIFIED and new is not UNSPECIFIED:
        raise TypeError(
            f"pjit got both {old_name}= and {new_name}=; {old_name} is the old name of "
            f"{new_name}, so pass the specs once, under either name"
        )
    return (new_name, new) if new is not UNSPECIFIED else (old_name, old)
