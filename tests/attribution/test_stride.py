"""STRIDE: subset design, sparse recovery, linearity term, operators, fit files, attributor."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dattri_llm import AttributionArguments, AttributionTask, StrideAttributor, StrideConfig
from dattri_llm.attribution.algorithm.stride import SubsetDesign, lasso_fista
from dattri_llm.attribution.algorithm.stride.fit import (
    _linearity_backward,
    _responses,
    linearity_projector,
    ridge_hat_matrix,
)
from dattri_llm.attribution.algorithm.stride.operators import (
    SteeringOperators,
    default_layer,
    frozen_pass,
)
from dattri_llm.attribution.algorithm.stride.persistence import FIT_META_FILE, FIT_TENSOR_FILE
from dattri_llm.attribution.report import render_token_report, write_token_report
from dattri_llm.attribution.topk import TopK
from dattri_llm.utils.hashing import hash_sample

VOCAB, LENGTH = 32, 8


# --------------------------------------------------------------------------- design


def test_design_is_left_regular_reproducible_and_distinct():
    design = SubsetDesign(200, 40, 5, seed=3)
    dense = design.dense()
    assert dense.shape == (40, 200)
    assert set(dense.unique().tolist()) == {0.0, 1.0}
    assert torch.equal(dense.sum(dim=0), torch.full((200,), 5.0))
    assert torch.unique(dense, dim=1).shape[1] == 200  # distinct columns
    assert design == SubsetDesign(200, 40, 5, seed=3)
    assert design != SubsetDesign(200, 40, 5, seed=4)
    for k in (0, 17, 39):
        assert torch.equal(design.subset(k), torch.nonzero(dense[k]).flatten())
    assert torch.equal(design.subset_sizes(), dense.sum(dim=1).long())
    w = torch.randn(200, 3)
    assert torch.allclose(design.apply(w), dense @ w, atol=1e-5)
    assert torch.allclose(design.apply_transpose(dense @ w), dense.T @ (dense @ w), atol=1e-4)


def test_design_resamples_duplicates_and_warns_when_impossible():
    design = SubsetDesign(15, 6, 2, seed=0)  # C(6, 2) = 15: every column must be used once
    assert torch.unique(design.members, dim=0).shape[0] == 15
    with pytest.warns(UserWarning, match="cannot be told apart"):
        SubsetDesign(20, 4, 2, seed=0)


def test_design_validation_and_saved_members():
    with pytest.raises(ValueError, match="must not exceed num_subsets"):
        SubsetDesign(10, 3, 4)
    with pytest.raises(ValueError, match="num_examples must be an int >= 1"):
        SubsetDesign(0, 3, 2)
    design = SubsetDesign(30, 10, 3, seed=1)
    assert SubsetDesign.from_members(design.members.clone(), 10, 1) == design
    damaged = design.members.clone()
    damaged[0, 0] = 99
    with pytest.raises(ValueError, match="damaged"):
        SubsetDesign.from_members(damaged, 10, 1)


# --------------------------------------------------------------------------- Lasso


def _planted(num_subsets: int, d: int, *, n: int = 200, s: int = 5, queries: int = 10):
    """A linear datamodel ``u = M w* + offset + noise`` with ``s``-sparse ``w*`` per query."""
    design = SubsetDesign(n, num_subsets, d, seed=0)
    g = torch.Generator().manual_seed(1)
    truth = torch.zeros(queries, n)
    for q in range(queries):
        support = torch.randperm(n, generator=g)[:s]
        signs = torch.where(torch.rand(s, generator=g) < 0.5, -1.0, 1.0)
        truth[q, support] = signs * (1 + torch.rand(s, generator=g))
    u = (design.dense() @ truth.T).T + 0.3 + 0.01 * torch.randn(queries, num_subsets, generator=g)
    return design, truth, u


def _support_quality(weights: torch.Tensor, truth: torch.Tensor, s: int = 5):
    """Mean top-s precision (= recall at size s) and sign agreement on the true support."""
    precision, signs = [], []
    for q in range(truth.shape[0]):
        support = set(torch.nonzero(truth[q]).flatten().tolist())
        top = set(weights[q].abs().topk(s).indices.tolist())
        precision.append(len(top & support) / s)
        idx = sorted(support)
        signs.append(float((weights[q, idx].sign() == truth[q, idx].sign()).float().mean()))
    return sum(precision) / len(precision), sum(signs) / len(signs)


def test_lasso_recovers_planted_support_above_the_bound():
    # K = 60 > 2 s ln(N / s) ≈ 37 for N = 200, s = 5
    design, truth, u = _planted(60, 10)
    result = lasso_fista(design, u, lasso_lambda=0.05, max_iter=2000, tol=1e-6)
    precision, signs = _support_quality(result.weights, truth)
    assert precision >= 0.9 and signs >= 0.9
    assert bool(result.converged.all())
    assert torch.allclose(result.intercept, torch.full((10,), 0.3), atol=0.1)
    # optimality (KKT) of the centred problem: |Aᵀ r| ≤ λ, = λ on the support
    dense = design.dense()
    centred = dense - dense.mean(dim=0, keepdim=True)
    residual = (u - u.mean(dim=1, keepdim=True)).T - centred @ result.weights.T
    correlation = (centred.T @ residual).T
    assert bool((correlation.abs() <= result.lambdas[:, None] * 1.01 + 1e-4).all())


def test_lasso_fails_well_below_the_bound():
    design, truth, u = _planted(60, 10)
    good, _ = _support_quality(
        lasso_fista(design, u, lasso_lambda=0.05, max_iter=2000, tol=1e-6).weights, truth
    )
    design, truth, u = _planted(12, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        poor, _ = _support_quality(
            lasso_fista(design, u, lasso_lambda=0.05, max_iter=500, tol=1e-6).weights, truth
        )
    assert poor <= 0.6 and good - poor >= 0.3


def test_lasso_rejects_wrong_shapes_and_warns_on_non_convergence():
    design, _, u = _planted(60, 10, queries=2)
    with pytest.raises(ValueError, match=r"\(Q, K=60\)"):
        lasso_fista(design, u.T, lasso_lambda=0.1, max_iter=10, tol=1e-6)
    with pytest.warns(UserWarning, match="did not converge"):
        lasso_fista(design, u, lasso_lambda=0.01, max_iter=2, tol=1e-9)


# --------------------------------------------------------------------------- linearity


def test_hat_matrix_equals_the_dense_ridge_projection():
    design = SubsetDesign(50, 12, 3, seed=2)
    q, seed, ridge = 4, 7, 0.1
    omega = torch.randn(50, q, generator=torch.Generator().manual_seed(seed)) / math.sqrt(q)
    sketch = (design.dense() @ omega).double()
    assert torch.allclose(design.sketch(q, torch.Generator().manual_seed(seed)).double(), sketch)
    gamma = ridge * float((sketch**2).sum()) / q
    dense_hat = sketch @ torch.linalg.inv(sketch.T @ sketch + gamma * torch.eye(q)) @ sketch.T
    assert torch.allclose(ridge_hat_matrix(sketch, gamma), dense_hat, atol=1e-10)
    projector = linearity_projector(design, q, ridge, seed)
    assert torch.allclose(projector.double(), torch.eye(12) - dense_hat, atol=1e-6)


# --------------------------------------------------------------------------- tiny model


class _Block(nn.Module):
    """A residual block that mixes each position with the previous one (a causal toy)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = nn.Linear(2 * width, width)
        self.dropout = nn.Dropout(0.1)  # measure() and fit() must run the model in eval mode

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        previous = F.pad(hidden, (0, 0, 1, 0))[:, :-1]
        return (hidden + self.dropout(torch.tanh(self.mix(torch.cat([hidden, previous], -1)))),)


class _TinyLM(nn.Module):
    """A decoder-shaped toy LM: ``model.embed``, ``model.layers``, ``lm_head``; logits out."""

    def __init__(self, vocab: int = VOCAB, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed = nn.Embedding(vocab, width)
        self.model.position = nn.Embedding(LENGTH, width)
        self.model.layers = nn.ModuleList(_Block(width) for _ in range(depth))
        self.lm_head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.model.embed(input_ids) + self.model.position(positions)
        for block in self.model.layers:
            hidden = block(hidden)[0]
        return self.lm_head(hidden)


def _model(seed: int = 0, cls: type[nn.Module] | None = None, **sizes: int) -> nn.Module:
    torch.manual_seed(seed)
    return (cls or _TinyLM)(**sizes)


def _data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (LENGTH,), generator=g)} for _ in range(n)]


def _attributor(tmp_path: Path, model: nn.Module, **kwargs) -> StrideAttributor:
    args = AttributionArguments(output_dir=str(tmp_path / "out"), per_device_eval_batch_size=4)
    config = StrideConfig(steps=3, subsets_per_step=3, probe_size=3, rank=4, seed=0)
    options = {"num_subsets": 8, "subsets_per_example": 2, "config": config, **kwargs}
    return StrideAttributor(args, task=AttributionTask(None, model), **options)


def _randomize(attributor: StrideAttributor) -> None:
    """Non-zero coefficients, so the measurements are not trivially zero."""
    g = torch.Generator().manual_seed(5)
    coefficients = attributor.stride_fit.operators.coefficients
    coefficients.copy_(0.5 * torch.randn(coefficients.shape, generator=g))


@pytest.mark.parametrize("injection", ["logits", "residual"])
def test_fit_leaves_the_model_bit_identical_and_restores_its_flags(tmp_path, injection):
    model = _model()
    model.model.embed.weight.requires_grad_(False)
    model.train()
    flags = [p.requires_grad for p in model.parameters()]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fit = _attributor(tmp_path, model, injection=injection).fit(_data(24, 0))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [p.requires_grad for p in model.parameters()] == flags and model.training
    assert all(p.grad is None for p in model.parameters())
    assert len(fit.history) == 3 and fit.layer == "model.layers.0"
    assert fit.operators.coefficients.abs().sum() > 0  # the operators did train


def _shifted(output, shift):
    """A block output with ``shift`` added to its hidden state (tensor or tuple output)."""
    if isinstance(output, tuple):
        return (output[0] + shift(output[0]), *output[1:])
    return output + shift(output)


def _reference_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-example mean token cross-entropy, one example at a time."""
    return torch.stack(
        [F.cross_entropy(logits[b], labels[b], ignore_index=-100) for b in range(len(labels))]
    )


@pytest.mark.parametrize("injection", ["logits", "residual"])
def test_measurement_equals_separate_steered_forward_passes(tmp_path, injection):
    model = _model()
    attributor = _attributor(tmp_path, model, injection=injection)
    attributor.fit(_data(24, 0))
    _randomize(attributor)
    queries = _data(5, 1)
    ids, u = attributor.measure(queries)
    assert ids == [hash_sample(q) for q in queries] and u.shape == (5, 8)
    fit = attributor.stride_fit
    layer = model.get_submodule(fit.layer)
    model.eval()  # measure() runs in eval mode (no dropout) and restores the mode after
    batch = {"input_ids": torch.stack([q["input_ids"] for q in queries])}
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, :-1] = batch["input_ids"][:, 1:]
    base = frozen_pass(model, batch, layer, attributor.logits_fn)
    reference = torch.empty(5, 8)
    for k in range(8):  # one steered forward per subset
        coefficients = fit.operators.coefficients[k]

        def shift(hidden, coefficients=coefficients):
            return (hidden @ fit.operators.basis.T) @ coefficients

        if injection == "logits":
            steered = base.logits + shift(base.hidden)
        else:
            handle = layer.register_forward_hook(lambda m, a, out: _shifted(out, shift))
            with torch.no_grad():
                steered = model(**batch)
            handle.remove()
        reference[:, k] = _reference_losses(base.logits, labels) - _reference_losses(
            steered, labels
        )
    assert reference.abs().max() > 1e-3
    assert torch.allclose(u, reference, atol=1e-5)


def test_linearity_gradient_matches_autograd(tmp_path):
    model = _model()
    attributor = _attributor(tmp_path, model)
    attributor.fit(_data(24, 0))
    _randomize(attributor)
    fit = attributor.stride_fit
    operators = fit.operators.requires_grad_(True)
    assert all(p.grad is None for p in operators.parameters())  # the fit frees its gradients
    layer = model.get_submodule(fit.layer)
    model.eval()
    batch = {"input_ids": torch.stack([q["input_ids"] for q in _data(3, 2)])}
    probe = frozen_pass(model, batch, layer, attributor.logits_fn)
    projector = linearity_projector(fit.design, 2, 1e-3, 0)
    context = {
        "injection": "logits",
        "model": model,
        "batch": batch,
        "layer": layer,
        "logits_fn": attributor.logits_fn,
    }
    value = _linearity_backward(operators, probe, projector, 0.7, 3, context)
    chunked = [p.grad.clone() for p in operators.parameters()]
    operators.zero_grad()
    u = _responses(operators, probe, torch.arange(8), context)
    direct = ((u @ projector.T) ** 2).sum() / u.numel()
    (0.7 * direct).backward()
    assert value == pytest.approx(direct.item(), rel=1e-5)
    for got, want in zip(chunked, (p.grad for p in operators.parameters())):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)


def test_end_to_end_recovers_the_training_sample_a_query_repeats(tmp_path):
    """Each query copies one training sequence: its operators' responses point at that sample."""
    model = _model(vocab=64, width=32)
    g = torch.Generator().manual_seed(0)
    train = [{"input_ids": torch.randint(0, 64, (LENGTH,), generator=g)} for _ in range(60)]
    planted = [3, 17, 41, 55]
    settings = StrideConfig(
        steps=60, learning_rate=0.05, subsets_per_step=8, probe_size=4, lasso_lambda=0.05
    )
    attributor = _attributor(
        tmp_path, model, num_subsets=24, subsets_per_example=3, rank=8, config=settings
    )
    score = attributor.attribute(train, [train[i] for i in planted])
    assert (
        attributor.stride_fit.history[-1]["fidelity"] < attributor.stride_fit.history[0]["fidelity"]
    )
    assert score.scores.argmax(dim=0).tolist() == planted
    best = score.top_k(1)
    assert [best[t][0][0] for t in score.test_ids] == [score.row_train_ids[i] for i in planted]


# --------------------------------------------------------------------------- attributor and files


def test_attribute_scores_rows_and_persistence_round_trip(tmp_path):
    model, train, test = _model(), _data(24, 0), _data(3, 1)
    attributor = _attributor(tmp_path, model)
    score = attributor.attribute(train, test)
    assert score.algorithm == "STRIDE" and score.polarity == 1
    assert score.scores.shape == (24, 3)
    assert score.row_train_ids == [hash_sample(x) for x in train]
    assert score.test_ids == [hash_sample(x) for x in test]
    assert all(len(pairs) == 2 for pairs in score.top_k(2).values())
    path = attributor.save_fit(tmp_path / "fit")
    again = _attributor(tmp_path, model).attribute_from_fit(path, test)
    assert torch.equal(again.scores, score.scores)
    fresh = _attributor(tmp_path, model)
    fresh.load_fit(path, train_dataset=train)
    assert torch.equal(fresh.attribute(train, test).scores, score.scores)


class _LabelledLM(_TinyLM):
    """Accepts (and ignores) ``labels``, as a Hugging Face model's signature does."""

    def forward(self, input_ids, attention_mask=None, labels=None) -> torch.Tensor:
        return super().forward(input_ids, attention_mask)


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def _loss_with_labels(model, batch):
    """The model receives every field, labels included (as ``default_loss_func`` passes)."""
    return _token_loss(model(**batch), batch["labels"])


def _loss_without_labels(model, batch):
    """The model receives its inputs only (the command line's ``causal_lm_loss``)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return _token_loss(model(**inputs), batch["labels"])


def _labelled(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Samples with right padding and ``-100`` labels on it."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=g)
        mask = (torch.arange(LENGTH) < LENGTH - i % 3).long()
        samples.append(
            {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        )
    return samples


@pytest.mark.parametrize("loss_func", [_loss_with_labels, _loss_without_labels])
def test_ids_equal_the_gradient_attributors_on_labelled_data(tmp_path, loss_func):
    pytest.importorskip("transformers")
    from dattri_llm.attribution.algorithm.tracin import TracInAttributor

    model = _model(cls=_LabelledLM)
    train, test = _labelled(10, 0), _labelled(3, 1)
    for i in (2, 6, 9):  # 1 and 2 share the first batch; 6 and 9 sit in later ones
        train[i] = dict(train[1])
    test.append(dict(test[0]))  # a query repeated in the second batch
    args = AttributionArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=3,
    )
    task = AttributionTask(loss_func, model)
    config = StrideConfig(steps=2, subsets_per_step=3, probe_size=3, rank=4, seed=0)
    stride = StrideAttributor(args, task=task, num_subsets=8, subsets_per_example=2, config=config)
    score = stride.attribute(train, test)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shared position embedding's broadcast warning
        reference = TracInAttributor(args, task=task).attribute(train, test)
    assert score.row_train_ids == reference.row_train_ids
    assert score.test_ids == reference.test_ids
    assert score.scores.shape == (10, 3)

    # The hash covers what the objective hands the model; repeats are counted per batch.
    fields = (
        (lambda x: x)
        if loss_func is _loss_with_labels
        else (lambda x: {k: v for k, v in x.items() if k != "labels"})
    )
    repeated = hash_sample(fields(train[1]))
    assert score.row_train_ids[0] == hash_sample(fields(train[0]))
    assert [score.row_train_ids[i] for i in (1, 2, 6, 9)] == [
        repeated, f"{repeated}#1", repeated, repeated
    ]  # fmt: skip
    assert score.test_ids == [hash_sample(fields(x)) for x in test[:3]]
    assert stride.stride_fit.train_ids == score.row_train_ids


def test_ids_need_no_working_forward_and_a_model_call(tmp_path):
    # default_loss_func would pass labels the toy cannot take; the forward never runs.
    model, train = _model(), _labelled(5, 0)
    attributor = _attributor(tmp_path, model)
    assert attributor.sample_ids(train) == [hash_sample(x) for x in train]
    silent = StrideAttributor(
        attributor.args, task=AttributionTask(lambda model, batch: torch.zeros(()), model)
    )
    with pytest.raises(ValueError, match="never called the model"):
        silent.sample_ids(train)


def test_a_fit_of_the_old_id_format_is_refused(tmp_path):
    model, train = _model(), _data(12, 0)
    attributor = _attributor(tmp_path, model)
    attributor.fit(train)
    path = attributor.save_fit(tmp_path / "fit")
    meta = json.loads((path / FIT_META_FILE).read_text())
    assert meta["format"] == 2
    (path / FIT_META_FILE).write_text(json.dumps({**meta, "format": 1}))
    with pytest.raises(ValueError, match=r"format 1.*labels included.*Fit again"):
        _attributor(tmp_path, model).load_fit(path)


def test_token_report_of_a_stride_score_is_unshaded_and_says_so(tmp_path):
    model, train, test = _model(), _data(12, 0), _data(2, 1)
    score = _attributor(tmp_path, model).attribute(train, test)
    tokens = {
        row: [f"w{int(i)}" for i in sample["input_ids"]]
        for row, sample in zip(score.row_train_ids, train)
    }
    ranked = score.top_k(3)
    top = TopK(
        test_ids=list(ranked),
        train_ids=[[row for row, _ in rows] for rows in ranked.values()],
        scores=torch.tensor([[value for _, value in rows] for rows in ranked.values()]),
        polarity=score.polarity,
        proponents=True,
        algorithm=score.algorithm,
    )
    unshaded = "No token-level scores were given: the tokens are shown unshaded."
    for ranking in (score, top):  # the score itself, and its top-k as a TopK
        path = write_token_report(tmp_path / "report.html", ranking, tokens, k=3)
        page = path.read_text(encoding="utf-8")
        assert "Token attribution (STRIDE)" in page and unshaded in page
        assert 'style="background' not in page  # no token is shaded
        assert page.count("<section>") == 2 and page.count("<li>") == 6
        assert page == render_token_report(ranking, tokens, k=3)
    # STRIDE has one row per sample: it cannot shade tokens, and says how to get a page.
    with pytest.raises(ValueError, match="leave token_score out for unshaded tokens"):
        render_token_report(top, tokens, token_score=score)


def test_crafted_pickle_is_refused_without_running_it(tmp_path):
    model, train = _model(), _data(24, 0)
    attributor = _attributor(tmp_path, model)
    attributor.fit(train)
    path = attributor.save_fit(tmp_path / "fit")
    marker = tmp_path / "executed"
    torch.save({"basis": _Payload(marker)}, path / FIT_TENSOR_FILE)
    with pytest.raises(ValueError, match="plain-tensor STRIDE fit"):
        _attributor(tmp_path, model).load_fit(path)
    assert not marker.exists()
    (path / "stride_fit.json").write_text('{"format": 2}')
    with pytest.raises(ValueError, match="missing"):
        _attributor(tmp_path, model).load_fit(path)


class _Payload:
    """Unpickling this would create a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_mismatched_training_set_or_design_is_refused(tmp_path):
    model, train, test = _model(), _data(24, 0), _data(2, 1)
    attributor = _attributor(tmp_path, model)
    attributor.fit(train)
    path = attributor.save_fit(tmp_path / "fit")
    other = _data(24, 9)
    with pytest.raises(ValueError, match="another training set"):
        _attributor(tmp_path, model).load_fit(path, train_dataset=other)
    with pytest.raises(ValueError, match="another training set"):
        attributor.attribute(other, test)
    with pytest.raises(ValueError, match="test_dataset is empty"):
        attributor.attribute(train, [])
    with pytest.raises(ValueError, match=r"design differs.*num_subsets: fit 8, expected 9"):
        _attributor(tmp_path, model, num_subsets=9).load_fit(path)
    with pytest.raises(ValueError, match="subsets_per_example: fit 2, expected 3"):
        _attributor(tmp_path, model, subsets_per_example=3).load_fit(path)


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"rank": 0}, ValueError, "rank must be >= 1"),
        ({"rank": 1.5}, TypeError, "rank must be an int"),
        ({"injection": "hidden"}, ValueError, "injection must be one of"),
        ({"lasso_lambda": 1.0}, ValueError, r"in \[0, 1\)"),
        ({"fidelity_weight": 0.0}, ValueError, "fidelity_weight must be > 0"),
        ({"stability_weight": -1.0}, ValueError, "stability_weight must be >= 0"),
        ({"learning_rate": float("nan")}, ValueError, "learning_rate must be finite"),
        ({"num_subsets": 4, "subsets_per_example": 5}, ValueError, "lower d or raise K"),
        ({"layer": ""}, TypeError, "layer must be a module name"),
        ({"fit_intercept": 1}, TypeError, "fit_intercept must be a bool"),
    ],
)
def test_config_validation(changes, error, message):
    with pytest.raises(error, match=message):
        StrideConfig(**changes)


def test_default_layer_and_missing_task():
    for depth, index in ((12, 7), (16, 9), (20, 11), (24, 14)):
        holder = nn.Module()
        holder.model = nn.Module()
        holder.model.layers = nn.ModuleList(nn.Identity() for _ in range(depth))
        assert default_layer(holder) == f"model.layers.{index}"
    with pytest.raises(ValueError, match="pass layer="):
        default_layer(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="needs a task"):
        StrideAttributor(AttributionArguments(output_dir="unused"), task=None)
    assert SteeringOperators(4, 2, 3, 5).coefficients.shape == (5, 2, 3)
