"""Plugin loading through real entry points, and the backend registry.

Each test installs fake distributions (a ``*.dist-info`` folder plus a plugin
module) into a temporary folder on ``sys.path``. Entry points that are really
installed (``meshlift-jit``...) are disabled, so these tests do not depend on
them.
"""

import importlib
import os
import sys
import textwrap
from importlib.metadata import entry_points

import jax
import jax.numpy as jnp
import pytest

import meshlift as ml
from meshlift import plugins

GOOD = """
    import jax
    import meshlift as ml

    @ml.hookimpl
    def meshlift_register_backends(register):
        register(ml.Backend(name="{name}", stage=lambda fn, spec: jax.jit(fn),
                            capabilities={{"donation", "stages"}}, description="A test backend."))
"""


OTHER = """
        register(ml.Backend(name="{name}-other", stage=lambda fn, spec: jax.jit(fn)))
"""


@pytest.fixture
def install(tmp_path, monkeypatch):
    """Install a fake distribution: ``install(dist, version, {ep_name: module_source})``.

    Each goes into its own folder on ``sys.path``, after the earlier ones and
    before the real site-packages: plugins load in install order, and a fake
    ``meshlift-jit`` hides the real one.
    """
    real = [ep.name for ep in entry_points(group="meshlift")]
    monkeypatch.setenv(plugins.DISABLE_ENV, ",".join(real))
    monkeypatch.delenv(plugins.STRICT_ENV, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    sites = []
    modules = []

    def install(dist, version, plugin_sources):
        site = tmp_path / f"site{len(sites)}"
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = [f"{name} = {name}_plugin" for name in plugin_sources]
        (info / "entry_points.txt").write_text("[meshlift]\n" + "\n".join(lines) + "\n")
        for name, source in plugin_sources.items():
            (site / f"{name}_plugin.py").write_text(textwrap.dedent(source))
            modules.append(f"{name}_plugin")
        sys.path.insert(len(sites), str(site))
        sites.append(site)
        importlib.invalidate_caches()

    plugins.reset_registry()
    yield install
    plugins.reset_registry()
    for module in modules:
        sys.modules.pop(module, None)


def names():
    return [b.name for b in ml.backends()]


FIRST_PARTY = """
    import jax
    import meshlift as ml

    def frontend(fun=None, /, *args, **kwargs):
        return ("{name} front end of {dist}", fun, args, kwargs)

    BACKEND = ml.Backend(name="{name}", stage=lambda fn, spec: jax.jit(fn), frontend=frontend)

    @ml.hookimpl
    def meshlift_register_backends(register):
        register(BACKEND)
"""

IMPOSTOR = """
    import jax
    import meshlift as ml

    @ml.hookimpl
    def meshlift_register_backends(register):
        register(ml.Backend(name="extra", stage=lambda fn, spec: jax.jit(fn)))
        register(ml.Backend(name="{name}", stage=lambda fn, spec: jax.jit(fn),
                            frontend=lambda *args, **kwargs: "impostor", distribution="{dist}"))
"""


def first_party(install, monkeypatch, name, source=FIRST_PARTY):
    """Stand in for the first-party distribution of ``name``; ``source=None``: not installed.

    The fake distribution hides the real one, and the name is taken off the
    disabled list the ``install`` fixture starts with.
    """
    dist = plugins.first_party_backends()[name]
    install(dist, "0.1.0", {} if source is None else {name: source.format(name=name, dist=dist)})
    disabled = os.environ[plugins.DISABLE_ENV].split(",")
    monkeypatch.setenv(plugins.DISABLE_ENV, ",".join(n for n in disabled if n != name))


def test_front_end_names_belong_to_the_distributions_the_core_extras_install():
    assert plugins.first_party_backends() == {
        "jit": "meshlift-jit",
        "shard_map": "meshlift-shard-map",
        "pjit": "meshlift-pjit",
        "pipeline": "meshlift-pipeline",
    }
    assert tuple(plugins.first_party_backends()) == plugins.FRONT_ENDS


def test_good_plugin_registers_with_its_distribution(install):
    install("meshlift-good", "1.2.3", {"good": GOOD.format(name="good")})

    backend = ml.get_backend("good")
    assert (backend.distribution, backend.version) == ("meshlift-good", "1.2.3")
    assert backend.stage(lambda x: x * 2, ml.StageSpec(in_specs=(None,), out_specs=None))(
        jnp.arange(3)
    ).tolist() == [0, 2, 4]
    [info] = ml.backends()
    assert info == plugins.BackendInfo(
        name="good",
        distribution="meshlift-good",
        version="1.2.3",
        capabilities=("donation", "stages"),
        description="A test backend.",
    )
    assert ml.backends().errors == ()


def test_version_set_by_the_backend_is_kept(install):
    source = """
        import jax
        import meshlift as ml

        @ml.hookimpl
        def meshlift_register_backends(register):
            register(ml.Backend(name="pinned", stage=lambda fn, spec: jax.jit(fn),
                                version="9.9", distribution="other"))
    """
    install("meshlift-pinned", "1.0", {"pinned": source})

    backend = ml.get_backend("pinned")
    assert (backend.distribution, backend.version) == ("other", "9.9")


def test_broken_plugin_is_recorded_and_others_still_load(install):
    install("meshlift-good", "1.0", {"good": GOOD.format(name="good")})
    install("meshlift-broken", "0.3", {"broken": "import meshlift_no_such_module\n"})

    assert names() == ["good"]
    [error] = ml.backends().errors
    assert error == plugins.LoadError(
        plugin="broken",
        distribution="meshlift-broken",
        version="0.3",
        error="ModuleNotFoundError: No module named 'meshlift_no_such_module'",
    )
    assert "broken (meshlift-broken 0.3): ModuleNotFoundError" in str(ml.backends())


def test_plugin_whose_hook_raises_registers_nothing(install):
    source = """
        import meshlift as ml

        @ml.hookimpl
        def meshlift_register_backends(register):
            register(ml.Backend(name="half", stage=lambda fn, spec: fn))
            raise RuntimeError("no devices")
    """
    install("meshlift-raises", "1.0", {"raises": source})
    install("meshlift-good", "1.0", {"good": GOOD.format(name="good")})

    assert names() == ["good"]
    [error] = ml.backends().errors
    assert (error.plugin, error.error) == ("raises", "RuntimeError: no devices")
    assert not plugins.plugin_manager().has_plugin("raises")


HOOK_MISTAKES = {
    "misspelled": (
        """
        import meshlift as ml

        @ml.hookimpl
        def meshlift_register_backend(register):
            register(ml.Backend(name="lost", stage=lambda fn, spec: fn))
        """,
        "PluginValidationError: The plugin defines meshlift_register_backend() at {file}:4, which is not "
        "a meshlift hook; did you mean meshlift_register_backends? meshlift's hooks: "
        "meshlift_register_backends (meshlift.hookspecs).",
    ),
    "unmarked": (
        """
        import meshlift as ml

        def meshlift_register_backends(register):
            register(ml.Backend(name="lost", stage=lambda fn, spec: fn))
        """,
        "PluginValidationError: The plugin defines meshlift_register_backends() at {file}:4 but does not "
        "mark it @meshlift.hookimpl, so meshlift would never call it. Decorate it: @ml.hookimpl",
    ),
    "marked_other": (
        """
        import meshlift as ml

        @ml.hookimpl
        def register_backends(register):
            register(ml.Backend(name="lost", stage=lambda fn, spec: fn))
        """,
        "PluginValidationError: The plugin defines register_backends() at {file}:4, which is not a "
        "meshlift hook; did you mean meshlift_register_backends? meshlift's hooks: "
        "meshlift_register_backends (meshlift.hookspecs).",
    ),
    "empty": (
        "BACKENDS = []\n",
        "PluginValidationError: The plugin implements no meshlift hook, so it adds nothing. Define "
        "`@ml.hookimpl def meshlift_register_backends(register): ...` in it "
        "(meshlift.hookspecs lists the hooks: meshlift_register_backends).",
    ),
}


@pytest.mark.parametrize("mistake", sorted(HOOK_MISTAKES))
def test_a_hook_meshlift_would_not_call_is_a_load_error_naming_it(install, mistake, tmp_path):
    source, message = HOOK_MISTAKES[mistake]
    install("meshlift-typo", "1.0", {"typo": source})
    install("meshlift-good", "1.0", {"good": GOOD.format(name="good")})

    assert names() == ["good"]  # the others still load
    [error] = ml.backends().errors
    assert (error.plugin, error.distribution) == ("typo", "meshlift-typo")
    assert error.error == message.format(file=tmp_path / "site0" / "typo_plugin.py")
    assert not plugins.plugin_manager().has_plugin("typo")


def test_a_hook_with_a_parameter_the_spec_lacks_names_the_plugin_and_the_definition(install):
    source = """
        import meshlift as ml

        @ml.hookimpl
        def meshlift_register_backends(registry):
            pass
    """
    install("meshlift-args", "1.0", {"args": source})

    [error] = ml.backends().errors
    assert error.error.startswith(
        "PluginValidationError: Plugin 'args' for hook 'meshlift_register_backends'\n"
        "hookimpl definition: meshlift_register_backends(registry)\n"
        "Argument(s) {'registry'} are declared in the hookimpl but can not be found in the hookspec"
    )


def test_two_distributions_with_one_entry_point_name_are_named_both(install):
    install("meshlift-first", "1.0", {"same": GOOD.format(name="first")})
    install("meshlift-second", "2.0", {"same": GOOD.format(name="second")})

    assert names() == ["first"]
    [error] = ml.backends().errors
    assert (error.plugin, error.distribution) == ("same", "meshlift-second")
    assert error.error == (
        "PluginError: Two plugins are named 'same': one from meshlift-first 1.0, one from "
        "meshlift-second 2.0. meshlift loads one plugin per name: uninstall one, or rename "
        "its entry point."
    )


def test_registering_a_non_backend_is_recorded(install):
    source = """
        import meshlift as ml

        @ml.hookimpl
        def meshlift_register_backends(register):
            register("jit")
    """
    install("meshlift-wrong", "1.0", {"wrong": source})

    [error] = ml.backends().errors
    assert error.error.startswith("PluginError: register() takes a meshlift.Backend, got str")


def test_strict_mode_reraises_the_first_error(install, monkeypatch):
    install("meshlift-broken", "0.3", {"broken": "import meshlift_no_such_module\n"})
    monkeypatch.setenv(plugins.STRICT_ENV, "1")

    with pytest.raises(ModuleNotFoundError, match="meshlift_no_such_module") as info:
        ml.backends()
    assert "meshlift plugin 'broken' (meshlift-broken 0.3)" in info.value.__notes__[0]


def test_disable_by_entry_point_name_skips_the_import(install, monkeypatch):
    install("meshlift-broken", "0.3", {"broken": "import meshlift_no_such_module\n"})
    install("meshlift-good", "1.0", {"good": GOOD.format(name="good")})
    monkeypatch.setenv(plugins.DISABLE_ENV, os.environ[plugins.DISABLE_ENV] + ",broken")

    assert names() == ["good"]
    assert ml.backends().errors == ()
    assert "broken_plugin" not in sys.modules


def test_disable_by_backend_name(install, monkeypatch):
    source = """
        import jax
        import meshlift as ml

        @ml.hookimpl
        def meshlift_register_backends(register):
            register(ml.Backend(name="one", stage=lambda fn, spec: jax.jit(fn)))
            register(ml.Backend(name="two", stage=lambda fn, spec: jax.jit(fn)))
    """
    install("meshlift-two", "1.0", {"two": source})
    monkeypatch.setenv(plugins.DISABLE_ENV, os.environ[plugins.DISABLE_ENV] + ",one")

    assert names() == ["two"]
    with pytest.raises(
        plugins.BackendNotFoundError, match="remove 'one' from MESHLIFT_DISABLE_PLUGINS"
    ):
        ml.get_backend("one")


def test_one_plugin_registering_a_name_twice_registers_nothing(install):
    twice = GOOD.format(name="same") + "        register(ml.Backend(name='same', stage=jax.jit))\n"
    install("meshlift-twice", "1.0", {"twice": twice})

    assert names() == []
    [error] = ml.backends().errors
    assert error.plugin == "twice"
    assert error.error.startswith("PluginError: Two backends are named 'same': one from ")


def test_unknown_name_lists_installed_and_invents_no_package(install):
    install("meshlift-good", "1.2.3", {"good": GOOD.format(name="good")})
    install("meshlift-broken", "0.3", {"broken": "import meshlift_no_such_module\n"})

    with pytest.raises(LookupError) as info:
        ml.get_backend("not_published")
    assert isinstance(info.value, plugins.BackendNotFoundError)
    first, *listing = str(info.value).splitlines()
    assert first == (
        "No meshlift backend named 'not_published'. No installed plugin provides it, and 1 "
        "failed to load (below): it may be one of them."
    )
    assert "pip install" not in str(info.value)
    assert "  good (meshlift-good 1.2.3) [donation, stages] A test backend." in listing
    assert any("broken (meshlift-broken 0.3): ModuleNotFoundError" in line for line in listing)


def test_a_name_whose_plugin_failed_to_load_shows_the_error_first(install):
    install("meshlift-broken", "0.3", {"broken": "import meshlift_no_such_module\n"})

    with pytest.raises(plugins.BackendNotFoundError) as info:
        ml.transform("broken", lambda x: x)
    assert str(info.value).splitlines()[0] == (
        "No meshlift backend named 'broken'. Its plugin 'broken' (meshlift-broken 0.3) failed "
        "to load: ModuleNotFoundError: No module named 'meshlift_no_such_module'"
    )


@pytest.mark.parametrize("typo", ["shardmap", "shard-map", "Shard_Map", "shard_mapp"])
def test_close_name_suggests_the_installed_one(install, monkeypatch, typo):
    first_party(install, monkeypatch, "shard_map")
    install("meshlift-good", "1.0", {"good": GOOD.format(name="good")})

    with pytest.raises(plugins.BackendNotFoundError) as info:
        ml.get_backend(typo)
    first = str(info.value).splitlines()[0]
    assert first == f"No meshlift backend named {typo!r}; did you mean 'shard_map'?"
    assert "pip install" not in str(info.value)
    with pytest.raises(plugins.BackendNotFoundError, match=r"did you mean 'shard_map'\?"):
        ml.transform(typo, lambda x: x)


def test_missing_first_party_name_says_which_distribution_to_install(install, monkeypatch):
    first_party(install, monkeypatch, "pjit", source=None)  # not installed
    install("meshlift-good", "1.0", {"good": GOOD.format(name="good")})

    with pytest.raises(plugins.BackendNotFoundError) as info:
        ml.get_backend("pjit")
    first, *listing = str(info.value).splitlines()
    assert first == (
        "No meshlift backend named 'pjit'. It comes with meshlift-pjit: pip install meshlift-pjit "
        "(from the meshlift repository: pip install ./plugins/meshlift-pjit)."
    )
    assert listing[:2] == [
        "Installed backends:",
        "  good (meshlift-good 1.0) [donation, stages] A test backend.",
    ]


def test_backend_object_bypasses_the_registry(install):
    backend = ml.Backend(name="notebook", stage=lambda fn, spec: jax.jit(fn))

    assert ml.get_backend(backend) is backend
    assert "notebook" not in names()


def test_get_backend_rejects_other_types(install):
    with pytest.raises(TypeError, match=r"a name or a meshlift\.Backend, got int"):
        ml.get_backend(3)


def test_register_backend_programmatically(install):
    backend = ml.Backend(name="mine", stage=lambda fn, spec: jax.jit(fn))
    plugins.register_backend(backend)

    assert ml.get_backend("mine") is backend
    assert [(b.name, b.distribution) for b in ml.backends()] == [("mine", None)]
    with pytest.raises(plugins.PluginError, match="Two backends are named 'mine'"):
        plugins.register_backend(backend)


def test_register_plugin_object(install):
    class Plugin:
        @ml.hookimpl
        def meshlift_register_backends(self, register):
            register(ml.Backend(name="from-object", stage=lambda fn, spec: jax.jit(fn)))

    plugin = Plugin()
    plugins.register_plugin(plugin, name="object-plugin")

    assert names() == ["from-object"]
    assert plugins.plugin_manager().get_plugin("object-plugin") is plugin


def test_registry_is_loaded_once_until_reset(install):
    install("meshlift-good", "1.0", {"good": GOOD.format(name="good")})
    assert names() == ["good"]
    install("meshlift-late", "1.0", {"late": GOOD.format(name="late")})

    assert names() == ["good"]
    plugins.reset_registry()
    assert sorted(names()) == ["good", "late"]


EXITS_AT_IMPORT = "import sys\nsys.exit(3)\n"

EXITS_IN_HOOK = """
    import sys
    import jax
    import meshlift as ml

    @ml.hookimpl
    def meshlift_register_backends(register):
        register(ml.Backend(name="half", stage=lambda fn, spec: jax.jit(fn)))
        sys.exit(3)
"""


@pytest.mark.parametrize("source", [EXITS_AT_IMPORT, EXITS_IN_HOOK], ids=["import", "hook"])
def test_plugin_that_exits_is_recorded_and_others_still_load(install, source):
    install("meshlift-exits", "0.1", {"exits": source})
    install("meshlift-good", "1.0", {"good": GOOD.format(name="good")})

    assert names() == ["good"]
    [error] = ml.backends().errors
    assert error == plugins.LoadError(
        plugin="exits", distribution="meshlift-exits", version="0.1", error="SystemExit: 3"
    )
    assert not plugins.plugin_manager().has_plugin("exits")


def test_error_without_a_message_is_recorded_by_its_type(install):
    install("meshlift-exits", "0.1", {"exits": "raise SystemExit\n"})

    [error] = ml.backends().errors
    assert error.error == "SystemExit"


def test_cli_survives_a_plugin_that_exits(install, capsys):
    from meshlift.tools.cli import main

    install("meshlift-exits", "0.1", {"exits": EXITS_AT_IMPORT})
    install("meshlift-good", "1.0", {"good": GOOD.format(name="good")})

    assert main(["backends", "--check"]) == 1
    out = capsys.readouterr().out
    assert "good" in out
    assert "exits (meshlift-exits 0.1): SystemExit: 3" in out


def test_keyboard_interrupt_in_a_plugin_is_not_swallowed(install):
    install("meshlift-interrupted", "0.1", {"interrupted": "raise KeyboardInterrupt\n"})

    with pytest.raises(KeyboardInterrupt):
        ml.backends()


def test_strict_mode_reraises_system_exit(install, monkeypatch):
    install("meshlift-exits", "0.1", {"exits": EXITS_AT_IMPORT})
    monkeypatch.setenv(plugins.STRICT_ENV, "1")

    with pytest.raises(SystemExit) as info:
        ml.backends()
    assert info.value.code == 3
    assert "meshlift plugin 'exits' (meshlift-exits 0.1)" in info.value.__notes__[0]


IMPOSTOR_ERROR = (
    "PluginError: The backend name 'jit' belongs to meshlift-jit (ml.jit runs it), so "
    "meshlift-impostor 6.6 cannot take it. Rename the backend in meshlift-impostor, or disable "
    "the plugin with MESHLIFT_DISABLE_PLUGINS=impostor."
)


@pytest.mark.parametrize("impostor_first", [True, False], ids=["impostor-first", "impostor-last"])
def test_third_party_cannot_take_a_first_party_name(install, monkeypatch, impostor_first):
    impostor = {"impostor": IMPOSTOR.format(name="jit", dist="meshlift-jit")}
    if impostor_first:
        install("meshlift-impostor", "6.6", impostor)
    first_party(install, monkeypatch, "jit")
    if not impostor_first:
        install("meshlift-impostor", "6.6", impostor)
    install("meshlift-good", "1.0", {"good": GOOD.format(name="good")})
    order = [ep.name for ep in entry_points(group="meshlift")]
    assert (order.index("impostor") < order.index("jit")) == impostor_first

    assert sorted(names()) == ["good", "jit"]  # the impostor's "extra" is not added either
    backend = ml.get_backend("jit")
    assert (backend.distribution, backend.version) == ("meshlift-jit", "0.1.0")
    assert backend.frontend is sys.modules["jit_plugin"].frontend
    f = lambda x: x  # noqa: E731
    assert ml.jit(f, donate_argnums=0) == (
        "jit front end of meshlift-jit",
        f,
        (),
        {"donate_argnums": 0},
    )
    [error] = ml.backends().errors
    assert (error.plugin, error.distribution, error.error) == (
        "impostor",
        "meshlift-impostor",
        IMPOSTOR_ERROR,
    )


def test_disabling_the_impostor_clears_its_error(install, monkeypatch):
    install("meshlift-impostor", "6.6", {"impostor": IMPOSTOR.format(name="jit", dist="x")})
    first_party(install, monkeypatch, "jit")
    monkeypatch.setenv(plugins.DISABLE_ENV, os.environ[plugins.DISABLE_ENV] + ",impostor")

    assert names() == ["jit"]
    assert ml.backends().errors == ()
    assert ml.jit(None)[0] == "jit front end of meshlift-jit"


def test_first_party_name_stays_free_when_its_distribution_is_missing(install, monkeypatch):
    first_party(install, monkeypatch, "jit", source=None)  # not installed
    install("meshlift-impostor", "6.6", {"impostor": IMPOSTOR.format(name="jit", dist="x")})

    assert names() == []
    [error] = ml.backends().errors
    assert error.error == IMPOSTOR_ERROR
    with pytest.raises(plugins.BackendNotFoundError, match="It comes with meshlift-jit: pip"):
        ml.get_backend("jit")
    with pytest.raises(plugins.BackendNotFoundError) as info:
        ml.jit(lambda x: x)
    assert f"impostor (meshlift-impostor 6.6): {IMPOSTOR_ERROR}" in str(info.value)


def test_first_party_name_cannot_be_registered_in_process(install, monkeypatch):
    first_party(install, monkeypatch, "shard_map", source=None)
    mine = ml.Backend(name="shard_map", stage=lambda fn, spec: jax.jit(fn))

    with pytest.raises(plugins.PluginError) as info:
        plugins.register_backend(mine)
    assert str(info.value) == (
        "The backend name 'shard_map' belongs to meshlift-shard-map (ml.shard_map runs it), so a "
        "backend registered in this process cannot take it. Rename the backend, or pass the "
        "Backend object itself where a name is accepted."
    )
    assert names() == []
    own = ml.Backend(name="shard_map", stage=mine.stage, distribution="meshlift_shard.map")
    plugins.register_backend(own)  # the distribution's own backend, registered by hand
    assert ml.get_backend("shard_map") is own


@pytest.mark.parametrize("order", ["first-installed-first", "second-installed-first"])
def test_clash_between_third_parties_uses_neither_whatever_the_order(install, order):
    claims = [("meshlift-first", "1.0", "first"), ("meshlift-second", "2.0", "second")]
    for dist, version, plugin in claims if order == "first-installed-first" else claims[::-1]:
        install(
            dist,
            version,
            {plugin: GOOD.format(name="same") + OTHER.format(name=plugin).lstrip("\n")},
        )
    install("meshlift-good", "1.0", {"good": GOOD.format(name="good")})

    message = (
        "The backend name 'same' is registered by meshlift-first 1.0 (plugin 'first') and by "
        "meshlift-second 2.0 (plugin 'second'), so meshlift uses none of them rather than pick "
        "one by install order. Uninstall one, or disable one: MESHLIFT_DISABLE_PLUGINS=second."
    )
    assert sorted(names()) == ["first-other", "good", "second-other"]
    assert ml.backends().errors == (
        plugins.LoadError("first", "meshlift-first", "1.0", f"PluginError: {message}"),
        plugins.LoadError("second", "meshlift-second", "2.0", f"PluginError: {message}"),
    )
    with pytest.raises(plugins.PluginError) as info:
        ml.get_backend("same")
    assert str(info.value) == message


def test_disabling_one_side_of_a_clash_gives_the_name_to_the_other(install, monkeypatch):
    install("meshlift-first", "1.0", {"first": GOOD.format(name="same")})
    install("meshlift-second", "2.0", {"second": GOOD.format(name="same")})
    monkeypatch.setenv(plugins.DISABLE_ENV, os.environ[plugins.DISABLE_ENV] + ",second")
    plugins.reset_registry()

    assert ml.get_backend("same").distribution == "meshlift-first"
    assert ml.backends().errors == ()


def test_front_ends_reach_their_own_distributions_backend(install, monkeypatch):
    for name in plugins.FRONT_ENDS:
        first_party(install, monkeypatch, name)
    f = lambda x: x  # noqa: E731

    assert ml.jit(f, mesh=None) == ("jit front end of meshlift-jit", f, (), {"mesh": None})
    assert ml.jit() == ("jit front end of meshlift-jit", None, (), {})
    assert ml.shard_map(f, out_specs=None) == (
        "shard_map front end of meshlift-shard-map",
        f,
        (),
        {"out_specs": None},
    )
    assert ml.pjit(f, 1, 2) == ("pjit front end of meshlift-pjit", f, (1, 2), {})
    assert ml.pipeline(f, microbatches=4) == (
        "pipeline front end of meshlift-pipeline",
        f,
        (),
        {"microbatches": 4},
    )


@pytest.mark.parametrize("name", ["jit", "shard_map", "pjit", "pipeline"])
def test_front_end_without_its_distribution_says_what_to_install(install, monkeypatch, name):
    first_party(install, monkeypatch, name, source=None)
    install("meshlift-good", "1.0", {"good": GOOD.format(name="good")})
    dist = plugins.first_party_backends()[name]

    with pytest.raises(plugins.BackendNotFoundError) as info:
        getattr(ml, name)(lambda x: x)
    first, *listing = str(info.value).splitlines()
    assert first == (
        f"ml.{name} needs the {name!r} backend, which is missing. It comes with {dist}: "
        f"pip install {dist} (from the meshlift repository: pip install ./plugins/{dist})."
    )
    assert listing == [
        "Installed backends:",
        "  good (meshlift-good 1.0) [donation, stages] A test backend.",
    ]


def test_front_end_whose_distribution_is_disabled(install):
    with pytest.raises(plugins.BackendNotFoundError) as info:
        ml.jit(lambda x: x)
    assert str(info.value).splitlines()[0] == (
        "ml.jit needs the 'jit' backend, which is missing. It comes with meshlift-jit, which is "
        "disabled: remove 'jit' from MESHLIFT_DISABLE_PLUGINS to use it."
    )


def test_front_end_whose_distribution_failed_to_load(install, monkeypatch):
    first_party(install, monkeypatch, "jit", source="raise ImportError('no jaxlib')\n")

    with pytest.raises(plugins.BackendNotFoundError) as info:
        ml.jit(lambda x: x)
    first, *listing = str(info.value).splitlines()
    assert first == (
        "ml.jit needs the 'jit' backend, which is missing. It comes with meshlift-jit, which "
        "failed to load (error below)."
    )
    assert "  jit (meshlift-jit 0.1.0): ImportError: no jaxlib" in listing


def test_front_end_of_a_backend_without_one(install, monkeypatch):
    source = FIRST_PARTY.replace(", frontend=frontend", "")
    first_party(install, monkeypatch, "pjit", source=source)

    with pytest.raises(plugins.PluginError) as info:
        ml.pjit(lambda x: x)
    assert str(info.value) == (
        "The 'pjit' backend (meshlift-pjit 0.1.0) has no front end, so ml.pjit cannot call it. "
        "Reinstall meshlift-pjit: pip install --force-reinstall meshlift-pjit"
    )


WITH_FRONT_END = """
    import jax
    import meshlift as ml

    def pmap(fun, axis_name=None):
        return ml.transform("toy-pmap", fun)

    @ml.hookimpl
    def meshlift_register_backends(register):
        register(ml.Backend(name="toy-pmap", stage=lambda fn, spec: jax.jit(fn), frontend=pmap))
"""


def test_a_third_party_front_end_is_reachable_by_its_backends_name(install):
    install("meshlift-toy-pmap", "1.0", {"toy": WITH_FRONT_END})
    install("meshlift-good", "1.0", {"good": GOOD.format(name="good")})

    front_end = ml.get_frontend("toy-pmap")
    assert front_end is sys.modules["toy_plugin"].pmap
    assert float(front_end(lambda x: x + 1)(jnp.zeros(()))) == 1.0
    with pytest.raises(plugins.PluginError) as info:
        ml.get_frontend("good")
    assert str(info.value) == (
        "The 'good' backend (meshlift-good 1.0) has no front end: call it as "
        "ml.transform('good', fun, mesh=..., in_specs=..., out_specs=...)."
    )
    with pytest.raises(plugins.BackendNotFoundError, match="did you mean 'toy-pmap'"):
        ml.get_frontend("toy_pmapp")
