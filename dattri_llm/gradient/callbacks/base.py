"""Base class of the callbacks a :class:`~dattri_llm.gradient.hooks.manager.HookManager` drives.

Order of calls for one capture step: every ``on_layer_forward`` (forward
order), then every ``on_layer_backward`` (backward order), then one
``on_step_end``; callbacks are invoked in list order. ``on_context_end`` runs
when a ``collect()`` context exits. An optional duck-typed
``on_register(hook_manager)`` is called when the callback is attached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from dattri_llm.gradient.model.container import GradientRecord


class HookManagerCallback:
    """No-op base class: subclass it and override the hooks you need."""

    def on_layer_forward(
        self,
        layer_name: str,
        activation: torch.Tensor,
        layer_type: str,
        module_kwargs: dict | None,
    ) -> None:
        """Called in a hooked layer's forward hook, once per grad-enabled forward.

        ``activation`` is the layer input ``(B, *, D_in)`` on the capture
        device. Fires whenever the hooks are registered, also outside
        ``collect()``.
        """

    def on_layer_backward(
        self,
        layer_name: str,
        grad_output: torch.Tensor,
        layer_type: str,
        module_kwargs: dict | None,
    ) -> None:
        """Called in a hooked layer's backward hook with the output gradient ``(B, *, D_out)``."""

    def on_step_end(self, record: GradientRecord) -> None:
        """Called once per completed capture step with the full-batch record.

        Runs inside autograd with grad mode disabled, after the manager's
        per-step state was reset and its lock released: a secondary backward
        must use ``torch.enable_grad()`` and be bracketed with
        ``save_state()/clear_state()/load_state()``.
        """

    def on_context_end(self) -> None:
        """Called when a ``collect()`` context exits."""
