"""Autograd-engine callbacks that run when a backward pass finishes."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["queue_after_backward_finalization", "queue_backward_end_callback"]


def queue_backward_end_callback(fn: Callable[[], None]) -> bool:
    """Queue ``fn`` to run when the current backward pass finishes.

    Must be called during a backward (e.g. from a tensor or module hook); ``fn``
    runs after every ``param.grad`` has been written (FSDP write-back included).

    Returns:
        ``True`` if queued; ``False`` (never raises) if the autograd engine exposes
        no callback queue or no backward is running.
    """
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue_callback = getattr(engine, "queue_callback", None)
    if queue_callback is None:
        return False
    try:
        queue_callback(fn)
    except RuntimeError:
        return False
    return True


def queue_after_backward_finalization(fn: Callable[[], None]) -> bool:
    """Queue ``fn`` to run after every callback queued during the current backward.

    Queues a callback that re-queues ``fn`` at the end of the engine's callback
    list, so ``fn`` runs after e.g. DDP's averaged-gradient write-back. If the
    re-queue fails, ``fn`` is called directly.

    Returns:
        Whether the first queue succeeded.
    """

    def requeue() -> None:
        if not queue_backward_end_callback(fn):
            fn()

    return queue_backward_end_callback(requeue)
