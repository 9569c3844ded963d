"""`attribution.utils.score_sources` / `collect_gradients` with minimal stand-ins (compat.md §2-3).

The stand-ins implement only the documented protocol: a source is a list of
``(step, Gradient, ids)`` with a ``reusable`` flag; a streamer has
``args``, ``hook_manager.sample_id_key``, the context-manager protocol and
iteration; a store has only ``save_bulk``. Expectations are built in the
tests from the raw tensors.
"""

from __future__ import annotations

import inspect
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from dattri_llm.attribution.algorithm.tracin import TracInAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.utils import collect_gradients, score_sources
from dattri_llm.gradient.gradient import Factorized, Gradient, GradientRecord
from dattri_llm.utils.cache import CacheBudget, TensorCache

D = 3


# ---------------------------------------------------------------------------- stand-ins
class ListSource:
    """A gradient source over a list of ``(step, Gradient, ids)``; counts its passes."""

    def __init__(self, blocks, *, reusable=True):
        self.blocks = blocks
        self.reusable = reusable
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        return iter(list(self.blocks))


def dense(x: torch.Tensor, name: str = "fc") -> Gradient:
    """A materialized ``(B, d)`` block."""
    return Gradient({name: "materialized"}, {name: x}, {name: "nn.Linear"})


def factorized(a: torch.Tensor, g: torch.Tensor, name: str = "fc") -> Gradient:
    """A factorized block of final ``(B, d_in)`` / ``(B, d_out)`` factors."""
    return Gradient({name: "factorized"}, {name: Factorized(a, g)}, {name: "nn.Linear"})


def rows_of(block: Gradient, name: str = "fc") -> torch.Tensor:
    """Flattened per-sample gradients ``(B, d)`` (outer product for factors)."""
    value = block.data[name]
    if isinstance(value, Factorized):
        a, g = value.activation, value.pre_activation_grad
        return torch.einsum("bo,bi->boi", g, a).reshape(a.shape[0], -1)
    return value.reshape(value.shape[0], -1)


class Recorder:
    """``inner_product`` stand-in: plain dot products; records every call."""

    def __init__(self, put=False):
        self.calls = []
        self.put = put
        self.put_results = []

    def __call__(self, train_rep, test_rep, dense_cache=None):
        is_factorized = "factorized" in train_rep.representation.values()
        self.calls.append((train_rep.batch_size, test_rep.batch_size, dense_cache, is_factorized))
        if dense_cache is not None and self.put:
            self.put_results.append(dense_cache.put(f"k{len(self.calls)}", torch.ones(8)))
        return rows_of(train_rep) @ rows_of(test_rep).T


def ids(prefix: str, n: int, start: int = 0) -> list[str]:
    return [f"{prefix}{i}" for i in range(start, start + n)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def train_blocks(sizes, seed=0):
    g = gen(seed)
    blocks, start = [], 0
    for step, n in enumerate(sizes):
        blocks.append((10 + step, dense(torch.randn(n, D, generator=g)), ids("tr", n, start)))
        start += n
    return blocks


def stacked(blocks) -> torch.Tensor:
    return torch.cat([rows_of(block) for _s, block, _i in blocks])


# ---------------------------------------------------------------------------- signatures
def _plain_signature(fn) -> str:
    """``fn``'s signature without annotations or return type."""
    params = [
        p.replace(annotation=inspect.Parameter.empty)
        for p in inspect.signature(fn).parameters.values()
    ]
    return str(inspect.Signature(params)).replace(" ", "")


def test_signatures_match_compat():
    assert _plain_signature(score_sources) == (
        "(train_source,test_source,device,*,inner_product,transform_train=None,"
        "transform_test=None,batch_size=1,loop_over_test=False,cache_budget=None,"
        "granularity='instance',inner_product_per_token=None)"
    )
    assert _plain_signature(collect_gradients) == (
        "(streamer,store,*,offload_interval=1,on_block=None,async_write=None)"
    )


# ---------------------------------------------------------------------------- score_sources
def test_scores_rows_and_columns():
    train = train_blocks([2, 3])
    test = train_blocks([2, 1], seed=1)
    test = [
        (0, block, ids("te", block.batch_size, 5 * k)) for k, (_s, block, _i) in enumerate(test)
    ]
    scores, row_ids, row_steps, test_ids, row_tokens = score_sources(
        ListSource(train), ListSource(test), "cpu", inner_product=Recorder()
    )
    assert scores.dtype == torch.float32 and scores.device.type == "cpu"
    torch.testing.assert_close(scores, stacked(train) @ stacked(test).T)
    assert row_ids == ids("tr", 5)
    assert row_steps == [10, 10, 11, 11, 11]
    assert test_ids == ["te0", "te1", "te5"]
    assert row_tokens is None


@pytest.mark.parametrize("batch_size", [1, 2, 4, 100])
def test_batch_size_rebatches_without_changing_scores(batch_size):
    g = gen(3)
    train = train_blocks([1, 2, 3, 1])
    fact = factorized(torch.randn(2, 1, generator=g), torch.randn(2, D, generator=g))
    train.insert(2, (20, fact, ["f0", "f1"]))  # dense, dense, factorized, dense, dense
    test = [(0, dense(torch.randn(4, D, generator=g)), ids("te", 4))]
    recorder = Recorder()
    scores, row_ids, row_steps, _test_ids, _ = score_sources(
        ListSource(train), ListSource(test), "cpu", inner_product=recorder, batch_size=batch_size
    )
    torch.testing.assert_close(scores, stacked(train) @ stacked(test).T)
    assert row_ids == ids("tr", 3) + ["f0", "f1"] + ids("tr", 4, 3)
    assert row_steps == [10, 11, 11, 20, 20, 12, 12, 12, 13]
    # the factorized block is scored alone, after the pending dense rows were flushed;
    # dense batches hold at least batch_size rows unless their run is shorter
    sizes = [(call[0], call[3]) for call in recorder.calls]
    fact_at = sizes.index((2, True))
    assert sum(n for n, _f in sizes[:fact_at]) == 3 and sum(n for n, _f in sizes) == 9
    for run in (sizes[:fact_at], sizes[fact_at + 1 :]):
        assert all(n >= min(batch_size, sum(m for m, _f in run)) for n, _f in run[:-1])
        assert not any(f for _n, f in run)


def _mixed_setup():
    """Dense train rows against a test side with a factorized block (two layers kinds)."""
    g = gen(4)
    a_tr, g_tr = torch.randn(5, 2, generator=g), torch.randn(5, 2, generator=g)
    train = [
        (0, factorized(a_tr[:2], g_tr[:2]), ids("tr", 2)),
        (1, factorized(a_tr[2:], g_tr[2:]), ids("tr", 3, 2)),
    ]
    test = []
    for k in range(3):
        a, gr = torch.randn(2, 2, generator=g), torch.randn(2, 2, generator=g)
        test.append((0, factorized(a, gr), ids("te", 2, 2 * k)))
    return train, test


@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_factorized_batch_size_invariant(batch_size):
    train, test = _mixed_setup()
    scores, *_ = score_sources(
        ListSource(train), ListSource(test), "cpu", inner_product=Recorder(), batch_size=batch_size
    )
    torch.testing.assert_close(scores, stacked(train) @ stacked(test).T)


def test_dense_cache_is_fresh_per_train_batch_and_closed():
    train, test = _mixed_setup()
    recorder = Recorder(put=True)
    score_sources(ListSource(train), ListSource(test), "cpu", inner_product=recorder)
    caches = [call[2] for call in recorder.calls]
    assert len(caches) == 6 and all(isinstance(c, TensorCache) for c in caches)
    assert caches[0] is caches[1] is caches[2]
    assert caches[3] is caches[4] is caches[5]
    assert caches[0] is not caches[3]
    assert all(c.residency == "memory" for c in caches)
    for cache in (caches[0], caches[3]):
        with pytest.raises(RuntimeError):
            cache.put("after", torch.ones(1))
    assert recorder.put_results == [True] * 6  # default budget: 35 % of host memory


def test_cache_budget_is_the_dense_cache_budget():
    train, test = _mixed_setup()
    recorder = Recorder(put=True)
    score_sources(
        ListSource(train),
        ListSource(test),
        "cpu",
        inner_product=recorder,
        cache_budget=CacheBudget(limit_bytes=16),  # fits 16 bytes: one 8-float entry does not
    )
    assert recorder.put_results == [False] * 6


def test_consecutive_dense_test_blocks_merge():
    g = gen(5)
    train = train_blocks([2])
    xs = [torch.randn(n, D, generator=g) for n in (1, 2, 2)]
    a, gr = torch.randn(1, 1, generator=g), torch.randn(1, 3, generator=g)
    fact = factorized(a, gr)  # materializes to width 3, like the dense rows
    test = [
        (0, dense(xs[0]), ["t0"]),
        (0, fact, ["t1"]),
        (0, dense(xs[1]), ["t2", "t3"]),
        (0, dense(xs[2]), ["t4", "t5"]),
    ]
    recorder = Recorder()
    scores, *_ = score_sources(
        ListSource(train), ListSource(test), "cpu", inner_product=recorder, batch_size=2
    )
    assert [call[1] for call in recorder.calls] == [1, 1, 4]  # the last two dense blocks merged
    assert all(isinstance(call[2], TensorCache) for call in recorder.calls)  # 3 blocks remain
    test_rows = torch.cat([xs[0], rows_of(fact), xs[1], xs[2]])
    torch.testing.assert_close(scores, stacked(train) @ test_rows.T)


def _with_broadcast(x: torch.Tensor, row: torch.Tensor) -> Gradient:
    """A dense block whose layer ``"pos"`` holds one row shared by every sample."""
    return Gradient(
        {"fc": "materialized", "pos": "materialized"},
        {"fc": x, "pos": row},
        {"fc": "nn.Linear", "pos": "nn.Linear"},
    )


def _expanded(block: Gradient) -> torch.Tensor:
    """``(B, d_fc + d_pos)`` rows with the broadcast row repeated per sample."""
    x = block.data["fc"]
    return torch.cat([x, block.data["pos"].expand(x.shape[0], -1)], dim=1)


def test_blocks_with_a_broadcast_layer_are_not_merged():
    g = gen(9)
    train = [
        (
            0,
            _with_broadcast(torch.randn(2, D, generator=g), torch.randn(2, D, generator=g)),
            ["x", "y"],
        )
    ]
    test = [
        (
            0,
            _with_broadcast(torch.randn(2, D, generator=g), torch.randn(1, D, generator=g)),
            ids("te", 2, 2 * k),
        )
        for k in range(2)
    ]

    def inner_product(train_rep, test_rep, dense_cache=None):
        return _expanded(train_rep) @ _expanded(test_rep).T

    scores, *_ = score_sources(
        ListSource(train), ListSource(test), "cpu", inner_product=inner_product, batch_size=2
    )
    expected = _expanded(train[0][1]) @ torch.cat([_expanded(b) for _s, b, _i in test]).T
    torch.testing.assert_close(scores, expected)


def test_one_test_block_after_merging_gets_no_dense_cache():
    g = gen(6)
    train = train_blocks([2, 2])
    test = [(0, dense(torch.randn(2, D, generator=g)), ids("te", 2, 2 * k)) for k in range(3)]
    recorder = Recorder()
    scores, *_ = score_sources(
        ListSource(train), ListSource(test), "cpu", inner_product=recorder, batch_size=2
    )
    assert [(c[1], c[2]) for c in recorder.calls] == [(6, None), (6, None)]
    torch.testing.assert_close(scores, stacked(train) @ stacked(test).T)


def test_repeated_column_id_last_write_wins():
    g = gen(7)
    train = train_blocks([2])
    x1, x2 = torch.randn(3, D, generator=g), torch.randn(2, D, generator=g)
    a, gr = torch.randn(2, 1, generator=g), torch.randn(2, 3, generator=g)
    fact = factorized(a, gr)
    # "a" repeats inside the first block and again in a later (unmerged) block
    test = [(0, dense(x1), ["a", "b", "a"]), (0, fact, ["c", "a"]), (0, dense(x2), ["b", "d"])]
    scores, _r, _s, test_ids, _t = score_sources(
        ListSource(train), ListSource(test), "cpu", inner_product=Recorder()
    )
    assert test_ids == ["a", "b", "c", "d"]
    tr = stacked(train)
    fact_rows = rows_of(fact)
    expected = torch.stack([tr @ fact_rows[1], tr @ x2[0], tr @ fact_rows[0], tr @ x2[1]], dim=1)
    torch.testing.assert_close(scores, expected)


def test_transforms_apply_per_side():
    train = train_blocks([2])
    test = [(0, block, i) for _s, block, i in train_blocks([3], seed=1)]
    scores, *_ = score_sources(
        ListSource(train),
        ListSource(test),
        "cpu",
        inner_product=Recorder(),
        transform_train=lambda b: dense(2 * rows_of(b)),
        transform_test=lambda b: dense(-3 * rows_of(b)),
    )
    torch.testing.assert_close(scores, -6 * stacked(train) @ stacked(test).T)


class Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self, block):
        self.calls += 1
        return block


def test_loop_over_test_restreams_and_retransforms():
    train = train_blocks([1, 1, 1])
    test = [(0, block, i) for _s, block, i in train_blocks([2, 2], seed=1)]
    source = ListSource(test)
    transform = Counting()
    recorder = Recorder()
    scores, *_ = score_sources(
        ListSource(train),
        source,
        "cpu",
        inner_product=recorder,
        loop_over_test=True,
        transform_test=transform,
    )
    assert source.passes == 1 + 3  # column pass, then one pass per train block
    assert transform.calls == 2 * 3  # the column pass is not transformed
    assert [c[1] for c in recorder.calls] == [2, 2] * 3  # no merging
    caches = [c[2] for c in recorder.calls]
    assert all(isinstance(c, TensorCache) for c in caches)
    assert caches[0] is caches[1] and caches[1] is not caches[2]
    torch.testing.assert_close(scores, stacked(train) @ stacked(test).T)


def test_loop_over_test_single_test_block_still_gets_a_cache():
    train = train_blocks([1, 1])
    test = [(0, block, i) for _s, block, i in train_blocks([2], seed=1)]
    recorder = Recorder()
    score_sources(
        ListSource(train), ListSource(test), "cpu", inner_product=recorder, loop_over_test=True
    )
    assert all(isinstance(c[2], TensorCache) for c in recorder.calls)


def test_loop_over_test_needs_reusable_source():
    test = [(0, block, i) for _s, block, i in train_blocks([2], seed=1)]
    with pytest.raises(ValueError, match="reusable"):
        score_sources(
            ListSource(train_blocks([1])),
            ListSource(test, reusable=False),
            "cpu",
            inner_product=Recorder(),
            loop_over_test=True,
        )


class ChangingSource(ListSource):
    """Yields new identifiers from its second pass on."""

    def __iter__(self):
        self.passes += 1
        suffix = "" if self.passes == 1 else "-new"
        return iter([(s, b, [h + suffix for h in i]) for s, b, i in self.blocks])


def test_loop_over_test_unseen_id_is_a_key_error():
    test = [(0, block, i) for _s, block, i in train_blocks([2], seed=1)]
    with pytest.raises(KeyError, match="-new"):
        score_sources(
            ListSource(train_blocks([1])),
            ChangingSource(test),
            "cpu",
            inner_product=Recorder(),
            loop_over_test=True,
        )


@pytest.mark.parametrize(
    ("granularity", "loop_over_test", "last", "transformed"),
    [("instance", False, None, 2), ("token", False, [], 2), ("instance", True, None, 0)],
)
def test_empty_train_source(granularity, loop_over_test, last, transformed):
    test = [(0, block, i) for _s, block, i in train_blocks([2, 1], seed=1)]
    source = ListSource(test)
    transform = Counting()
    result = score_sources(
        ListSource([]),
        source,
        "cpu",
        inner_product=Recorder(),
        transform_test=transform,
        loop_over_test=loop_over_test,
        granularity=granularity,
        inner_product_per_token=lambda train_rep, test_rep: None,
    )
    scores, row_ids, row_steps, test_ids, row_tokens = result
    assert scores.shape == (0, 3) and scores.dtype == torch.float32
    assert (row_ids, row_steps, test_ids, row_tokens) == ([], [], ids("tr", 3), last)
    assert source.passes == 1 and transform.calls == transformed


def test_token_granularity_rows_ids_steps_and_token_ids():
    g = gen(8)
    x1 = torch.randn(2, 4, D, generator=g)  # B=2, T=4
    x2 = torch.randn(1, 2, D, generator=g)  # B=1, T=2
    train = [
        (
            3,
            Gradient(
                {"fc": "materialized"}, {"fc": x1}, {"fc": "nn.Linear"}, {"fc": "batch_token"}
            ),
            ["p", "q"],
        ),
        (
            7,
            Gradient(
                {"fc": "materialized"}, {"fc": x2}, {"fc": "nn.Linear"}, {"fc": "batch_token"}
            ),
            ["r"],
        ),
    ]
    test_x = torch.randn(3, D, generator=g)
    test = [(0, dense(test_x), ["u", "v", "w"])]

    def per_token(train_rep, test_rep):  # two positional arguments, no dense_cache
        return torch.einsum("btd,jd->btj", train_rep.data["fc"], test_rep.data["fc"])

    scores, row_ids, row_steps, test_ids, row_tokens = score_sources(
        ListSource(train),
        ListSource(test),
        "cpu",
        inner_product=Recorder(),
        granularity="token",
        inner_product_per_token=per_token,
    )
    expected = torch.cat([x1.reshape(8, D), x2.reshape(2, D)]) @ test_x.T
    torch.testing.assert_close(scores, expected)
    assert row_ids == ["p"] * 4 + ["q"] * 4 + ["r"] * 2
    assert row_steps == [3] * 8 + [7] * 2
    assert row_tokens == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert test_ids == ["u", "v", "w"]


def test_granularity_errors():
    train, test = ListSource(train_blocks([1])), ListSource(train_blocks([1], seed=1))
    with pytest.raises(ValueError, match="must be one of"):
        score_sources(train, test, "cpu", inner_product=Recorder(), granularity="sample")
    with pytest.raises(ValueError, match="inner_product_per_token"):
        score_sources(train, test, "cpu", inner_product=Recorder(), granularity="token")


def test_wrong_inner_product_shape_is_refused():
    train, test = ListSource(train_blocks([2])), ListSource(train_blocks([3], seed=1))
    with pytest.raises(ValueError, match=r"inner_product returned .*\(2, 3\)"):
        score_sources(
            train,
            test,
            "cpu",
            inner_product=lambda tr, te, dense_cache: torch.ones(3, 2),
            batch_size=2,
        )


# ---------------------------------------------------------------------------- attributor level
def _attributor(tmp_path) -> TracInAttributor:
    return TracInAttributor(
        AttributionArguments(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2)
    )


class Untouchable:
    reusable = True

    def __iter__(self):
        raise AssertionError("the train source must not be iterated")


def test_attributor_refuses_empty_sides(tmp_path):
    attributor = _attributor(tmp_path)
    test = ListSource(train_blocks([2], seed=1))
    with pytest.raises(ValueError, match="training set is empty"):
        attributor.score_sources(ListSource([]), test)
    with pytest.raises(ValueError, match="test set is empty"):
        attributor.score_sources(Untouchable(), ListSource([]))


def test_attributor_scores_through_the_free_function(tmp_path):
    train = train_blocks([1, 2, 1])
    test = [(0, block, i) for _s, block, i in train_blocks([2, 2], seed=1)]
    test = [(s, b, ids("te", 2, 2 * k)) for k, (s, b, _i) in enumerate(test)]
    attributor = _attributor(tmp_path)
    scores, row_ids, row_steps, test_ids, row_tokens = attributor.score_sources(
        ListSource(train), ListSource(test)
    )
    torch.testing.assert_close(scores, stacked(train) @ stacked(test).T)
    assert row_ids == ids("tr", 4) and row_steps == [10, 11, 11, 12]
    assert test_ids == ids("te", 4) and row_tokens is None
    assert attributor.scored_layers == ["fc"]


# ---------------------------------------------------------------------------- collect_gradients
class Streamer:
    """Streamer stand-in: ``args``, ``hook_manager.sample_id_key``, ``with``, iteration."""

    def __init__(self, blocks, *, async_disk_write=None):
        self.blocks = blocks
        if async_disk_write is not None:
            self.args = SimpleNamespace(async_disk_write=async_disk_write)
        self.hook_manager = SimpleNamespace(sample_id_key="idx")
        self.entered = self.exited = 0

    def __enter__(self):
        self.entered += 1
        return self

    def __exit__(self, *exc):
        self.exited += 1
        return False

    def __iter__(self):
        assert self.entered == 1 and not self.exited, "iterated outside `with streamer:`"
        return iter(self.blocks)


class Store:
    """Store stand-in with only ``save_bulk``; records each group and the writing thread."""

    def __init__(self, *, delay=0.0, fail=False):
        self.groups = []
        self.threads = []
        self.delay = delay
        self.fail = fail

    def save_bulk(self, records):
        time.sleep(self.delay)
        if self.fail:
            raise OSError("disk full")
        self.groups.append(list(records))
        self.threads.append(threading.current_thread().name)
        return "handle"


def _stream_blocks(n):
    blocks = train_blocks([2] * n)
    blocks[1] = (blocks[1][0], blocks[1][1], "one-id")  # a single identifier, kept as yielded
    return blocks


def test_collect_groups_records_and_calls_on_block():
    blocks = _stream_blocks(5)
    store = Store()
    seen = []
    streamer = Streamer(blocks)  # no `args`: synchronous writes

    def on_block(step, grad, hashes):
        seen.append((step, grad, hashes, sum(len(g) for g in store.groups)))

    assert collect_gradients(streamer, store, offload_interval=2, on_block=on_block) is store
    assert streamer.entered == streamer.exited == 1
    assert [len(group) for group in store.groups] == [2, 2, 1]
    records = [r for group in store.groups for r in group]
    for record, (step, grad, hashes) in zip(records, blocks):
        assert isinstance(record, GradientRecord)
        assert record.step == step and record.gradient is grad and record.input_hash is hashes
        assert record.sample_id_key == "idx"
    # on_block saw every block before its group was saved
    assert [(s, g, h) for s, g, h, _n in seen] == blocks
    assert [n for *_rest, n in seen] == [0, 0, 2, 2, 4]
    assert store.threads == ["MainThread"] * 3


def test_collect_rejects_bad_interval_before_touching_anything():
    streamer = Streamer(_stream_blocks(2))
    with pytest.raises(ValueError, match="offload_interval"):
        collect_gradients(streamer, Store(), offload_interval=0)
    assert streamer.entered == 0


class NoArgs(Streamer):
    @property
    def args(self):
        raise AssertionError("args must not be read when async_write is given")


@pytest.mark.parametrize(
    ("streamer_flag", "async_write", "thread"),
    [
        (True, None, "dattri-llm-gradient-writer"),
        (False, None, "MainThread"),
        (None, True, "dattri-llm-gradient-writer"),
        (None, False, "MainThread"),
    ],
)
def test_collect_async_choice(streamer_flag, async_write, thread):
    blocks = _stream_blocks(3)
    if async_write is None:
        streamer = Streamer(blocks, async_disk_write=streamer_flag)
    else:
        streamer = NoArgs(blocks)
    store = Store(delay=0.05)
    collect_gradients(streamer, store, async_write=async_write)
    # the writer was drained before returning
    assert [[r.step for r in group] for group in store.groups] == [[10], [11], [12]]
    assert store.threads == [thread] * 3


def test_collect_async_reraises_a_write_error():
    streamer = Streamer(_stream_blocks(3), async_disk_write=True)
    with pytest.raises(OSError, match="disk full"):
        collect_gradients(streamer, Store(fail=True))
    assert streamer.exited == 1
    assert "dattri-llm-gradient-writer" not in [t.name for t in threading.enumerate()]


def test_stacked_batches_equal_their_concatenation_and_are_released():
    import weakref

    from dattri_llm.attribution.scoring import _stacked

    batches = [torch.randn(3, 4), torch.randn(5, 4, dtype=torch.float64), torch.randn(0, 4)]
    expected = torch.cat(batches)
    refs = [weakref.ref(b) for b in batches]
    out = _stacked(batches, 4)
    assert batches == []
    assert out.dtype == expected.dtype and torch.equal(out, expected)
    assert all(ref() is None for ref in refs)
    assert _stacked([], 4).shape == (0, 4)
