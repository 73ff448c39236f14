"""Split and merge: a call's arguments <-> a flat tuple of arrays, and noticing changes.

- `split`: the NNX graph nodes, linen variable dicts and plain pytrees of a
  call's arguments turned into arrays plus a static description, and the
  updates written back onto the caller's objects, all or nothing;
- `structure`: what a compiled program depends on besides arrays, and the
  per-call check that it is unchanged;
- `dict_watch`: the dict watchers (CPython 3.12+) that check uses.
"""
