"""Persisted damping-free fits: one file per fit directory, for K-FAC/EK-FAC and LoRIF alike.

A fit file holds ``{"algorithm", "meta", ...}``: the attributor that wrote it,
the settings a reuse must match (``fit_meta()``: the method's own settings and
the call's layer and step selection, :func:`fit_settings`) and the fitted
tensors. The logging rank writes it atomically; it is read with
``weights_only=True``. Damping is applied after loading, so it may differ.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from dattri_llm.attribution.algorithm.kronecker.curvature import to_device
from dattri_llm.attribution.sources import normalize_layer_names
from dattri_llm.utils.atomic import atomic_torch_save
from dattri_llm.utils.keywords import keywords

FISHER_FILE = "fisher_factors.pt"


def fit_settings(layer_name: Any, steps: Any) -> dict[str, Any]:
    """The selection a fit records: normalized ``layer_name``, sorted distinct ``steps``."""
    return {
        "layer_name": normalize_layer_names(layer_name),
        "selected_training_steps": None if steps is None else sorted(set(steps)),
    }


def fit_path(fit_dir: str | Path, file_name: str) -> Path:
    """``<fit_dir>/<file_name>`` (``~`` expanded)."""
    return Path(fit_dir).expanduser() / file_name


def write_fit(
    directory: Path,
    file_name: str,
    algorithm: str,
    meta: dict[str, Any],
    entries: Callable[[], dict[str, Any]],
    *,
    should_log: bool,
) -> Path:
    """Write ``{"algorithm", "meta", **entries()}`` to ``directory/file_name``; return the dir.

    Only when ``should_log`` (``entries`` is not called otherwise); the write is atomic.
    """
    if should_log:
        directory.mkdir(parents=True, exist_ok=True)
        payload = {"algorithm": algorithm, "meta": meta, **entries()}
        atomic_torch_save(payload, directory / file_name)
    return directory


def read_fit(
    path: Path,
    algorithm: str,
    expected_meta: Mapping[str, Any],
    *,
    missing: str,
    other: str,
    may_differ: str,
) -> dict[str, Any]:
    """The payload of a fit file written by :func:`write_fit`.

    Raises:
        ValueError: no file (``missing``); a fit of another algorithm
            (``"<path> holds a <algorithm> fit, <other>."``); settings that
            differ from ``expected_meta`` (listed; ``may_differ`` says what may).
    """
    if not path.is_file():
        raise ValueError(missing)
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("algorithm") != algorithm:
        raise ValueError(f"{str(path)!r} holds a {payload.get('algorithm')} fit, {other}.")
    stored = payload.get("meta", {})
    different = {k: (stored.get(k), v) for k, v in expected_meta.items() if stored.get(k) != v}
    if different:
        raise ValueError(
            f"the fit in {str(path)!r} was made with different settings "
            f"{{setting: (stored, requested)}} = {different}; refit with fit(...) or use "
            f"another fit_dir ({may_differ})."
        )
    return payload


class FisherPersistence:
    """Mixin of :class:`KroneckerAttributor`: its fit in ``<fit_dir>/fisher_factors.pt``.

    Besides the factors and the dense Fisher, the file records the fitted layer
    types and whether the pass plan of the fitting call kept every training
    block (``kept_every_block``), so that a call reading the fit back takes the
    same scoring route.
    """

    def default_fisher_dir(self) -> Path:
        """``<output_dir>/<algorithm.lower()>_fisher``."""
        return Path(self.args.output_dir).expanduser() / f"{self.algorithm.lower()}_fisher"

    @keywords(aliases={"fisher_dir": "fit_dir"})
    def save_fisher(
        self,
        covariances: Mapping[str, Any],
        fit_dir: str | Path | None = None,
        *,
        fisher: Mapping[str, torch.Tensor] | None = None,
    ) -> Path:
        """Write a damping-free fit to ``<fit_dir>/fisher_factors.pt``; return the directory."""
        return write_fit(
            Path(fit_dir or self.default_fisher_dir()).expanduser(),
            FISHER_FILE,
            self.algorithm,
            self.fit_meta(),
            lambda: {
                "factors": {k: to_device(v, torch.device("cpu")) for k, v in covariances.items()},
                "fisher": {k: v.cpu() for k, v in (fisher or {}).items()},
                "layer_types": dict(self._fitted_layer_types),
                "kept_every_block": self._fit_kept_every_block,
            },
            should_log=self.args.should_log,
        )

    @keywords(aliases={"fisher_dir": "fit_dir"})
    def load_fisher(self, fit_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load a fit written by :meth:`save_fisher` (settings must match; damping may differ)."""
        path = fit_path(fit_dir, FISHER_FILE)
        payload = read_fit(
            path,
            self.algorithm,
            self.fit_meta(),
            missing=(
                f"no fit at {str(path)!r}; run {type(self).__name__}.fit(...) or pass a "
                "fit_dir written by a previous call."
            ),
            other=f"not {self.algorithm}; use the matching attributor or another fit_dir",
            may_differ="only damping may differ",
        )
        self._fitted_layer_types = dict(payload.get("layer_types", {}))
        self._fit_kept_every_block = bool(payload.get("kept_every_block", False))
        self.raw_fit = (payload["factors"], payload["fisher"])
        return self.raw_fit

    def _use_fisher_dir(self, fit_dir: str | Path | None) -> None:
        """Load the fit in ``fit_dir`` if present, else write this call's fit there."""
        if fit_dir is None:
            return
        if fit_path(fit_dir, FISHER_FILE).is_file():
            self.load_fisher(fit_dir)
        else:
            self._fisher_dir_to_write = Path(fit_dir).expanduser()
