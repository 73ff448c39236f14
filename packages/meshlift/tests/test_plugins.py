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
                            capabilities={{"donate", "jit"}}, description="A test backend."))
"""


@pytest.fixture
def install(tmp_path, monkeypatch):
    """Install a fake distribution: ``install(dist, version, {ep_name: module_source})``."""
    real = [ep.name for ep in entry_points(group="meshlift")]
    monkeypatch.setenv(plugins.DISABLE_ENV, ",".join(real))
    monkeypatch.delenv(plugins.STRICT_ENV, raising=False)
    monkeypatch.syspath_prepend(tmp_path)
    modules = []

    def install(dist, version, plugin_sources):
        info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = [f"{name} = {name}_plugin" for name in plugin_sources]
        (info / "entry_points.txt").write_text("[meshlift]\n" + "\n".join(lines) + "\n")
        for name, source in plugin_sources.items():
            (tmp_path / f"{name}_plugin.py").write_text(textwrap.dedent(source))
            modules.append(f"{name}_plugin")
        importlib.invalidate_caches()

    plugins.reset_registry()
    yield install
    plugins.reset_registry()
    for module in modules:
        sys.modules.pop(module, None)


def names():
    return [b.name for b in ml.backends()]


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
        capabilities=("donate", "jit"),
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


def test_duplicate_backend_name_is_an_error_naming_both(install):
    install("meshlift-first", "1.0", {"first": GOOD.format(name="same")})
    install("meshlift-second", "2.0", {"second": GOOD.format(name="same")})

    assert names() == ["same"]
    [error] = ml.backends().errors
    assert "Two backends are named 'same'" in error.error
    assert "meshlift-first 1.0" in error.error
    assert "meshlift-second 2.0" in error.error


def test_unknown_name_lists_installed_and_what_to_install(install):
    install("meshlift-good", "1.2.3", {"good": GOOD.format(name="good")})
    install("meshlift-broken", "0.3", {"broken": "import meshlift_no_such_module\n"})

    with pytest.raises(LookupError) as info:
        ml.get_backend("not_published")
    assert isinstance(info.value, plugins.BackendNotFoundError)
    message = str(info.value)
    assert "No meshlift backend named 'not_published'" in message
    assert "pip install meshlift-not-published" in message
    assert "good (meshlift-good 1.2.3)" in message
    assert "broken (meshlift-broken 0.3): ModuleNotFoundError" in message


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
