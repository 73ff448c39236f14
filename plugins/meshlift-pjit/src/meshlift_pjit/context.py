"""The call-site mesh, looked up at each call the way old ``pjit`` code declares it.

Order: ``ml.use_mesh(mesh)`` / ``jax.set_mesh(mesh)`` first, then the
deprecated ``with mesh:`` context. No mesh is an error that says how to
declare one.

Example::

    import meshlift as ml
    from meshlift_pjit import call_site_mesh

    mesh = ml.make_mesh({"data": 2, "model": 4})
    with ml.use_mesh(mesh):
        assert call_site_mesh() == mesh
"""

from __future__ import annotations

from jax.sharding import Mesh

import meshlift as ml


def call_site_mesh(name: str = "this function") -> Mesh:
    """The concrete mesh in context at the call of ``name``; a RuntimeError if there is none.

    Works inside traces (an outer ``jax.jit``, ``jax.vmap``, ``jax.grad``) too.
    """
    mesh = ml.current_mesh(legacy=True)
    if mesh is not None:
        return mesh
    raise RuntimeError(
        f"pjit requires a non-empty mesh! {name} was called with no mesh in context. "
        f"Declare one at the call site: `mesh = ml.make_mesh({{'data': 2, 'model': 4}})`, "
        f"then call it inside `with ml.use_mesh(mesh):` (or `with jax.set_mesh(mesh):`)"
    )
