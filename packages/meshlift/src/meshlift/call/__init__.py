"""The call path: a function lifted over stateful arguments, staged by a backend.

A first call reads down this list: `lift` (`Lifted.__call__`) finds the
`options` and `arguments` it was made with, looks up its entry (`caches`),
and on a miss builds the arguments' `layout` (specs resolved by
`meshlift.plans.resolve`) and the `pure` function a backend stages; `calls`
runs it, recovers from what JAX refuses (`staged_errors`), and writes back;
`call_plans` keeps what the next call like it reuses. `static_changes`
notices static values a trace changes in place; `stages` wraps JAX's
`Traced`/`Lowered`/`Compiled`; `methods` lifts bound methods; `transform`
is `ml.transform`.
"""
