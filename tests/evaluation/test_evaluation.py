"""dattri_llm.evaluation on a synthetic linear datamodel with planted per-sample effects.

"Training" on a subset returns the kept indices and the seed; a query's loss is
``BASE - sum(w[kept, q]) + sigma_q * noise(seed)``, so sample ``i`` helps query
``q`` by exactly ``w[i, q]`` and the true LDS follows from the noise level.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from dattri_llm.attribution.score import AttributionScore
from dattri_llm.evaluation import (
    LDSConfig,
    RetrainRunner,
    align_scores,
    lds,
    lds_ground_truth,
    leave_one_out,
    loo_correlation,
    mean_ci,
    pearson,
    recall_at_k,
    spearman,
)
from dattri_llm.evaluation.subsets import sample_subsets

N_TRAIN, N_QUERY, BASE = 40, 12, 10.0
IDS = [f"s{i}" for i in range(N_TRAIN)]
QUERIES = [f"q{j}" for j in range(N_QUERY)]


def planted_weights() -> torch.Tensor:
    return torch.randn(
        N_TRAIN, N_QUERY, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )


class Datamodel:
    """Counts train_fn calls; optionally raises after ``fail_after`` calls."""

    def __init__(self, w: torch.Tensor, sigma: torch.Tensor, fail_after: int | None = None):
        self.w, self.sigma, self.fail_after, self.calls = w, sigma, fail_after, []

    def train(self, kept: list[int], seed: int):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise RuntimeError("interrupted")
        self.calls.append((tuple(kept), seed))
        return kept, seed

    def eval(self, model) -> torch.Tensor:
        kept, seed = model
        noise = torch.randn(
            N_QUERY, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
        )
        return BASE - self.w[kept].sum(dim=0) + self.sigma * noise


def noise_levels(w: torch.Tensor, config: LDSConfig) -> torch.Tensor:
    """Per-query noise from 0.3x to 2x the spread of a subset sum: true LDS from high to low."""
    k = sample_subsets(N_TRAIN, config.alpha, 2, 0).shape[1]
    spread = w.std(dim=0) * (k * (1 - k / N_TRAIN)) ** 0.5
    return spread * torch.linspace(0.3, 2.0, N_QUERY, dtype=torch.float64)


def true_lds(w: torch.Tensor, sigma: torch.Tensor, alpha: float) -> float:
    """Population LDS from many fresh subsets and noise draws (independent of the run's seeds)."""
    subsets = sample_subsets(N_TRAIN, alpha, 20000, seed=12345)
    noise = torch.randn(
        20000, N_QUERY, generator=torch.Generator().manual_seed(6789), dtype=torch.float64
    )
    summed = w[subsets].sum(dim=1)
    return spearman(summed, summed - sigma * noise).mean().item()


def test_metrics_basic():
    x = torch.tensor([1.0, 2.0, 2.0, 4.0])
    assert spearman(x, torch.tensor([10.0, 20.0, 20.0, 40.0])).item() == pytest.approx(1.0)
    assert spearman(x, -x).item() == pytest.approx(-1.0)
    assert pearson(x, 2 * x + 1).item() == pytest.approx(1.0)
    assert torch.isnan(pearson(x, torch.ones(4)))
    a = mean_ci(torch.tensor([0.1, 0.5, float("nan"), 0.9]), seed=3)
    assert a.mean == pytest.approx(0.5) and a.low <= 0.5 <= a.high
    assert str(a) == str(mean_ci(torch.tensor([0.1, 0.5, float("nan"), 0.9]), seed=3))


def test_lds_matches_known_value_and_random_is_zero():
    w = planted_weights()
    config = LDSConfig(alpha=0.5, num_subsets=200, seed=0)
    sigma = noise_levels(w, config)
    model = Datamodel(w, sigma)
    truth = lds_ground_truth(model.train, model.eval, IDS, config, progress=False)
    assert truth.losses.shape == (200, N_QUERY) and len(model.calls) == 200
    expected = true_lds(w, sigma, config.alpha)
    result = lds(w, truth)
    assert result.low <= expected <= result.high, (result, expected)
    assert abs(result.mean - expected) < 0.05
    random = lds(torch.randn(N_TRAIN, N_QUERY, generator=torch.Generator().manual_seed(5)), truth)
    assert abs(random.mean) < 0.1 and random.low <= 0.0 <= random.high
    # No noise: the planted weights rank the subsets perfectly.
    clean = Datamodel(w, torch.zeros(N_QUERY, dtype=torch.float64))
    exact = lds(w, lds_ground_truth(clean.train, clean.eval, IDS, config, progress=False))
    assert exact.per_query.tolist() == pytest.approx([1.0] * N_QUERY)


def per_step_score(w: torch.Tensor, polarity: int = 1) -> AttributionScore:
    """w split over two steps per sample, rows shuffled, columns reversed, signed by polarity."""
    half = w / 3
    rows = torch.cat([half, w - half]) * polarity
    ids = IDS + IDS
    steps = [0] * N_TRAIN + [1] * N_TRAIN
    order = torch.randperm(2 * N_TRAIN, generator=torch.Generator().manual_seed(2)).tolist()
    return AttributionScore(
        rows[order].flip(1),
        [ids[r] for r in order],
        [steps[r] for r in order],
        QUERIES[::-1],
        "TracIn",
        {},
        None,
        polarity=polarity,
    )


def test_attribution_score_aligns_by_id_sums_steps_and_applies_polarity():
    w = planted_weights()
    for polarity in (1, -1):
        score = per_step_score(w, polarity)
        torch.testing.assert_close(align_scores(score, IDS, QUERIES), w)
    torch.testing.assert_close(align_scores(-w, IDS, polarity=-1), w)
    with pytest.raises(KeyError, match="no score"):
        align_scores(per_step_score(w), IDS + ["unknown"], QUERIES)
    config = LDSConfig(num_subsets=30)
    model = Datamodel(w, noise_levels(w, config))
    truth = lds_ground_truth(model.train, model.eval, IDS, config, progress=False)
    assert lds(per_step_score(w, -1), truth, test_ids=QUERIES).mean == pytest.approx(
        lds(w, truth).mean
    )


def test_leave_one_out_recovers_planted_effects():
    w = planted_weights()
    model = Datamodel(w, noise_levels(w, LDSConfig()))
    result = leave_one_out(model.train, model.eval, IDS, seed=4, progress=False)
    torch.testing.assert_close(result.delta, w, atol=1e-9, rtol=0)
    assert loo_correlation(w, result).per_query.tolist() == pytest.approx([1.0] * N_QUERY)
    assert loo_correlation(per_step_score(w, -1), result, test_ids=QUERIES).mean == pytest.approx(1)
    some = leave_one_out(model.train, model.eval, IDS, removed=[3, 7, 11], progress=False)
    torch.testing.assert_close(some.delta, w[[3, 7, 11]], atol=1e-9, rtol=0)
    assert loo_correlation(w, some, metric="pearson").mean == pytest.approx(1.0)


def test_recall_at_k_on_planted_examples():
    w = planted_weights()
    planted = [[(j + d) % N_TRAIN for d in range(3)] for j in range(N_QUERY)]
    boosted = w.clone()
    for j, rows in enumerate(planted):
        boosted[rows, j] += 100.0
    assert recall_at_k(boosted, planted, 3).mean == pytest.approx(1.0)
    mask = torch.zeros(N_TRAIN, N_QUERY, dtype=torch.bool)
    for j, rows in enumerate(planted):
        mask[rows, j] = True
    assert recall_at_k(-boosted, mask, 3, polarity=-1).mean == pytest.approx(1.0)
    # Only one of the three planted rows is boosted: recall@1 = 1/3 (rows found / rows planted).
    one = w.clone()
    for j, rows in enumerate(planted):
        one[rows[0], j] += 100.0
    assert recall_at_k(one, planted, 1).per_query.tolist() == pytest.approx([1 / 3] * N_QUERY)
    with pytest.raises(ValueError, match="k must be"):
        recall_at_k(w, planted, 0)
    with pytest.raises(ValueError, match="planted rows of query 0"):
        recall_at_k(w, [[N_TRAIN]] + planted[1:], 3)


def test_interrupted_run_resumes_without_redoing_finished_retrains(tmp_path: Path):
    w = planted_weights()
    config = LDSConfig(num_subsets=20, seed=3)
    sigma = noise_levels(w, config)
    reference = lds_ground_truth(
        Datamodel(w, sigma).train, Datamodel(w, sigma).eval, IDS, config, progress=False
    )
    broken = Datamodel(w, sigma, fail_after=7)
    with pytest.raises(RuntimeError, match="interrupted"):
        lds_ground_truth(broken.train, broken.eval, IDS, config, out_dir=tmp_path, progress=False)
    assert len(list((tmp_path / "results").glob("*.json"))) == 7
    resumed = Datamodel(w, sigma)
    result = lds_ground_truth(
        resumed.train, resumed.eval, IDS, config, out_dir=tmp_path, progress=False
    )
    assert not set(broken.calls) & set(resumed.calls)
    assert len(resumed.calls) == 13
    assert torch.equal(result.losses, reference.losses)
    again = Datamodel(w, sigma)
    lds_ground_truth(again.train, again.eval, IDS, config, out_dir=tmp_path, progress=False)
    assert again.calls == []


def test_a_kill_mid_write_leaves_every_finished_retrain_readable(tmp_path: Path, monkeypatch):
    """A run stopped while writing its 8th result (the rename never happens), plus the
    truncated temporary file a SIGKILL there would leave, resumes from the 7 finished ones."""
    import dattri_llm.utils.atomic as atomic

    w = planted_weights()
    config = LDSConfig(num_subsets=20, seed=3)
    sigma = noise_levels(w, config)
    reference = lds_ground_truth(
        Datamodel(w, sigma).train, Datamodel(w, sigma).eval, IDS, config, progress=False
    )
    real_replace, renames = atomic.os.replace, []

    def killed_on_eighth(source, target):
        if Path(target).parent.name != "results":  # the design file
            return real_replace(source, target)
        renames.append(target)
        if len(renames) == 8:
            raise KeyboardInterrupt("killed mid-write")
        return real_replace(source, target)

    monkeypatch.setattr(atomic.os, "replace", killed_on_eighth)
    first = Datamodel(w, sigma)
    with pytest.raises(KeyboardInterrupt):
        lds_ground_truth(first.train, first.eval, IDS, config, out_dir=tmp_path, progress=False)
    monkeypatch.setattr(atomic.os, "replace", real_replace)
    results = tmp_path / "results"
    finished = sorted(results.glob("*.json"))
    assert len(finished) == 7 and Path(renames[-1]).name not in {f.name for f in finished}
    (results / f".{Path(renames[-1]).name}.x1y2.tmp").write_text('{"losses": [0.1, ')
    resumed = Datamodel(w, sigma)
    result = lds_ground_truth(
        resumed.train, resumed.eval, IDS, config, out_dir=tmp_path, progress=False
    )
    assert len(resumed.calls) == 13 and not set(first.calls[:7]) & set(resumed.calls)
    assert torch.equal(result.losses, reference.losses)


class _Exploit:
    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_crafted_result_file_is_not_executed(tmp_path: Path):
    w = planted_weights()
    config = LDSConfig(num_subsets=4)
    model = Datamodel(w, noise_levels(w, config))
    lds_ground_truth(model.train, model.eval, IDS, config, out_dir=tmp_path, progress=False)
    marker = tmp_path / "pwned"
    exploit = _Exploit()
    exploit.marker = str(marker)
    (tmp_path / "results" / "subset-0.json").write_bytes(pickle.dumps(exploit))
    with pytest.raises(ValueError, match="not valid JSON"):
        lds_ground_truth(model.train, model.eval, IDS, config, out_dir=tmp_path, progress=False)
    assert not marker.exists()
    # Valid JSON for a different subset is refused too, not silently reused.
    payload = json.loads((tmp_path / "results" / "subset-1.json").read_text())
    (tmp_path / "results" / "subset-0.json").write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="does not belong"):
        lds_ground_truth(model.train, model.eval, IDS, config, out_dir=tmp_path, progress=False)


def test_mismatched_design_is_refused(tmp_path: Path):
    w = planted_weights()
    model = Datamodel(w, noise_levels(w, LDSConfig()))
    lds_ground_truth(
        model.train, model.eval, IDS, LDSConfig(num_subsets=3), out_dir=tmp_path, progress=False
    )
    for other, ids in (
        (LDSConfig(num_subsets=3, alpha=0.3), IDS),
        (LDSConfig(num_subsets=3), IDS[::-1]),
    ):
        with pytest.raises(ValueError, match="different evaluation design"):
            lds_ground_truth(model.train, model.eval, ids, other, out_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="different evaluation design"):
        leave_one_out(model.train, model.eval, IDS, out_dir=tmp_path, progress=False)
    from dattri_llm.evaluation import RetrainJob

    with pytest.raises(ValueError, match="job keys must be distinct"):
        job = RetrainJob("a", (0,), 0)
        RetrainRunner(model.train, model.eval, out_dir=None, design={}).run([job, job])


def test_config_validation_messages():
    with pytest.raises(ValueError, match="alpha must be a fraction"):
        LDSConfig(alpha=1.5)
    with pytest.raises(ValueError, match="num_subsets must be an int >= 2"):
        LDSConfig(num_subsets=1)
    with pytest.raises(ValueError, match="seed must be an int"):
        LDSConfig(seed=0.5)
