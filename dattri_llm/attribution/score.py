"""``AttributionScore``: a score matrix keyed by training/test sample identity.

Row ``r`` of ``scores`` is training sample ``row_train_ids[r]`` at step
``row_steps[r]`` (and token position ``row_token_ids[r]`` for token-level
scores); columns are ``test_ids``. Identities are content hashes (or
``sample_id_key`` values), so rows can be looked up regardless of data order.
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dattri_llm.utils.atomic import atomic_torch_save, atomic_write

SCORES_FILE = "scores.pt"
METADATA_FILE = "metadata.json"
SCORE_TRAJECTORIES = ("agnostic", "aware")
POLARITIES = (1, -1)


def default_polarity(algorithm: str) -> int:
    """Polarity of a score saved without one: ``-1`` for ``"AdamWInfluence"``, else ``+1``."""
    return -1 if algorithm == "AdamWInfluence" else 1


def check_polarity(polarity: object) -> int:
    """``polarity`` as a plain ``int`` (``ValueError`` unless it is ``+1`` or ``-1``)."""
    try:
        value = None if isinstance(polarity, bool) else operator.index(polarity)
    except TypeError:
        value = None
    if value not in POLARITIES:
        raise ValueError(
            f"polarity must be 1 (larger score = more helpful) or -1 (more negative score = "
            f"more helpful), got {polarity!r}"
        )
    return value


@dataclass
class AttributionScore:
    """Scores ``(num_rows, num_test)`` with row/column identities and provenance.

    ``polarity`` (keyword only): ``+1`` when a larger score means a more
    helpful training sample, ``-1`` when a more negative score does
    (AdamW-influence); anything else raises ``ValueError``. The numbers are
    stored as the method defines them; :meth:`top_k` applies the polarity.
    """

    scores: torch.Tensor
    row_train_ids: list[str]
    row_steps: list[int]
    test_ids: list[str]
    algorithm: str
    algorithm_meta: dict[str, Any]
    layer_name: list[str] | None
    row_token_ids: list[int] | None = None
    polarity: int = field(default=1, kw_only=True)
    train_index: dict[str, list[tuple[int, int]]] = field(init=False, repr=False)
    test_index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Check lengths and polarity against the matrix and build the lookup indexes."""
        self.polarity = check_polarity(self.polarity)
        self.row_train_ids = [str(h) for h in self.row_train_ids]
        self.row_steps = [int(s) for s in self.row_steps]
        self.test_ids = [str(h) for h in self.test_ids]
        if self.row_token_ids is not None:
            self.row_token_ids = [int(p) for p in self.row_token_ids]
        self._validate_shapes()
        train_index: dict[str, list[tuple[int, int]]] = {}
        for row, (train_hash, step) in enumerate(zip(self.row_train_ids, self.row_steps)):
            train_index.setdefault(train_hash, []).append((step, row))
        self.train_index = {h: sorted(rows) for h, rows in train_index.items()}
        self.test_index = {h: col for col, h in enumerate(self.test_ids)}

    def _validate_shapes(self) -> None:
        """Raise ``ValueError`` when the id lists do not match the matrix shape."""
        if self.scores.dim() != 2:
            raise ValueError(
                f"scores must be 2-D (num_rows, num_test), got shape {tuple(self.scores.shape)}"
            )
        num_rows, num_test = self.scores.shape
        lengths = {"row_train_ids": len(self.row_train_ids), "row_steps": len(self.row_steps)}
        if self.row_token_ids is not None:
            lengths["row_token_ids"] = len(self.row_token_ids)
        bad = {name: n for name, n in lengths.items() if n != num_rows}
        if bad:
            raise ValueError(
                f"scores has {num_rows} rows but {bad} (shape {tuple(self.scores.shape)})"
            )
        if len(self.test_ids) != num_test:
            raise ValueError(
                f"scores has {num_test} columns but test_ids has {len(self.test_ids)} entries"
            )
        if len(set(self.test_ids)) != len(self.test_ids):
            raise ValueError("test_ids contains duplicates; each column must be a distinct sample")

    # ------------------------------------------------------------------ properties
    @property
    def granularity(self) -> str:
        """``"token"`` when rows are token positions, else ``"instance"``."""
        return "token" if self.row_token_ids is not None else "instance"

    @property
    def train_ids(self) -> list[str]:
        """Distinct training identifiers in first-occurrence order."""
        return list(dict.fromkeys(self.row_train_ids))

    @property
    def num_rows(self) -> int:
        """Number of score rows."""
        return self.scores.shape[0]

    @property
    def num_train(self) -> int:
        """Number of distinct training samples."""
        return len(self.train_index)

    @property
    def num_test(self) -> int:
        """Number of test samples (columns)."""
        return self.scores.shape[1]

    # ------------------------------------------------------------------ lookups
    def _rows_of(self, train_hash: str) -> list[tuple[int, int]]:
        """Sorted ``(step, row)`` pairs of ``train_hash`` (``KeyError`` if unknown)."""
        try:
            return self.train_index[str(train_hash)]
        except KeyError:
            raise KeyError(f"unknown training id {train_hash!r}") from None

    def _column_of(self, test_hash: str) -> int:
        """Column of ``test_hash`` (``KeyError`` if unknown)."""
        try:
            return self.test_index[str(test_hash)]
        except KeyError:
            raise KeyError(f"unknown test id {test_hash!r}") from None

    def _sum_rows(self, rows: list[int]) -> torch.Tensor:
        """Sum of the given rows, ``(num_test,)``."""
        return self.scores[rows].sum(dim=0)

    def agnostic_matrix(self) -> tuple[list[str], torch.Tensor]:
        """Rows summed per sample over steps/positions: ``(train_ids, (num_train, num_test))``."""
        ids = self.train_ids
        position = {h: i for i, h in enumerate(ids)}
        target = torch.tensor([position[h] for h in self.row_train_ids], dtype=torch.long)
        matrix = torch.zeros(len(ids), self.num_test, dtype=self.scores.dtype)
        matrix.index_add_(0, target, self.scores)
        return ids, matrix

    def trajectory_aware(self, train_hash: str) -> tuple[list[int], torch.Tensor]:
        """Per-step scores of one sample ``(steps, (len(steps), num_test))``, token rows summed."""
        by_step: dict[int, list[int]] = {}
        for step, row in self._rows_of(train_hash):
            by_step.setdefault(step, []).append(row)
        steps = sorted(by_step)
        matrix = torch.stack([self._sum_rows(by_step[s]) for s in steps])
        return steps, matrix

    def trajectory_agnostic(self, train_hash: str) -> torch.Tensor:
        """One sample's scores summed over all its rows, ``(num_test,)``."""
        return self._sum_rows([row for _, row in self._rows_of(train_hash)])

    def token_scores(
        self, train_hash: str, step: int | None = None
    ) -> tuple[list[int], torch.Tensor]:
        """Per-position scores of one sample: ``(positions, (len(positions), num_test))``.

        ``step=None`` sums each position over all steps of the sample.
        """
        if self.row_token_ids is None:
            raise ValueError(
                'token_scores needs token-level scores; rerun with attribution_granularity="token"'
            )
        rows = self._rows_of(train_hash)
        if step is not None:
            rows = [(s, r) for s, r in rows if s == step]
            if not rows:
                steps = sorted({s for s, _ in self._rows_of(train_hash)})
                raise KeyError(f"training id {train_hash!r} has no row at step {step}; has {steps}")
        by_position: dict[int, list[int]] = {}
        for _, row in rows:
            by_position.setdefault(self.row_token_ids[row], []).append(row)
        positions = sorted(by_position)
        return positions, torch.stack([self._sum_rows(by_position[p]) for p in positions])

    def column(self, test_hash: str) -> torch.Tensor:
        """All rows' scores for one test sample, ``(num_rows,)``."""
        return self.scores[:, self._column_of(test_hash)]

    def step_matrix(self, step: int) -> tuple[list[str], torch.Tensor]:
        """Scores at one step: ``(train_ids_at_step, (len(ids), num_test))`` (token rows summed)."""
        by_id: dict[str, list[int]] = {}
        for row, (train_hash, row_step) in enumerate(zip(self.row_train_ids, self.row_steps)):
            if row_step == step:
                by_id.setdefault(train_hash, []).append(row)
        if not by_id:
            raise KeyError(f"no rows at step {step}; steps present: {sorted(set(self.row_steps))}")
        ids = list(by_id)
        return ids, torch.stack([self._sum_rows(by_id[h]) for h in ids])

    def step_matrices(self) -> dict[int, tuple[list[str], torch.Tensor]]:
        """``{step: step_matrix(step)}`` for every step, ascending."""
        return {step: self.step_matrix(step) for step in sorted(set(self.row_steps))}

    def score_at(self, train_hash: str, step: int, test_hash: str) -> torch.Tensor:
        """0-d score of one sample at one step for one test sample (token rows summed)."""
        col = self._column_of(test_hash)
        rows = [row for s, row in self._rows_of(train_hash) if s == step]
        if not rows:
            raise KeyError(f"training id {train_hash!r} has no row at step {step}")
        return self.scores[rows, col].sum()

    def query(
        self,
        train_hashes: list[str] | None = None,
        test_hashes: list[str] | None = None,
        trajectory: str = "agnostic",
    ) -> torch.Tensor:
        """Sub-matrix for the given samples.

        ``"agnostic"``: ``(len(train), len(test))``, rows summed per sample.
        ``"aware"``: one row per ``(hash, step[, position])`` in each sample's
        ``train_index`` order. Defaults: all training ids / all columns.
        """
        if trajectory not in SCORE_TRAJECTORIES:
            raise ValueError(f"trajectory must be one of {SCORE_TRAJECTORIES}, got {trajectory!r}")
        train_hashes = self.train_ids if train_hashes is None else list(train_hashes)
        cols = (
            list(range(self.num_test))
            if test_hashes is None
            else [self._column_of(h) for h in test_hashes]
        )
        col_index = torch.tensor(cols, dtype=torch.long)
        if trajectory == "aware":
            rows = [row for h in train_hashes for _, row in self._rows_of(h)]
            return self.scores[rows][:, col_index]
        if not train_hashes:
            return self.scores.new_zeros(0, len(cols))
        summed = torch.stack([self.trajectory_agnostic(h) for h in train_hashes])
        return summed[:, col_index]

    # ------------------------------------------------------------------ ranking
    def top_k(
        self, k: int, *, proponents: bool = True, test_ids: list[str] | None = None
    ) -> dict[str, list[tuple[str, float]]]:
        """The ``k`` most helpful (or most harmful) training samples of each query.

        Ranks the rows of :meth:`agnostic_matrix` ``(num_train, num_test)`` (each
        training sample's rows summed over steps and token positions) by
        ``polarity * score``: descending for ``proponents=True`` (most helpful
        first), ascending for ``proponents=False`` (most harmful first). The
        same call is right for every method, whichever sign it calls helpful.

        Args:
            k: samples per query, an ``int >= 1``; more than :attr:`num_train`
                returns them all.
            proponents: ``True`` for the most helpful, ``False`` for the most
                harmful samples.
            test_ids: the queries (columns) to rank, in the order of the
                result; ``None`` means every column in column order.

        Returns:
            ``{test_id: [(train_id, score), ...]}``, at most ``k`` pairs per
            query, best first. ``score`` is the summed score as stored (not
            multiplied by the polarity). Ties keep the order of
            :attr:`train_ids` (first appearance): the result equals a stable
            sort of the whole column. NaN scores rank last in both directions.

        Raises:
            ValueError: ``k`` is not an ``int >= 1``.
            KeyError: an id of ``test_ids`` is not a column (the error names it).
            TypeError: ``test_ids`` is a single string rather than a list of ids.

        Example:
            >>> score = AttributionScore(
            ...     torch.tensor([[0.5], [-2.0], [1.0]]), ["a", "b", "c"], [0, 0, 0],
            ...     ["q"], "TracIn", {}, None)
            >>> score.top_k(2)
            {'q': [('c', 1.0), ('a', 0.5)]}
            >>> score.top_k(1, proponents=False)
            {'q': [('b', -2.0)]}
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        if isinstance(test_ids, str):
            raise TypeError(f"test_ids must be a list of test ids, got the string {test_ids!r}")
        names = list(self.test_ids) if test_ids is None else [str(h) for h in test_ids]
        columns = [self._column_of(h) for h in names]
        ids, matrix = self.agnostic_matrix()
        values = matrix.detach().to(device="cpu", dtype=torch.float64)[:, columns]
        sign = self.polarity if proponents else -self.polarity
        # Best first = ascending in -sign * value. An ascending sort puts NaN last; a stable
        # one keeps train_ids order within ties; "+ 0.0" turns -0.0 into 0.0 so they tie.
        order = torch.sort(-sign * values + 0.0, dim=0, stable=True).indices[: min(k, len(ids))]
        return {
            name: [(ids[row], values[row, j].item()) for row in order[:, j].tolist()]
            for j, name in enumerate(names)
        }

    # ------------------------------------------------------------------ persistence
    def save(self, out_dir: str | Path) -> Path:
        """Write ``scores.pt`` and ``metadata.json`` into ``out_dir``; return the directory.

        Each file is written crash-safely (temporary file, fsync, rename): a
        save that fails or is killed mid-write leaves the previous file intact.
        """
        out = Path(out_dir).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        metadata = json.dumps(self._metadata(), default=str).encode("utf-8")
        atomic_torch_save(self.scores.detach().cpu(), out / SCORES_FILE)
        atomic_write(out / METADATA_FILE, lambda handle: handle.write(metadata))
        return out

    def _metadata(self) -> dict[str, Any]:
        """The JSON-able description :meth:`load` rebuilds the score from."""
        return {
            "algorithm": self.algorithm,
            "polarity": self.polarity,
            "algorithm_meta": self.algorithm_meta,
            "layer_name": self.layer_name,
            "granularity": self.granularity,
            "num_rows": self.num_rows,
            "num_train": self.num_train,
            "num_test": self.num_test,
            "row_train_ids": self.row_train_ids,
            "row_steps": self.row_steps,
            "row_token_ids": self.row_token_ids,
            "test_ids": self.test_ids,
        }

    @classmethod
    def load(cls, out_dir: str | Path) -> AttributionScore:
        """Rebuild a score written by :meth:`save`.

        A ``metadata.json`` without ``"polarity"`` (saved before polarity was
        recorded) gets ``-1`` for ``algorithm == "AdamWInfluence"``, else ``+1``.
        """
        out = Path(out_dir).expanduser()
        for name in (SCORES_FILE, METADATA_FILE):
            if not (out / name).is_file():
                raise FileNotFoundError(
                    f"{out / name} not found; is {out} a saved score directory?"
                )
        with (out / METADATA_FILE).open(encoding="utf-8") as handle:
            metadata = json.load(handle)
        meta = dict(metadata.get("algorithm_meta") or {})
        if "normalized_grad" in metadata:
            meta.setdefault("normalized_grad", metadata["normalized_grad"])
        return cls(
            scores=torch.load(out / SCORES_FILE, map_location="cpu", weights_only=True),
            row_train_ids=metadata["row_train_ids"],
            row_steps=metadata["row_steps"],
            test_ids=metadata["test_ids"],
            algorithm=metadata["algorithm"],
            algorithm_meta=meta,
            layer_name=metadata.get("layer_name"),
            row_token_ids=metadata.get("row_token_ids"),
            polarity=metadata.get("polarity", default_polarity(metadata["algorithm"])),
        )
