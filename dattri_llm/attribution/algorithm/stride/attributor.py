"""``StrideAttributor``: training data attribution by sparse recovery from subset perturbations.

No per-sample gradients: :meth:`StrideAttributor.fit` trains one steering
operator per random training subset against the frozen model;
:meth:`StrideAttributor.attribute_from_fit` measures each query's response to
every operator (one frozen forward and ``K`` small products with the logits
injection) and recovers a sparse per-example score from those ``K`` numbers
with a Lasso against the subset design. ``docs/stride.md`` describes the
method and every choice.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.data import DataLoader, default_collate
from tqdm.auto import tqdm

from dattri_llm.attribution.algorithm.stride.config import StrideConfig
from dattri_llm.attribution.algorithm.stride.design import SubsetDesign, suggested_num_subsets
from dattri_llm.attribution.algorithm.stride.fit import StrideFit, fit_operators
from dattri_llm.attribution.algorithm.stride.lasso import LassoResult, lasso_fista
from dattri_llm.attribution.algorithm.stride.operators import (
    LogitsFn,
    causal_lm_logits,
    measure,
    resolve_layer,
)
from dattri_llm.attribution.algorithm.stride.persistence import check_fit, load_fit, save_fit
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.gradient.hooks.identity import SampleIdentity
from dattri_llm.gradient.stream.inputs import check_dataset
from dattri_llm.gradient.stream.training import move_batch
from dattri_llm.task import AttributionTask, as_task

__all__ = ["StrideAttributor"]

_DESIGN_FIELDS = ("num_subsets", "subsets_per_example", "seed")


class StrideAttributor:
    """STRIDE (``algorithm="STRIDE"``): scores are sparse linear-datamodel weights.

    A score ``ŵ[i, q] > 0`` says training sample ``i`` lowers query ``q``'s
    loss (helpful; ``polarity = +1``). Rows are the training samples in
    dataset order, each once (step ``0``), identified exactly as the gradient
    attributors identify them under the same task (:meth:`sample_ids`), so
    the scores join theirs and a capture's; most scores are exactly zero.

    Args:
        args: run settings (``per_device_eval_batch_size`` batches the
            queries; ``per_device_train_batch_size`` and it group the samples
            whose ids count repeats, as the gradient attributors batch them;
            ``output_dir`` receives the score when ``should_log``).
        task: the :class:`AttributionTask` (its model, first checkpoint).
        layer, rank, num_subsets, subsets_per_example, injection: shortcuts
            for the :class:`StrideConfig` fields of the same names; ``None``
            keeps the config's value (defaults: the decoder block at about
            0.63 depth, ``r = 16``, ``K`` from the sparsity rule, ``d = 10``,
            ``"logits"``).
        config: every other setting (loss weights, steps, Lasso, seed).
        logits_fn: ``(model, batch) -> (logits (B, T, C), labels (B, T))``,
            labels shifted and ``-100`` where ignored; default
            :func:`~.operators.causal_lm_logits` (Hugging Face causal LMs).
        collate_fn: builds a batch from a list of dataset items (default
            ``torch.utils.data.default_collate``; pad variable-length text).

    Attributes:
        stride_fit: the current :class:`StrideFit` (``None`` before a fit or load).
    """

    algorithm: ClassVar[str] = "STRIDE"
    polarity: ClassVar[int] = 1

    def __init__(
        self,
        args: AttributionArguments,
        *,
        task: object,
        layer: str | None = None,
        rank: int | None = None,
        num_subsets: int | None = None,
        subsets_per_example: int | None = None,
        injection: str | None = None,
        config: StrideConfig | None = None,
        logits_fn: LogitsFn | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        if task is None:
            raise ValueError(
                "StrideAttributor runs the model and needs a task; pass "
                "task=AttributionTask(loss_func, model)"
            )
        if config is not None and not isinstance(config, StrideConfig):
            raise TypeError(f"config must be a StrideConfig or None, got {type(config).__name__}")
        self.args = args
        self.task: AttributionTask = as_task(task)
        keywords = {
            "layer": layer,
            "rank": rank,
            "num_subsets": num_subsets,
            "subsets_per_example": subsets_per_example,
            "injection": injection,
        }
        self.config = (config or StrideConfig()).replace(**keywords)
        given = {k for k, v in keywords.items() if v is not None}
        self._explicit_design = {
            k: getattr(self.config, k) for k in _DESIGN_FIELDS if config is not None or k in given
        }
        self.logits_fn: LogitsFn = logits_fn or causal_lm_logits
        self.collate_fn = collate_fn or default_collate
        self.stride_fit: StrideFit | None = None

    # ------------------------------------------------------------------ model and data
    def _model(self) -> nn.Module:
        """The task model at its first checkpoint (warns when the task has more)."""
        if self.task.num_checkpoints() > 1:
            warnings.warn(
                f"StrideAttributor uses the first checkpoint only; the task has "
                f"{self.task.num_checkpoints()} and the others are ignored.",
                UserWarning,
                stacklevel=3,
            )
        return self.task.load_checkpoint(0)

    @staticmethod
    def _device(model: nn.Module) -> torch.device:
        """The device of the model's first parameter (CPU for a parameterless model)."""
        return next(model.parameters(), torch.empty(0)).device

    def _loader(self, dataset: Any, batch_size: int | None = None) -> DataLoader:
        """Dataset-order batches of ``batch_size`` (``per_device_eval_batch_size``) items."""
        return DataLoader(
            dataset,
            batch_size=batch_size or self.args.per_device_eval_batch_size,
            shuffle=False,
            collate_fn=self.collate_fn,
        )

    def sample_ids(self, dataset: Any, *, queries: bool = False) -> list[str]:
        """The ids of ``dataset``'s samples in dataset order, one per sample.

        Exactly the ids a gradient attributor (``TracInAttributor`` and the
        others) gives the same dataset under the same task, so STRIDE's scores
        join theirs and a capture's. Those name a sample by the inputs its
        model forward receives when the task's objective runs on its batch
        (``loss_func`` for training samples, ``target_func`` with
        ``queries``), content-hashed by ``HookManager``'s default
        :class:`SampleIdentity`, repeats within a batch suffixed ``#k``. STRIDE's
        own forward (``logits_fn``) may pass the model other fields (the
        default drops ``labels``, which ``default_loss_func`` passes on), so
        the ids are read from the task's objective instead, by that same
        identity (:meth:`SampleIdentity.forward_inputs`): each batch goes to
        the objective, which is stopped at the model's forward; the model does
        not run, and the task's model is used as it is (no checkpoint loads).
        Batches are as the gradient attributors form them
        (``per_device_train_batch_size``, or ``per_device_eval_batch_size``
        with ``queries``), since the ``#k`` suffixes count repeats per batch:
        a sample repeated in another batch keeps its plain id.
        """
        check_dataset(dataset, "dataset")
        model = self.task.model
        objective = self.task.target_func if queries else self.task.loss_func
        batch_size = (
            self.args.per_device_eval_batch_size
            if queries
            else self.args.per_device_train_batch_size
        )
        identity = SampleIdentity(sample_id_key=None, sample_hash_fields=None)
        device = self._device(model)
        ids: list[str] = []
        for batch in self._loader(dataset, batch_size):
            batch = move_batch(batch, device)
            with torch.no_grad():
                inputs, keyed = identity.forward_inputs(model, lambda b=batch: objective(model, b))
            ids.extend(identity.identifiers(None, inputs, keyed, model))
        return ids

    # ------------------------------------------------------------------ fit
    def fit(self, train_dataset: Any, *, verbose: bool = False) -> StrideFit:
        """Draw the subset design over ``train_dataset`` and train the operators.

        The model stays frozen: only the operators get gradients, and its
        ``requires_grad`` flags and training mode are restored afterwards.

        Returns:
            the fit, also kept as :attr:`stride_fit`.

        Raises:
            ValueError: an empty training set, or ``subsets_per_example``
                above the resolved ``num_subsets``.
        """
        check_dataset(train_dataset, "train_dataset")
        if len(train_dataset) == 0:
            raise ValueError("train_dataset is empty; STRIDE needs training samples to attribute")
        num_examples = len(train_dataset)
        num_subsets = self.config.num_subsets or suggested_num_subsets(
            num_examples, self.config.expected_sparsity
        )
        config = self.config.replace(num_subsets=max(num_subsets, self.config.subsets_per_example))
        design = SubsetDesign(
            num_examples, config.num_subsets, config.subsets_per_example, config.seed
        )
        model = self._model()
        self.stride_fit = fit_operators(
            model,
            train_dataset,
            design,
            config,
            layer=resolve_layer(model, config.layer),
            logits_fn=self.logits_fn,
            collate_fn=self.collate_fn,
            device=self._device(model),
            train_ids=self.sample_ids(train_dataset),
            verbose=verbose,
        )
        return self.stride_fit

    def save_fit(self, path: str | Path) -> Path:
        """Write :attr:`stride_fit` to the directory ``path`` (atomically); return it."""
        return save_fit(self._require_fit("save_fit"), path)

    def load_fit(self, path: str | Path, *, train_dataset: Any = None) -> StrideFit:
        """Read a fit (no code runs), check it, and keep it as :attr:`stride_fit`.

        Raises:
            ValueError: the file is not a plain STRIDE fit; its design differs
                from the one this attributor was given (``num_subsets``,
                ``subsets_per_example``, ``seed``); or ``train_dataset`` is
                given and is not the fit's training set.
        """
        fit = load_fit(path)
        self._check(fit, train_dataset)
        self.stride_fit = fit
        return fit

    def _check(self, fit: StrideFit, train_dataset: Any) -> None:
        """:func:`check_fit` against the explicit design settings and ``train_dataset``."""
        train_ids = None if train_dataset is None else self.sample_ids(train_dataset)
        design = dict(self._explicit_design)
        if train_dataset is not None:
            design["num_examples"] = len(train_dataset)
        check_fit(fit, train_ids=train_ids, design=design)

    def _require_fit(self, method: str) -> StrideFit:
        """:attr:`stride_fit`, or ``ValueError`` naming ``method``."""
        if self.stride_fit is None:
            raise ValueError(f"{method} needs a fit; call fit(train_dataset) or load_fit(path)")
        return self.stride_fit

    # ------------------------------------------------------------------ measure and recover
    def measure(
        self, test_dataset: Any, *, fit: StrideFit | None = None, verbose: bool = False
    ) -> tuple[list[str], torch.Tensor]:
        """Each query's subset responses: ``(test_ids, u (Q, K))`` (no gradients).

        ``u[q, k] = L(o(x_q)) − L(õ^{(k)}(x_q))``, ``L`` the mean token loss;
        positive when subset ``k``'s operator lowers the query loss. The
        queries are the distinct :meth:`sample_ids` (``queries=True``) in
        first-appearance order, as the gradient attributors' score columns: a
        query repeated in another batch shares its id, and its first row.
        """
        fit = fit or self._require_fit("measure")
        check_dataset(test_dataset, "test_dataset")
        if len(test_dataset) == 0:
            raise ValueError("test_dataset is empty; pass at least one query")
        ids = self.sample_ids(test_dataset, queries=True)
        first = {identifier: row for row, identifier in reversed(list(enumerate(ids)))}
        model = self._model()
        _, module = resolve_layer(model, fit.layer)
        device = self._device(model)
        was_training = model.training
        model.eval()
        try:
            u = measure(
                fit.operators.to(device),
                model,
                tqdm(
                    self._loader(test_dataset),
                    desc="STRIDE measure",
                    unit="batch",
                    disable=not verbose,
                ),
                layer=module,
                logits_fn=self.logits_fn,
                injection=fit.config.injection,
                subset_chunk=fit.config.subset_chunk,
                device=device,
            )
        finally:
            model.train(was_training)
        rows = sorted(first.values())
        if len(rows) < len(ids):
            u = u[torch.tensor(rows, device=u.device)]
        return [ids[row] for row in rows], u

    def recover(
        self, measurements: torch.Tensor, *, fit: StrideFit | None = None, verbose: bool = False
    ) -> LassoResult:
        """The batched Lasso of ``measurements`` ``(Q, K)`` against the fit's design."""
        fit = fit or self._require_fit("recover")
        return lasso_fista(
            fit.design,
            measurements,
            lasso_lambda=fit.config.lasso_lambda,
            max_iter=fit.config.lasso_max_iter,
            tol=fit.config.lasso_tol,
            fit_intercept=fit.config.fit_intercept,
            device=self._device(self.task.model),
            verbose=verbose,
        )

    # ------------------------------------------------------------------ entry points
    def attribute(
        self, train_dataset: Any, test_dataset: Any, *, verbose: bool = False
    ) -> AttributionScore:
        """Score every training sample for every query (fitting first if there is no fit).

        Raises:
            ValueError: the current fit belongs to another training set
                (fit again, or use a new attributor).
        """
        if self.stride_fit is None:
            self.fit(train_dataset, verbose=verbose)
        else:
            self._check(self.stride_fit, train_dataset)
        fit = self._require_fit("attribute")
        return self.attribute_from_fit(fit, test_dataset, verbose=verbose)

    def attribute_from_fit(
        self, fit_or_path: StrideFit | str | Path, test_dataset: Any, *, verbose: bool = False
    ) -> AttributionScore:
        """Scores ``(N, Q)`` from a fit (or a saved fit's directory): measure, then recover.

        A path is read with :meth:`load_fit` (checked against this
        attributor's explicit design settings) and becomes :attr:`stride_fit`.
        """
        fit = fit_or_path if isinstance(fit_or_path, StrideFit) else self.load_fit(fit_or_path)
        test_ids, u = self.measure(test_dataset, fit=fit, verbose=verbose)
        result = self.recover(u, fit=fit, verbose=verbose)
        score = AttributionScore(
            scores=result.weights.T.contiguous(),
            row_train_ids=fit.train_ids,
            row_steps=[0] * len(fit.train_ids),
            test_ids=test_ids,
            algorithm=self.algorithm,
            algorithm_meta={
                "design": fit.design.params(),
                "train_hash": fit.train_hash,
                "injection": fit.config.injection,
                "rank": fit.config.rank,
                "lasso_lambda": fit.config.lasso_lambda,
                "fit_intercept": fit.config.fit_intercept,
                "lambdas": result.lambdas.tolist(),
                "intercept": result.intercept.tolist(),
                "lasso_iterations": result.iterations,
                "lasso_converged": int(result.converged.sum()),
            },
            layer_name=[fit.layer],
            polarity=self.polarity,
        )
        if self.args.should_log:
            score.save(self.args.output_dir)
        return score
