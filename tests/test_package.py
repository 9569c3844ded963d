"""The package surface: exports, identity across levels, lazy resolution, light import."""

import subprocess
import sys
import typing

import pytest

import dattri_llm


def test_version_and_marker():
    from importlib.resources import files

    assert dattri_llm.__version__ == "0.1.0"
    assert files("dattri_llm").joinpath("py.typed").is_file()


def test_every_exported_name_resolves():
    for module_name in [
        "dattri_llm",
        "dattri_llm.gradient",
        "dattri_llm.gradient.hooks",
        "dattri_llm.gradient.callbacks",
        "dattri_llm.gradient.ops",
        "dattri_llm.attribution",
        "dattri_llm.attribution.algorithm",
        "dattri_llm.utils",
    ]:
        module = __import__(module_name, fromlist=["__all__"])
        for name in module.__all__:
            assert getattr(module, name) is not None or name == "HF_Conv1D", (module_name, name)


def test_reexports_are_the_same_objects():
    from dattri_llm import gradient
    from dattri_llm.gradient import hooks, ops

    assert dattri_llm.HookManager is hooks.HookManager is gradient.HookManager
    assert dattri_llm.REGISTER_ALL is gradient.REGISTER_ALL
    assert gradient.materialize is ops.materialize
    assert dattri_llm.TracInAttributor is dattri_llm.attribution.TracInAttributor
    assert dattri_llm.DiskGradientSource is dattri_llm.gradient.streaming.DiskGradientSource


def test_unknown_attribute_message():
    with pytest.raises(AttributeError, match="module 'dattri_llm' has no attribute 'Nope'"):
        dattri_llm.Nope  # noqa: B018


def test_dir_lists_lazy_names():
    assert {"TracInAttributor", "GradientStreamer", "HookManager"} <= set(dir(dattri_llm))


def test_import_is_light():
    code = (
        "import sys, dattri_llm\n"
        "heavy = [m for m in ('transformers', 'accelerate', 'dattri', 'trl') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "dattri_llm.AttributionTask\n"
        "assert 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_options_resolve_with_get_type_hints():
    from dattri_llm import options

    def f(x: options.CaptureStyle, y: options.RoutingMode) -> options.DotReduce: ...

    hints = typing.get_type_hints(f)
    assert typing.get_args(hints["x"]) == ("factorized", "materialized", "auto")


def test_gradient_streamer_lives_in_streaming():
    import importlib.util

    from dattri_llm.gradient import streaming

    assert streaming.GradientStreamer.__module__ == "dattri_llm.gradient.streaming"
    assert dattri_llm.GradientStreamer is streaming.GradientStreamer
    assert importlib.util.find_spec("dattri_llm.gradient._live") is None


def test_streaming_import_is_light():
    code = (
        "import sys, dattri_llm.gradient.streaming, dattri_llm.attribution\n"
        "heavy = [m for m in ('transformers', 'accelerate', 'dattri', 'trl') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
