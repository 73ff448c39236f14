"""The pipeline schedule: a scan over a stack of layers, run as stages over microbatches.

`Schedule.scan` runs what `ml.scan_layers(f, init, xs)` runs for a layer stack
(`f(carry, layer) -> (carry, None)`, every leaf of `xs` with a leading layer axis)
with the layers split into `S` stages along the mesh axis `axis` and the batch (the
carry's leading axis) into `M` microbatches, as a GSPMD pipeline (MaxText's
`layers/pipeline.py`): the stage dimension of the layer weights and of the activations
in flight is sharded over `axis`, every stage runs at every step on the activation its
neighbour passed it (`jnp.roll` over the stage dimension: a collective permute), and
the loop runs `M * R + S - 1` steps. With `repeats=R > 1` (circular), stage `s` holds
the layer groups `s, s + S, s + 2S, ...` and each microbatch passes the stages `R` times.

Example:

```python
import jax, jax.numpy as jnp
import meshlift as ml
from meshlift.layers import running
from meshlift_pipeline.schedule import Schedule

mesh = ml.make_mesh({"stage": 4}, devices=jax.devices()[:4])
weights = jnp.ones((8, 3, 3)) / 3  # 8 layers
f = lambda x, w: (jnp.tanh(x @ w), None)
x = jnp.ones((6, 3))

@jax.jit
def pipelined(x, weights):  # what the pipeline backend's staged step does
    with running(Schedule(mesh, "stage", microbatches=3).scan):
        return ml.scan_layers(f, x, weights)[0]

assert jnp.allclose(pipelined(x, weights), jax.lax.scan(f, x, weights)[0], rtol=1e-6)
```
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, get_abstract_mesh
from jax.sharding import PartitionSpec as P

from meshlift.layers import Body


@attrs.frozen
class Schedule:
    """How a layer stack runs pipelined: over `mesh`'s axis `axis`, its batch split into
    `microbatches` (None: one per stage), each passing the stages `repeats` times (1:
    GPipe; more: circular)."""

    mesh: Any
    axis: str
    given_microbatches: int | None = attrs.field(default=None, alias="microbatches")
    repeats: int = 1

    @property
    def microbatches(self) -> int:
        return self.given_microbatches or self.stages

    @property
    def stages(self) -> int:
        """The size of the stage axis; 1 (no pipeline) on a mesh without it, or none."""
        return 1 if self.mesh is None else int(dict(self.mesh.shape).get(self.axis, 1))

    def steps(self) -> int:
        """The loop's length: `M * R + S - 1` stage steps."""
        return self.microbatches * self.repeats + self.stages - 1

    def passes(self, t: Any, xp: Any = jnp) -> tuple[Any, Any, Any]:
        """What each stage works on at stage step `t`: the microbatch, the repeat, and
        whether it works at all (False: a bubble). The traced loop calls it with `jnp`,
        `timeline` with numpy."""
        work = t - xp.arange(self.stages)  # the pass of a microbatch through the stages
        valid = (work >= 0) & (work < self.microbatches * self.repeats)
        repeat = xp.clip(work // self.microbatches, 0, self.repeats - 1)
        return work % self.microbatches, repeat, valid

    def timeline(self) -> str:
        """The schedule drawn: a row per stage, a column per stage step, each cell the
        microbatch the stage runs then (with its repeat after a colon when `repeats > 1`),
        `.` for a bubble; then the bubble fraction, counted.

        Example:

        ```python
        from meshlift_pipeline import Schedule

        mesh = ml.make_mesh({"stage": 2}, devices=jax.devices()[:2])
        print(Schedule(mesh, "stage", microbatches=3).timeline())
        # stage 0 │ 0 1 2 .
        # stage 1 │ . 0 1 2
        # 4 stage steps; bubbles 2 of 8 cells (0.25 = (S-1)/(M*R+S-1))
        ```
        """
        cells = np.array([self._cells(t) for t in range(self.steps())]).T
        width = max(map(len, cells.flat))
        rows = [
            f"stage {s} │ " + " ".join(cell.rjust(width) for cell in row)
            for s, row in enumerate(cells)
        ]
        bubbles = int((cells == ".").sum())
        rows.append(
            f"{self.steps()} stage steps; bubbles {bubbles} of {cells.size} cells "
            f"({bubbles / cells.size:.2f} = (S-1)/(M*R+S-1))"
        )
        return "\n".join(rows)

    def _cells(self, t: int) -> list[str]:
        microbatch, repeat, valid = self.passes(t, np)
        return [
            "." if not v else str(m) if self.repeats == 1 else f"{m}:{r}"
            for m, r, v in zip(microbatch, repeat, valid, strict=True)
        ]

    def scan(self, body: Body, init: Any, xs: Any, state: Any) -> tuple[Any, None, Any]:
        """The stack pipelined: `body(carry, x, state) -> (carry, None, state)` for each
        layer (`meshlift.layers.Scan`); returns the carry, no per-layer outputs, and each
        layer's state as the last microbatch through it left it."""
        layers, batch = self._check(init, (xs, state))
        if self.stages == 1:  # one stage: the microbatches in turn, nothing to lay out
            return self._scan(body, init, xs, state, layers, batch, None)
        if all(t == AxisType.Auto for t in self.mesh.axis_types):
            return self._scan(body, init, xs, state, layers, batch, self.mesh)
        # Explicit axes (sharding in types): the schedule's reshapes and rolls are written
        # for the compiler to partition, as under Auto axes; the carry and the state leave
        # with the shardings they came in with.
        out = (init, state)
        specs = [jax.typeof(leaf).sharding.spec for leaf in jax.tree.leaves(out)]

        def run(init: Any, xs: Any, state: Any) -> tuple[Any, ...]:
            mesh = get_abstract_mesh()
            carry, _, state = self._scan(body, init, xs, state, layers, batch, mesh)
            return tuple(jax.tree.leaves((carry, state)))

        with jax.sharding.use_abstract_mesh(_abstract(self.mesh)):  # auto_axes reads it
            leaves = jax.sharding.auto_axes(
                run, out_sharding=tuple(NamedSharding(self.mesh, spec) for spec in specs)
            )(init, xs, state)
        carry, state = jax.tree.unflatten(jax.tree.structure(out), leaves)
        return carry, None, state

    def _check(self, init: Any, xs: Any) -> tuple[int, int]:
        """The stack's depth and the batch size, or a ValueError saying what does not fit."""
        S, M, R = self.stages, self.microbatches, self.repeats
        depths = {_leading(leaf) for leaf in jax.tree.leaves(xs)}
        if len(depths) != 1 or -1 in depths:
            raise ValueError(
                f"a pipelined layer stack needs every leaf of xs to have the same leading "
                f"(layer) axis, got leading sizes {sorted(map(_size, depths))} (shapes "
                f"{_shapes(xs)}): stack every layer's arrays along axis 0, as nnx.vmap does"
            )
        (layers,) = depths
        if layers % (S * R):
            raise ValueError(
                f"{layers} layers (the stack's shapes {_shapes(xs)}) do not split into {S} "
                f"stages (mesh axis {self.axis!r} of {self._mesh_text()}) x {R} repeats: the "
                f"depth must be a multiple of stages x repeats = {S * R}; change repeats= or "
                f"the size of {self.axis!r}"
            )
        batches = {_leading(leaf) for leaf in jax.tree.leaves(init)}
        if len(batches) != 1 or -1 in batches or next(iter(batches)) % M:
            raise ValueError(
                f"a pipelined layer stack splits the carry's leading (batch) axis into "
                f"{M} microbatches; the carry's leading sizes are "
                f"{sorted(map(_size, batches))} (shapes {_shapes(init)}): give a batch that "
                f"{M} divides, or another microbatches="
            )
        if R > 1 and M < S:
            raise ValueError(
                f"the circular schedule (repeats={R}) needs at least as many microbatches as "
                f"stages: {M} microbatches < {S} stages (mesh axis {self.axis!r} of "
                f"{self._mesh_text()}); a microbatch leaving the last stage goes back to the "
                f"first, which must not be busy with an earlier one: give microbatches>={S}"
            )
        return layers, next(iter(batches))

    def _mesh_text(self) -> str:
        return "no mesh" if self.mesh is None else f"mesh {dict(self.mesh.shape)}"

    def _scan(
        self, body: Body, init: Any, xs: Any, state: Any, layers: int, batch: int, mesh: Any
    ) -> tuple[Any, None, Any]:
        """The schedule, on `mesh` (its axes Auto; None: one stage, no constraints)."""
        S, M, R = self.stages, self.microbatches, self.repeats
        per_stage = layers // (S * R)

        def by_stage(a: jax.Array) -> jax.Array:  # [L, ...] -> [R, S, L / (S R), ...]
            a = a.reshape(R, S, per_stage, *a.shape[1:])
            return _constrain(mesh, self.axis, a, 1)

        def by_stages(a: jax.Array) -> jax.Array:  # [S, ...], one entry per stage
            return _constrain(mesh, self.axis, a, 0)

        # the layers' arrays, constant and changing; modules are rebuilt per layer
        x_leaves, x_tree = jax.tree.flatten(xs)
        s_leaves, s_tree = jax.tree.flatten(state)
        weights = [by_stage(leaf) for leaf in x_leaves]
        inputs = jax.tree.map(lambda a: a.reshape(M, batch // M, *a.shape[1:]), init)
        # the activations in flight, one per stage; the first microbatch to start with, so
        # that a stage idle in the bubble computes on real numbers (no NaN from zeros)
        flight = jax.tree.map(lambda a: by_stages(jnp.stack([a[0]] * S)), inputs)

        def layer(carry: Any, both: tuple[list, list]) -> tuple[Any, list]:
            carry, ys, new = body(
                carry, jax.tree.unflatten(x_tree, both[0]), jax.tree.unflatten(s_tree, both[1])
            )
            if ys is not None:
                raise ValueError(
                    "a pipelined layer stack's function returns (carry, None): per-layer "
                    f"outputs are not gathered across stages, got {jax.tree.structure(ys)}"
                )
            return carry, jax.tree.leaves(new)

        def stage(weights: list, kept: list, repeat: jax.Array, valid: jax.Array, x: Any):
            """One stage's step: its layer group of this repeat on `x`; its state kept
            where it idles (a bubble)."""
            mine = [w[repeat] for w in weights]
            carry, new = jax.lax.scan(layer, x, (mine, [k[repeat] for k in kept]))
            kept = [
                k.at[repeat].set(jnp.where(valid, n, k[repeat]))
                for k, n in zip(kept, new, strict=True)
            ]
            return carry, kept

        run = jax.vmap(stage, in_axes=(1, 1, 0, 0, 0), out_axes=(0, 1))

        def step(loop: tuple[Any, Any, list], t: jax.Array) -> tuple[tuple, None]:
            flight, io, kept = loop
            _, repeat, valid = self.passes(t)
            # stage 0 takes microbatch t % M: a new one, or one back from the last stage
            first = jax.tree.map(lambda a: a[t % M], io)
            shifted = jax.tree.map(lambda a: by_stages(jnp.roll(a, 1, 0)), flight)
            x = jax.tree.map(lambda s, a: s.at[0].set(a), shifted, first)
            out, kept = run(weights, kept, repeat, valid, x)
            out = jax.tree.map(by_stages, out)
            kept = [_constrain(mesh, self.axis, k, 1) for k in kept]
            done = t - (S - 1)  # the pass leaving the last stage now
            keep = (done >= 0) & (done < M * R)
            slot = jnp.clip(done, 0, M * R - 1) % M
            io = jax.tree.map(lambda a, o: jnp.where(keep, a.at[slot].set(o[S - 1]), a), io, out)
            return (out, io, kept), None

        kept = [by_stage(leaf) for leaf in s_leaves]
        loop = (flight, inputs, kept)
        (_, io, kept), _ = jax.lax.scan(step, loop, jnp.arange(self.steps()))
        carry = jax.tree.map(lambda a: a.reshape(batch, *a.shape[2:]), io)
        state = jax.tree.unflatten(s_tree, [k.reshape(layers, *k.shape[3:]) for k in kept])
        return carry, None, state


def _constrain(mesh: Any, axis: str, a: jax.Array, dim: int) -> jax.Array:
    """`a` with dimension `dim` over `axis`, the others left to the compiler (no `mesh`:
    `a` as it is)."""
    if mesh is None:
        return a
    spec: list[Any] = [P.UNCONSTRAINED] * a.ndim
    spec[dim] = axis
    return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(*spec)))


def _leading(leaf: Any) -> int:
    """The size of a leaf's leading axis; -1 for a scalar."""
    return int(leaf.shape[0]) if jnp.ndim(leaf) else -1


def _size(leading: int) -> str:
    return "a scalar" if leading < 0 else str(leading)


def _abstract(mesh: Any) -> Any:
    return mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh


def _shapes(tree: Any) -> str:
    """The shapes of a tree's first three arrays, for an error message."""
    shapes = [tuple(jnp.shape(leaf)) for leaf in jax.tree.leaves(tree)]
    return ", ".join(map(str, shapes[:3])) + (", ..." if len(shapes) > 3 else "")
