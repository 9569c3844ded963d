"""What every registry entry shares: the entry type, the sign alignment, the scoring
arguments, the final model, the attributor lookup and the projected hooks.

Split from ``methods.py`` so that the registry's method modules (``methods.py``,
``replay_methods.py``) can share it without importing each other.
"""

from __future__ import annotations

import importlib
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
from capture import FINAL_MODEL, Captured
from setting import Setting, make_data, make_model

import dattri_llm
from dattri_llm import AttributionArguments, HookManagerConfig

# TRAK's projection per side of a layer's gradient (k² numbers per layer); TrackStar keeps the
# same count per layer.
PROJECTION_K = 32


@dataclass(frozen=True)
class Method:
    """One registry entry.

    Attributes:
        score: ``score(captured) -> (num_train, num_query)`` float64, "helps" sign.
        charged: keys of ``Captured.seconds`` added to the method's attribution seconds.
        note: the table's note.
        needs: attributor classes the entry uses (``"Name"`` exported by ``dattri_llm`` or
            ``"module.path:Name"``); if one does not import the row reads "not run".
    """

    score: Callable[[Captured], torch.Tensor]
    charged: tuple[str, ...] = ()
    note: str = ""
    needs: tuple[str, ...] = ()


def aligned(score, captured: Captured) -> torch.Tensor:
    """An ``AttributionScore`` as ``(num_train, num_query)`` in the "helps" sign, rows summed
    over steps.

    Training samples the score has no row for (not in the scored steps) get 0.
    """
    ids, matrix = score.agnostic_matrix()
    matrix = matrix * score.polarity
    row_of = {sample: row for row, sample in enumerate(captured.train_ids)}
    columns = [score.test_index[q] for q in captured.query_ids]
    result = torch.zeros(len(captured.train_ids), len(captured.query_ids), dtype=torch.float64)
    result[[row_of[i] for i in ids]] = matrix[:, columns].double()
    return result


def arguments(captured: Captured) -> AttributionArguments:
    """Scoring arguments: CPU, a throwaway output directory."""
    return AttributionArguments(
        output_dir=tempfile.mkdtemp(prefix="tsloo_"),
        use_cpu=True,
        seed=captured.setting.seed,
        per_device_train_batch_size=16,
    )


def final_model(captured: Captured) -> tuple[torch.nn.Module, object]:
    """``(model at θ_T, data)`` rebuilt from the setting and the captured final weights."""
    data = make_data(captured.setting)
    model = make_model(captured.setting, data.vocab_size)
    model.load_state_dict(torch.load(captured.root / FINAL_MODEL, weights_only=True))
    model.eval()
    return model, data


def projected_hooks(model: torch.nn.Module, setting: Setting, config: dict) -> HookManagerConfig:
    """Hooks on the setting's trained layers, each projected by ``config``; the LayerNorms
    (trainer setting; no factor projection exists for them, 2·n_embd numbers each) are left
    unprojected."""
    patterns = setting.hooked_layers
    projected = {
        name: dict(config)
        for name, module in model.named_modules()
        if any(re.search(p, name) for p in patterns) and not isinstance(module, torch.nn.LayerNorm)
    }
    return HookManagerConfig(linear_io=patterns, projection_kwargs=projected)


def attributor_class(spec: str) -> type:
    """The class ``spec`` names: ``"Name"`` from ``dattri_llm``, or ``"module.path:Name"``."""
    if ":" in spec:
        module, name = spec.split(":", 1)
        return getattr(importlib.import_module(module), name)
    return getattr(dattri_llm, spec)
