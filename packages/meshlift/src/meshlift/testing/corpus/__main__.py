"""`python -m meshlift.testing.corpus`: every case on every backend, plan and mesh.

Prints one row per backend, plan and mesh: how many cases agree with the
reference (and of those, how many agree by raising what `nnx.jit` raises),
how many differ, and the time; then each difference. Exits 1 if any case
differs. `nox -s corpus` runs it.

    python -m meshlift.testing.corpus [--backend jit] [--case adamw] [--mesh explicit]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import sys
import time
import warnings
from collections import Counter

import jax
from jax.sharding import AxisType
from rich.console import Console
from rich.table import Table

import meshlift as ml
from meshlift.testing.corpus.objects import CASES
from meshlift.testing.corpus.runner import compare, reference

MESHES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
HELPERS = ("metadata", "get_sharding", "get_partition_spec")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshlift.testing.corpus", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--backend", action="append", help="a backend (repeatable); default: every installed one"
    )
    parser.add_argument("--case", default="", help="only the cases whose name contains this")
    parser.add_argument(
        "--mesh",
        choices=sorted(MESHES),
        action="append",
        help="auto or explicit (repeatable); default: both",
    )
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    console = Console()
    names = [name for name in CASES if args.case in name]
    backends = args.backend or [info.name for info in ml.backends()]
    table = Table(
        title=f"{len(names)} library objects against nnx.jit, on a 2x4 mesh",
        caption="raised: of those that agree, how many by raising what the reference raises",
    )
    for column in ("backend", "plan", "mesh", "agree", "raised", "differ", "time"):
        numbers = column in ("agree", "raised", "differ", "time")
        table.add_column(column, justify="right" if numbers else "left", no_wrap=True)
    differences: list[str] = []
    kinds: Counter[str] = Counter()
    for backend in backends:
        per_shard = "manual-collectives" in ml.get_backend(backend).capabilities
        for plan in ("replicated",) if per_shard else HELPERS:
            for mesh_name in args.mesh or sorted(MESHES):
                axis_type = MESHES[mesh_name]
                mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
                start, agree, raised, differ = time.perf_counter(), 0, 0, 0
                for name in names:
                    try:
                        problems = compare(name, backend, mesh, plan)
                    except Exception as error:  # the lifted run raised where the reference ran
                        problems = [f"raised {type(error).__name__}: {error}"]
                    if problems:
                        differ += 1
                        differences.append(
                            f"{name} ({backend}, {plan}, {mesh_name}): {problems[0]}"
                        )
                    else:
                        agree += 1
                        kinds[CASES[name].kind] += 1
                        raised += isinstance(reference(name, mesh, plan == "replicated"), Exception)
                seconds = time.perf_counter() - start
                table.add_row(
                    backend,
                    plan,
                    mesh_name,
                    str(agree),
                    str(raised),
                    str(differ),
                    f"{seconds:.0f} s",
                )
                console.print(
                    f"{backend} {plan} {mesh_name}: {agree} agree, {differ} differ", highlight=False
                )
                sys.stdout.flush()  # a line per run as it ends, also when piped
    console.print(table)
    console.print(
        "cases that agree, by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    )
    for line in differences:
        console.print(f"[red]differs[/red] {line}", highlight=False)
    return 1 if differences else 0


if __name__ == "__main__":
    raise SystemExit(main())
