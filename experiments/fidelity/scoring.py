"""What ``tsloo.py``, ``lds.py`` and ``stride_sweep.py`` share: one prepared run, one capture,
every method's score matrix with its seconds and peak memory.

* :func:`prepare`: the corpus splits, the pretrained start, the reference fine-tuning run
  (checked bit-identical on a second replay);
* :func:`capture_with_model`: the library captures of ``capture.py`` plus the final model's
  weights (STRIDE runs the model, not stored gradients);
* :func:`score_matrices`: every available registry entry scored once, timed (attribution
  seconds as B.2 charges them) and measured (peak resident memory), so that several
  metrics (TSLOO, LDS) are computed from the same matrices.

Peak memory: the rise of the process's peak resident set size (Linux ``VmHWM``) during the
scoring call over the resident size just before it. Before each call freed heap is
returned to the OS (glibc ``malloc_trim``) and the peak is reset through
``/proc/self/clear_refs``; elsewhere (no ``/proc``) it is ``None``. It counts everything
the call touches (stores read, model copies, temporaries), not torch allocations alone.
"""

from __future__ import annotations

import ctypes
import gc
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from capture import Captured, capture_all, capture_final_model
from methods import METHODS, unavailable
from setting import Data, Setting, finetuned_parameters, make_data, make_model, pretrain

MEMORY_NOTE = (
    "peak MiB: rise of the process's peak resident set size (Linux VmHWM, reset through "
    "/proc/self/clear_refs after glibc malloc_trim) during the scoring call over the resident "
    "size before it; it counts everything the call touches (stores read, model copies, "
    "temporaries)"
)


@dataclass
class Prepared:
    """The pretrained start, the data and the reference fine-tuning run of one setting."""

    setting: Setting
    data: Data
    start: dict[str, torch.Tensor]
    reference_model: torch.nn.Module
    reference: dict[str, torch.Tensor]
    bitwise: bool


def fresh_model(
    start: dict[str, torch.Tensor], setting: Setting, data: Data, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The pretrained model (weights ``start``) in ``dtype``, fine-tuned layers trainable."""
    model = make_model(setting, data.vocab_size)
    model.load_state_dict(start)
    model.to(dtype)
    finetuned_parameters(model, setting)
    return model


def prepare(setting: Setting) -> Prepared:
    """One torch thread, deterministic kernels; pretrain, then the reference run (twice)."""
    from setting import run_trajectory

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    data = make_data(setting)
    model = make_model(setting, data.vocab_size)
    pretrain(model, setting, data)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    reference_model = fresh_model(start, setting, data)
    run_trajectory(reference_model, setting, data)
    again = fresh_model(start, setting, data)
    run_trajectory(again, setting, data)
    bitwise = all(
        torch.equal(a, b) for a, b in zip(reference_model.parameters(), again.parameters())
    )
    reference = {k: v.detach().clone() for k, v in reference_model.named_parameters()}
    return Prepared(setting, data, start, reference_model, reference, bitwise)


def capture_with_model(prepared: Prepared, work: Path) -> Captured:
    """``capture.capture_all`` into ``work``, then the final model's weights beside the stores."""
    p = prepared
    captured = capture_all(
        lambda: fresh_model(p.start, p.setting, p.data), p.setting, p.data, work, p.reference
    )
    capture_final_model(p.reference_model, captured)
    return captured


# ---------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int | None:
    """``VmRSS`` / ``VmHWM`` of this process in KiB (``None`` without ``/proc``)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak() -> int | None:
    """Trim the heap, reset the peak RSS; return the resident KiB now (``None``: unsupported)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        return None
    return _status_kib("VmRSS")


def peak_mib(before_kib: int | None) -> float | None:
    """Rise of the peak RSS since :func:`reset_peak` returned ``before_kib``, in MiB."""
    after = _status_kib("VmHWM")
    if before_kib is None or after is None:
        return None
    return max(0, after - before_kib) / 1024


# ---------------------------------------------------------------------------- scoring
@dataclass
class Scored:
    """One method's ``(num_train, num_query)`` matrix ("helps" sign) and its costs."""

    name: str
    scores: torch.Tensor
    seconds: float
    peak_mib: float | None
    note: str


def score_matrices(captured: Captured, names: list[str] | None = None) -> list[Scored]:
    """Every available registry entry (or ``names``), scored once: matrix, seconds, peak MiB.

    Seconds add the captures a method is charged for (``Method.charged``) to its scoring
    time; the peak memory is of the scoring call alone.
    """
    results = []
    skipped = unavailable()
    for name, method in METHODS.items():
        if name in skipped or (names is not None and name not in names):
            continue
        before = reset_peak()
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scores = method.score(captured)
        seconds = time.perf_counter() - start
        peak = peak_mib(before)
        seconds += sum(captured.seconds[k] for k in method.charged)
        results.append(Scored(name, scores, seconds, peak, method.note))
        print(f"  scored {name:<26} {seconds:7.2f} s  peak {peak} MiB", flush=True)
    return results
