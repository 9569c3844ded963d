"""Exact signatures of the capture, callback, store and streaming API, transcribed from the spec.

Each ``_spec_*`` stub below is copied by hand from ``capture.md``,
``callbacks.md``, ``storage.md`` and ``streaming.md``; the test compares
parameter names, order, kinds and defaults (annotations are documentation and
may be wider in the code). Names the contract lists but this release does not
ship (``docs/API.md``, "Not in this release") are not checked here.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from dattri_llm.gradient import async_writer, datasets, storage_manager, streaming
from dattri_llm.gradient.callbacks import (
    base,
    capture_callback,
    kronecker_covariance_callback,
    offload_callback,
)
from dattri_llm.gradient.hooks import config, hooks, manager

# --------------------------------------------------------------------------- capture.md


def _spec_config_init(
    self,
    hook_types=None,
    linear_io=None,
    param_grad=None,
    invasive_linear_io=None,
    layer_types=None,
    module_kwargs=None,
    projection_kwargs=None,
    projector=None,
    capture_style="factorized",
    include_frozen=False,
): ...


def _spec_resolve_hook_assignments(root, config): ...


def _spec_default_hook_assignment(model, sample_input, loss_fn=None): ...


def _spec_manager_init(
    self,
    model,
    config=None,
    callbacks=None,
    sample_id_key=None,
    sample_hash_fields=None,
    non_batch_first_layers=None,
    offload_to_cpu=False,
    optimizer=None,
): ...


def _spec_collect(self, deregister_on_exit=False): ...
def _spec_self_only(self): ...
def _spec_add_callback(self, callback): ...
def _spec_load_state(self, state): ...
def _spec_reset_steps(self, to=0): ...


def _spec_register_linear_io_hooks(
    model,
    layer_names=None,
    on_layer_forward=None,
    on_layer_backward=None,
    type_overrides=None,
    kwargs_overrides=None,
    projection_kwargs=None,
    capture_style="factorized",
    projector=None,
    offload_to_cpu=False,
    preconditioner=None,
    include_frozen=False,
): ...


def _spec_register_param_grad_hooks(
    model, layer_names=None, on_param_grad=None, offload_to_cpu=False
): ...


def _spec_register_linear_param_hooks(model, layer_names=None, on_linear_param_grad=None): ...
def _spec_remove_hooks(handles): ...
def _spec_install_invasive_forward(model, layer_names, should_intervene): ...


# --------------------------------------------------------------------------- callbacks.md


def _spec_on_layer_forward(self, layer_name, activation, layer_type, module_kwargs): ...
def _spec_on_layer_backward(self, layer_name, grad_output, layer_type, module_kwargs): ...
def _spec_on_step_end(self, record): ...


def _spec_offload_init(
    self,
    offload_interval,
    file_manager,
    recording_type="per_batch",
    gradient_accumulation_steps=1,
    async_write=False,
    max_pending_writes=2,
): ...


def _spec_kronecker_callback_init(self, *, include_bias=True): ...


# --------------------------------------------------------------------------- storage.md


# extension: ``low_rank=None`` (issue 15: LoRIF's rank-c records), keyword-only, last.
def _spec_store_init(
    self, save_dir, *, residency="disk", budget_bytes=None, disk_format="memmap", low_rank=None
): ...
def _spec_save(self, record): ...
def _spec_save_bulk(self, records): ...
def _spec_declare_accumulation(self, n): ...
def _spec_by_inputs(self, inputs): ...
def _spec_by_hash(self, input_hash): ...
def _spec_load_sample(self, inputs, step, sample_idx): ...
def _spec_load_sample_by_hash(self, input_hash, step, sample_idx): ...
def _spec_iter_steps(self, steps): ...
def _spec_load_records(self, file_relpath): ...
def _spec_writer_init(self, file_manager, max_pending=2): ...
def _spec_submit(self, records): ...


# --------------------------------------------------------------------------- streaming.md


def _spec_disk_source_init(
    self, file_manager, args, *, steps=None, layer_name=None, desc=None, verbose=False
): ...


def _spec_for_steps(self, steps): ...


def _spec_streamer_init(
    self,
    model,
    dataset,
    args,
    *,
    batch_size,
    enable_update=False,
    loss_fn=None,
    optimizer=None,
    scheduler=None,
    config=None,
    collate_fn=None,
    checkpoint_step=0,
    hook_manager=None,
    precondition=False,
    snapshots=None,
    forward_model=None,
    shard=True,
    defer_update=False,
): ...


def _spec_rebatch_blocks(source, batch_size): ...
def _spec_autocast_for(args): ...
def _spec_move_batch(batch, device): ...
def _spec_resolve_steps(file_manager, steps): ...


_HM = manager.HookManager
_STORE = storage_manager.GradientStorageManager
_WRITER = async_writer.AsyncGradientWriter
_CB = base.HookManagerCallback

CASES: list[tuple[str, Any, Any]] = [
    # capture.md
    ("HookManagerConfig", config.HookManagerConfig.__init__, _spec_config_init),
    ("resolve_hook_assignments", config.resolve_hook_assignments, _spec_resolve_hook_assignments),
    ("default_hook_assignment", config.default_hook_assignment, _spec_default_hook_assignment),
    ("HookManager", _HM.__init__, _spec_manager_init),
    ("HookManager.collect", _HM.collect, _spec_collect),
    ("HookManager.register", _HM.register, _spec_self_only),
    ("HookManager.remove", _HM.remove, _spec_self_only),
    ("HookManager.get_gradient", _HM.get_gradient, _spec_self_only),
    ("HookManager.add_callback", _HM.add_callback, _spec_add_callback),
    ("HookManager.save_state", _HM.save_state, _spec_self_only),
    ("HookManager.clear_state", _HM.clear_state, _spec_self_only),
    ("HookManager.load_state", _HM.load_state, _spec_load_state),
    ("HookManager.reset_steps", _HM.reset_steps, _spec_reset_steps),
    ("register_linear_io_hooks", hooks.register_linear_io_hooks, _spec_register_linear_io_hooks),
    (
        "register_param_grad_hooks",
        hooks.register_param_grad_hooks,
        _spec_register_param_grad_hooks,
    ),
    (
        "register_linear_param_hooks",
        hooks.register_linear_param_hooks,
        _spec_register_linear_param_hooks,
    ),
    ("remove_hooks", hooks.remove_hooks, _spec_remove_hooks),
    ("install_invasive_forward", hooks.install_invasive_forward, _spec_install_invasive_forward),
    # callbacks.md
    ("HookManagerCallback.on_layer_forward", _CB.on_layer_forward, _spec_on_layer_forward),
    ("HookManagerCallback.on_layer_backward", _CB.on_layer_backward, _spec_on_layer_backward),
    ("HookManagerCallback.on_step_end", _CB.on_step_end, _spec_on_step_end),
    ("HookManagerCallback.on_context_end", _CB.on_context_end, _spec_self_only),
    ("CaptureCallback", capture_callback.CaptureCallback.__init__, _spec_self_only),
    ("OffloadCallback", offload_callback.OffloadCallback.__init__, _spec_offload_init),
    (
        "OffloadCallback.on_step_end",
        offload_callback.OffloadCallback.on_step_end,
        _spec_on_step_end,
    ),
    (
        "OffloadCallback.on_context_end",
        offload_callback.OffloadCallback.on_context_end,
        _spec_self_only,
    ),
    (
        "KroneckerCovarianceCallback",
        kronecker_covariance_callback.KroneckerCovarianceCallback.__init__,
        _spec_kronecker_callback_init,
    ),
    *[
        (
            f"KroneckerCovarianceCallback.{name}",
            getattr(kronecker_covariance_callback.KroneckerCovarianceCallback, name),
            _spec_self_only,
        )
        for name in ("all_reduce", "result", "reset")
    ],
    # storage.md
    ("GradientStorageManager", _STORE.__init__, _spec_store_init),
    ("GradientStorageManager.save", _STORE.save, _spec_save),
    ("GradientStorageManager.save_bulk", _STORE.save_bulk, _spec_save_bulk),
    (
        "GradientStorageManager.declare_gradient_accumulation_steps",
        _STORE.declare_gradient_accumulation_steps,
        _spec_declare_accumulation,
    ),
    ("GradientStorageManager.lookup", _STORE.lookup, _spec_by_inputs),
    ("GradientStorageManager.lookup_by_hash", _STORE.lookup_by_hash, _spec_by_hash),
    ("GradientStorageManager.load_sample", _STORE.load_sample, _spec_load_sample),
    (
        "GradientStorageManager.load_sample_by_hash",
        _STORE.load_sample_by_hash,
        _spec_load_sample_by_hash,
    ),
    ("GradientStorageManager.load_all", _STORE.load_all, _spec_by_inputs),
    ("GradientStorageManager.load_all_by_hash", _STORE.load_all_by_hash, _spec_by_hash),
    ("GradientStorageManager.available_steps", _STORE.available_steps, _spec_self_only),
    ("GradientStorageManager.iter_steps", _STORE.iter_steps, _spec_iter_steps),
    ("GradientStorageManager.load_records", _STORE.load_records, _spec_load_records),
    ("GradientStorageManager.close", _STORE.close, _spec_self_only),
    ("AsyncGradientWriter", _WRITER.__init__, _spec_writer_init),
    ("AsyncGradientWriter.submit", _WRITER.submit, _spec_submit),
    ("AsyncGradientWriter.flush", _WRITER.flush, _spec_self_only),
    ("AsyncGradientWriter.close", _WRITER.close, _spec_self_only),
    # streaming.md
    ("DiskGradientSource", streaming.DiskGradientSource.__init__, _spec_disk_source_init),
    ("DiskGradientSource.for_steps", streaming.DiskGradientSource.for_steps, _spec_for_steps),
    ("GradientStreamer", streaming.GradientStreamer.__init__, _spec_streamer_init),
    ("rebatch_blocks", streaming.rebatch_blocks, _spec_rebatch_blocks),
    ("autocast_for", streaming.autocast_for, _spec_autocast_for),
    ("move_batch", streaming.move_batch, _spec_move_batch),
]


def _shape(fn: Any) -> list[tuple[str, Any, Any]]:
    """``[(name, kind, default)]`` of ``fn``'s parameters, in order."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(("name", "actual", "spec"), CASES, ids=[c[0] for c in CASES])
def test_signature_matches_spec(name, actual, spec):
    assert _shape(actual) == _shape(spec), name


def test_resolve_steps_parameters():
    # storage/streaming prose names it ``datasets.resolve_steps(file_manager, steps)``.
    params = inspect.signature(datasets.resolve_steps).parameters
    assert list(params) == ["file_manager", "steps"]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values())


def test_shape_helper_sees_a_difference():
    def other(self, deregister_on_exit=True): ...

    assert _shape(other) != _shape(_spec_collect)


# --------------------------------------------------------------------------- properties


def _is_property(cls: type, name: str, settable: bool = False) -> bool:
    attr = inspect.getattr_static(cls, name, None)
    return isinstance(attr, property) and (attr.fset is not None) == settable


@pytest.mark.parametrize(
    ("cls", "names"),
    [
        (
            manager.HookManager,
            [
                "layer_names",
                "layer_name",
                "param_layer_names",
                "steps_collected",
                "sample_id_key",
                "sample_hash_fields",
                "supports_preconditioning",
            ],
        ),
        (offload_callback.OffloadCallback, ["staged"]),
        (
            storage_manager.GradientStorageManager,
            [
                "save_dir",
                "residency",
                "disk_format",
                "budget_bytes",
                "resident_bytes",
                "sample_id_key",
                "gradient_accumulation_steps",
                "index",
            ],
        ),
        (streaming.DiskGradientSource, ["args", "file_manager", "steps", "layer_name", "reusable"]),
        (
            streaming.GradientStreamer,
            [
                "args",
                "reusable",
                "model",
                "forward_model",
                "hook_manager",
                "optimizer",
                "learning_rates",
            ],
        ),
        (streaming.GradientSource, ["reusable"]),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_read_only_properties(cls, names):
    missing = [name for name in names if not _is_property(cls, name)]
    assert not missing, f"{cls.__name__}: not read-only properties: {missing}"


def test_precondition_is_a_settable_property():
    assert _is_property(manager.HookManager, "precondition", settable=True)


@pytest.mark.parametrize(
    "cls",
    [
        storage_manager.GradientStorageManager,
        async_writer.AsyncGradientWriter,
        streaming.GradientStreamer,
    ],
)
def test_context_managers(cls):
    assert callable(getattr(cls, "__enter__", None)) and callable(getattr(cls, "__exit__", None))


def test_sources_are_sized_iterables_and_source_protocol_is_runtime_checkable():
    for cls in (streaming.DiskGradientSource, streaming.GradientStreamer):
        assert callable(cls.__iter__) and callable(cls.__len__)
    assert getattr(streaming.GradientSource, "_is_runtime_protocol", False)


# --------------------------------------------------------------------------- constants


def test_hook_family_constants_and_sentinels():
    assert (config.LINEAR_IO, config.PARAM_GRAD, config.INVASIVE_LINEAR_IO) == (
        "linear_io",
        "param_grad",
        "invasive_linear_io",
    )
    assert repr(config.REGISTER_ALL) == "REGISTER_ALL"
    assert type(config.REGISTER_ALL)() is config.REGISTER_ALL
    assert hooks.LayerBuffer is dict and hooks.ParamGradBuffer is dict
    assert storage_manager.DISK_FORMATS == ("pickle", "memmap")
    assert offload_callback.RECORDING_TYPES == ("per_sample", "per_batch")


def test_callback_attributes():
    assert capture_callback.CaptureCallback().record is None
    for hook in ("on_layer_forward", "on_layer_backward", "on_step_end", "on_context_end"):
        assert callable(getattr(base.HookManagerCallback, hook))
