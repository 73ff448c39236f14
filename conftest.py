"""Tree mode runs the tests that read flax's graph-mode switch (`nox -s tests`).

flax's tree mode (`NNX_GRAPH_MODE=false`) changes one flag, and code behaves
otherwise under it only after reading that flag (`flax.configurations.Config._read`
of `nnx_graph_mode` or `nnx_graph_updates`; meshlift's own calls set graph mode
for their block and read nothing). A graph-mode run with
`--graph-mode-readers=record:DIR` writes down who read it: a test (its setup,
call or teardown), a fixture being set up (then every test using it), a module
being imported (then all its tests), or something outside all of these (then
every test). `--graph-mode-readers=only:DIR` runs just those tests: the others
run the same code either way. `nox -s tests-tree-mode` runs every test.

    pytest --graph-mode-readers=record:/tmp/readers packages/meshlift/tests
    NNX_GRAPH_MODE=false pytest --graph-mode-readers=only:/tmp/readers packages/meshlift/tests
"""

from __future__ import annotations

from pathlib import Path

import pytest

_FLAGS = ("nnx_graph_mode", "nnx_graph_updates")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--graph-mode-readers",
        metavar="record:DIR|only:DIR",
        help="record which tests read flax's graph-mode flag, or run only those",
    )


class Recorder:
    """Who reads the flag, while this process runs tests: one line per reader."""

    def __init__(self, folder: Path, worker: str) -> None:
        from flax.configurations import Config

        self.folder, self.worker, self.readers = folder, worker, set()
        self.test: str | None = None
        self.fixtures: list[str] = []
        self.module: str | None = None
        read = Config._read

        def recording_read(config: object, name: str) -> object:
            if name in _FLAGS:
                self.note()
            return read(config, name)

        Config._read = recording_read  # type: ignore[method-assign]

    def note(self) -> None:
        if self.fixtures:
            self.readers.add(f"fixture {self.fixtures[-1]}")
        if self.test is not None:
            self.readers.add(f"test {self.test}")
        elif self.module is not None:
            self.readers.add(f"module {self.module}")
        elif not self.fixtures:
            self.readers.add("all")

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector):
        self.module = collector.nodeid if isinstance(collector, pytest.Module) else None
        try:
            return (yield)
        finally:
            self.module = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        self.test = item.nodeid
        try:
            return (yield)
        finally:
            self.test = None

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
        self.fixtures.append(f"{fixturedef.baseid}::{fixturedef.argname}")
        try:
            return (yield)
        finally:
            self.fixtures.pop()

    def pytest_sessionfinish(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        text = "".join(f"{reader}\n" for reader in sorted(self.readers))
        (self.folder / f"{self.worker}.txt").write_text(text)


class Selector:
    """Deselect every test that no recorded reader covers."""

    def __init__(self, folder: Path) -> None:
        records = sorted(folder.glob("*.txt"))
        if not records:
            raise pytest.UsageError(
                f"--graph-mode-readers=only:{folder} found no record there: run the tests "
                f"with --graph-mode-readers=record:{folder} first"
            )
        lines = {line for path in records for line in path.read_text().splitlines()}
        self.everything = "all" in lines
        self.named = {
            kind: {line.split(" ", 1)[1] for line in lines if line.startswith(kind)}
            for kind in ("test", "fixture", "module")
        }

    def covers(self, item: pytest.Item) -> bool:
        if self.everything or item.nodeid in self.named["test"]:
            return True
        if item.nodeid.split("::", 1)[0] in self.named["module"]:
            return True
        fixtures = getattr(item, "_fixtureinfo", None)
        definitions = fixtures.name2fixturedefs.values() if fixtures is not None else ()
        used = {f"{d.baseid}::{d.argname}" for defs in definitions for d in defs}
        return not used.isdisjoint(self.named["fixture"])

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]):
        covered = [self.covers(item) for item in items]
        dropped = [item for item, keep in zip(items, covered, strict=True) if not keep]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item, keep in zip(items, covered, strict=True) if keep]


def pytest_configure(config: pytest.Config) -> None:
    option = config.getoption("--graph-mode-readers")
    if not option:
        return
    mode, _, folder = option.partition(":")
    if mode not in ("record", "only") or not folder:
        raise pytest.UsageError(f"--graph-mode-readers takes record:DIR or only:DIR, got {option}")
    if mode == "record":  # one record per process: pytest-xdist's worker, or "main"
        worker = getattr(config, "workerinput", {}).get("workerid", "main")
        plugin: object = Recorder(Path(folder), worker)
    else:
        plugin = Selector(Path(folder))
    config.pluginmanager.register(plugin, "graph-mode-readers")
