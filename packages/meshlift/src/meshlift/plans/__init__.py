"""Plans and metadata: which mesh axes split each array, said once and checked.

- `mesh`: making meshes, the call-site mesh;
- `specs`: every reason a `PartitionSpec` cannot shard an array on a mesh;
- `logical`: logical axis rules (`ml.axis_rules`, `ml.logical_to_mesh`);
- `annotation`, `metadata`, `abstract`: a parameter's sharding annotation
  (`ml.with_partitioning`, linen's `Partitioned`), read back as a plan;
- `sharding`: `StateSharding`, path filters;
- `resolve`: spec prefixes to one validated `Sharding` per array.
"""
