"""STRIDE fit files: plain tensors plus JSON, written atomically, read without running code.

A fit directory holds

* ``stride_fit.pt``: a dict of three tensors, ``basis`` ``(r, D)``,
  ``coefficients`` ``(K, r, O)`` and ``members`` ``(N, d)`` (the design),
  read with ``torch.load(..., weights_only=True)``: a file carrying pickled
  objects is refused before anything in it runs;
* ``stride_fit.json``: the format version, the config, the layer, the
  design's parameters and fingerprint, the training ids and their hash, and
  the loss history.

:func:`check_fit` refuses a fit for another training set or another design.

Format 2 records the training ids the gradient attributors give the samples
(the task objective's model inputs, ``StrideAttributor.sample_ids``); format 1
hashed every tensor field of a sample (its ``labels`` too), so its ids and
training hash mean something else, and :func:`load_fit` refuses it with a
message to fit again rather than let its rows silently miss other scores.
"""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dattri_llm.attribution.algorithm.stride.config import StrideConfig
from dattri_llm.attribution.algorithm.stride.design import SubsetDesign
from dattri_llm.attribution.algorithm.stride.fit import StrideFit, train_set_hash
from dattri_llm.attribution.algorithm.stride.operators import SteeringOperators
from dattri_llm.utils.atomic import atomic_torch_save, atomic_write

__all__ = ["FIT_FORMAT", "FIT_META_FILE", "FIT_TENSOR_FILE", "check_fit", "load_fit", "save_fit"]

FIT_TENSOR_FILE = "stride_fit.pt"
FIT_META_FILE = "stride_fit.json"
FIT_FORMAT = 2
_ID_CHANGE_FORMATS = {1: "hashed every tensor field of a sample, labels included"}
_TENSOR_KEYS = ("basis", "coefficients", "members")
_DESIGN_KEYS = ("num_examples", "num_subsets", "subsets_per_example", "seed")
_META_KEYS = (
    "format",
    "config",
    "layer",
    "design",
    "design_fingerprint",
    "train_hash",
    "train_ids",
    "history",
)


def save_fit(fit: StrideFit, path: str | Path) -> Path:
    """Write ``fit`` into the directory ``path`` (created if needed); return it.

    Each file goes through a temporary file, fsync and rename, so an
    interrupted save leaves the previous file whole.
    """
    out = Path(path).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        "basis": fit.operators.basis.detach().cpu().contiguous(),
        "coefficients": fit.operators.coefficients.detach().cpu().contiguous(),
        "members": fit.design.members.contiguous(),
    }
    history = [
        {key: (None if math.isnan(value) else value) for key, value in record.items()}
        for record in fit.history
    ]
    meta = {
        "format": FIT_FORMAT,
        "algorithm": "STRIDE",
        "config": fit.config.as_dict(),
        "layer": fit.layer,
        "design": fit.design.params(),
        "design_fingerprint": fit.design.fingerprint(),
        "train_hash": fit.train_hash,
        "train_ids": fit.train_ids,
        "history": history,
    }
    encoded = json.dumps(meta).encode("utf-8")
    atomic_torch_save(tensors, out / FIT_TENSOR_FILE)
    atomic_write(out / FIT_META_FILE, lambda handle: handle.write(encoded))
    return out


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensor file's dict, loaded with ``weights_only=True`` and checked."""
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise ValueError(
            f"{path} is not a plain-tensor STRIDE fit file (loading refuses pickled objects and "
            f"runs no code): {error}; write fits with save_fit"
        ) from error
    if (
        not isinstance(tensors, dict)
        or sorted(tensors) != sorted(_TENSOR_KEYS)
        or not all(isinstance(value, torch.Tensor) for value in tensors.values())
    ):
        raise ValueError(
            f"{path} must hold a dict of the tensors {list(_TENSOR_KEYS)}; write fits with save_fit"
        )
    return tensors


def load_fit(path: str | Path) -> StrideFit:
    """Read a fit written by :func:`save_fit` (on the CPU).

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a file is not a STRIDE fit, carries pickled objects, or
            its parts disagree (shapes, design fingerprint, training hash).
    """
    root = Path(path).expanduser()
    for name in (FIT_TENSOR_FILE, FIT_META_FILE):
        if not (root / name).is_file():
            raise FileNotFoundError(f"{root / name} not found; is {root} a STRIDE fit directory?")
    with (root / FIT_META_FILE).open(encoding="utf-8") as handle:
        meta = json.load(handle)
    old = meta.get("format") if isinstance(meta, dict) else None
    if isinstance(old, int) and old in _ID_CHANGE_FORMATS:
        raise ValueError(
            f"{root / FIT_META_FILE} is a STRIDE fit of format {old}, whose training ids "
            f"{_ID_CHANGE_FORMATS[old]}; format {FIT_FORMAT} names samples by their model "
            "inputs, as the gradient attributors do, so its rows would not match other scores "
            "or the training set's ids. Fit again (StrideAttributor.fit) and save_fit"
        )
    missing = [key for key in _META_KEYS if not isinstance(meta, dict) or key not in meta]
    if missing or meta.get("format") != FIT_FORMAT:
        raise ValueError(
            f"{root / FIT_META_FILE} is not a STRIDE fit of format {FIT_FORMAT} (missing "
            f"{missing}); refit and save with save_fit"
        )
    tensors = _read_tensors(root / FIT_TENSOR_FILE)
    design_params = meta["design"]
    design = SubsetDesign.from_members(
        tensors["members"], design_params["num_subsets"], design_params["seed"]
    )
    if design.params() != design_params or design.fingerprint() != meta["design_fingerprint"]:
        raise ValueError(
            f"the design in {root} does not match its recorded parameters {design_params}; the "
            "files are damaged or come from different fits"
        )
    basis, coefficients = tensors["basis"], tensors["coefficients"]
    if basis.dim() != 2 or coefficients.dim() != 3:
        raise ValueError(
            f"{root / FIT_TENSOR_FILE}: basis must be (r, D) and coefficients (K, r, O), got "
            f"{tuple(basis.shape)} and {tuple(coefficients.shape)}"
        )
    rank, hidden_dim = basis.shape
    if coefficients.shape[:2] != (design.num_subsets, rank):
        raise ValueError(
            f"{root / FIT_TENSOR_FILE}: coefficients {tuple(coefficients.shape)} do not match "
            f"K={design.num_subsets} subsets of rank {rank}"
        )
    operators = SteeringOperators(hidden_dim, rank, coefficients.shape[2], design.num_subsets)
    operators.load_state_dict({"basis": basis, "coefficients": coefficients})
    operators.requires_grad_(False)
    history = [
        {key: (float("nan") if value is None else float(value)) for key, value in record.items()}
        for record in meta["history"]
    ]
    fit = StrideFit(
        operators=operators,
        design=design,
        config=StrideConfig(**meta["config"]),
        layer=meta["layer"],
        train_ids=[str(i) for i in meta["train_ids"]],
        history=history,
    )
    if fit.train_hash != meta["train_hash"] or len(fit.train_ids) != design.num_examples:
        raise ValueError(
            f"the training ids in {root / FIT_META_FILE} do not match its recorded hash or the "
            "design size; the file is damaged"
        )
    return fit


def check_fit(
    fit: StrideFit,
    *,
    train_ids: Sequence[str] | None = None,
    design: dict[str, Any] | None = None,
) -> None:
    """Refuse ``fit`` for another training set or another design.

    Args:
        fit: the fit.
        train_ids: the training set's ids in dataset order (``None``: not checked).
        design: expected design parameters; keys among ``num_examples``,
            ``num_subsets``, ``subsets_per_example``, ``seed`` (``None`` values
            are not checked).

    Raises:
        ValueError: a mismatch, naming what differs and what to do.
    """
    if train_ids is not None and train_set_hash(train_ids) != fit.train_hash:
        raise ValueError(
            f"the fit was trained on another training set ({len(fit.train_ids)} samples, hash "
            f"{fit.train_hash[:12]}…) than the one given ({len(train_ids)} samples, hash "
            f"{train_set_hash(train_ids)[:12]}…); pass the same samples in the same order, or "
            "fit again"
        )
    expected = {k: v for k, v in (design or {}).items() if v is not None}
    unknown = set(expected) - set(_DESIGN_KEYS)
    if unknown:
        raise ValueError(f"unknown design keys {sorted(unknown)}; use {list(_DESIGN_KEYS)}")
    actual = fit.design.params()
    differs = {k: (actual[k], v) for k, v in expected.items() if actual[k] != v}
    if differs:
        detail = ", ".join(f"{k}: fit {a}, expected {e}" for k, (a, e) in differs.items())
        raise ValueError(
            f"the fit's subset design differs from the requested one ({detail}); construct the "
            "attributor with the fit's design settings or fit again"
        )
