"""One name per concept: unknown keywords raise ``TypeError`` listing the accepted names, and
the documented older names keep working as aliases."""

from __future__ import annotations

import pytest
import torch
from attribution_helpers import MLP, MLP_LAYERS, mlp_data, mlp_loss, write_store

from dattri_llm import (
    AdamWInfluenceAttributor,
    AttributionArguments,
    DVEmbAttributor,
    KFACAttributor,
    LESSAttributor,
    TracInAttributor,
)
from dattri_llm.utils.keywords import keywords


def test_the_decorator_renames_aliases_and_refuses_unknown_keywords():
    class Thing:
        @keywords(aliases={"old": "new"}, extra=("more",))
        def call(self, a, *, new=None, **kwargs):
            return new, kwargs

    thing = Thing()
    assert thing.call(1, old=2) == (2, {})
    assert thing.call(1, new=3, more=4) == (3, {"more": 4})
    with pytest.raises(TypeError, match=r"both 'new' and its alias 'old'"):
        thing.call(1, new=1, old=2)
    with pytest.raises(TypeError, match=r"'mor' \(did you mean 'more'\?\).*\['a', 'more', 'new'"):
        thing.call(1, mor=4)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    torch.manual_seed(0)
    model = MLP()
    train, test = root / "train", root / "test"
    write_store(train, model, MLP_LAYERS, mlp_loss, mlp_data(4, 1), batch_sizes=[2, 2])
    write_store(test, model, MLP_LAYERS, mlp_loss, mlp_data(2, 2), batch_sizes=[2])
    return root, train, test


def args(root):
    return AttributionArguments(output_dir=str(root / "out"), use_cpu=True)


@pytest.mark.parametrize(
    "make, method, typo, hint",
    [
        (AdamWInfluenceAttributor, "attribute_from_cache", "num_mask", "num_masks"),
        (DVEmbAttributor, "attribute_from_cache", "learning_rates", "learning_rate"),
        (TracInAttributor, "attribute_from_cache", "normalize_grad", "normalized_grad"),
        (KFACAttributor, "attribute_from_cache", "dampening", "damping"),
        (LESSAttributor, "attribute_from_cache", "checkpoint_weights", "checkpoint_weight"),
    ],
)
def test_unknown_keywords_raise_before_any_work(stores, make, method, typo, hint):
    root, train, test = stores
    with pytest.raises(TypeError, match=rf"unknown keyword argument\(s\) '{typo}' \(did you mean "
                                         rf"'{hint}'\?\); it accepts \["):  # fmt: skip
        getattr(make(args(root)), method)(train, test, **{typo: 4})


def test_spec_names_are_aliases(stores):
    root, train, test = stores
    kfac = KFACAttributor(args(root))
    by_alias = kfac.fit(train_gradients_dir=train, fisher_dir=root / "fit_a")
    by_name = kfac.fit(train_source=train, fit_dir=root / "fit_b")
    assert by_alias.name == "fit_a" and by_name.name == "fit_b"
    first = kfac.attribute_from_cache(train, test, fisher_dir=str(by_alias))
    second = kfac.attribute_from_cache(train, test, fit_dir=str(by_name))
    torch.testing.assert_close(first.scores, second.scores)
    less = LESSAttributor(args(root))
    torch.testing.assert_close(
        less.attribute_from_cache(train, test, learning_rates=0.5).scores,
        less.attribute_from_cache(train, test, learning_rate=0.5).scores,
    )


def test_less_loss_reduction_belongs_to_the_capture(stores):
    """The map runs at capture: scoring a stored run cannot change it, so it is refused."""
    root, train, test = stores
    with pytest.raises(TypeError, match=r"'loss_reduction'.*it accepts \["):
        LESSAttributor(args(root)).attribute_from_cache(train, test, loss_reduction="mean")
