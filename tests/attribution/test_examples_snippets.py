"""The documented TracIn / K-FAC usage patterns run as written, checked against references.

Each snippet below is the documented usage code verbatim; only the model and data
construction around it (``net``, ``loader``, ``opt``, ``train()``, ``lm``,
datasets, the query store the first snippet reads) is supplied by ``SETUP``
code. Scores are compared with dense references from ``tests/reference.py``
(loop of single-sample backward passes) and ``tests/kfac_helpers.py``.
"""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch
from kfac_helpers import kfac_operator
from reference import per_sample_loop_grads
from torch import nn

from dattri_llm import (
    REGISTER_ALL,
    AttributionArguments,
    AttributionTask,
    GradientStorageManager,
    KFACAttributor,
    TracInAttributor,
    hash_sample,
)

# ---------------------------------------------------------------------------- snippets (verbatim)
CAPTURE_FROM_LOOP = """
from dattri_llm import (REGISTER_ALL, GradientStorageManager, HookManager,
                        HookManagerConfig, OffloadCallback)

store = GradientStorageManager("runs/train_grads")
manager = HookManager(net, config=HookManagerConfig(linear_io=REGISTER_ALL),
                      callbacks=[OffloadCallback(offload_interval=4, file_manager=store,
                                                 recording_type="per_sample")])
with manager.collect(deregister_on_exit=True):
    for xb, yb in loader:
        opt.zero_grad()
        ((net(xb) - yb) ** 2).sum().backward()   # sum loss: per-sample grad = dℓ_i/dW
        opt.step()
"""

SCORE_FROM_DISK = """
from dattri_llm import AttributionArguments, TracInAttributor
args = AttributionArguments(output_dir="runs/scores", use_cpu=True)
score = TracInAttributor(args).attribute_from_cache("runs/train_grads", "runs/test_grads")
ids, m = score.agnostic_matrix()          # m: (num_train, num_test)
cos = TracInAttributor(args).attribute_from_cache("runs/train_grads", "runs/test_grads",
                                                  normalized_grad=True)   # GradCos
"""

LOOKUP_BY_CONTENT = """
from dattri_llm import hash_sample
h = hash_sample({"_arg0": x_i})            # positional model input → key "_arg0"
row = score.query([h])                     # (1, num_test)
steps = store.lookup_by_hash(h)            # [(step, sample_idx), ...]
g = store.load_sample_by_hash(h, *steps[0])   # Gradient, batch size 1
"""

ONE_CALL_LIVE = """
from dattri_llm import AttributionArguments, AttributionTask, KFACAttributor

def loss(model, batch):
    return model(**batch).loss * batch["input_ids"].shape[0]

task = AttributionTask(loss_func=loss, model=lm)          # current weights
kfac = KFACAttributor(AttributionArguments(output_dir="out"), task=task)
score = kfac.attribute(train_ds, test_ds, damping=1e-3, gradient_cache_residency="memory")
"""

TOKEN_LEVEL = """
score = TracInAttributor(args, task=task).attribute(train_ds, test_ds,
                                                    attribution_granularity="token")
positions, per_pos = score.token_scores(train_hash)   # (len(positions), num_test)
"""

KFAC_COVARIANCES_AT_CAPTURE = """
from dattri_llm import KroneckerCovarianceCallback
cov = KroneckerCovarianceCallback()
with HookManager(net, callbacks=[cov, OffloadCallback(1, store)]).collect(deregister_on_exit=True):
    train()
kf = KFACAttributor(args)
fdir = kf.fit("runs/train_grads", covariances=cov.result())
s1 = kf.attribute_from_cache("runs/train_grads", "runs/test_grads", fisher_dir=fdir, damping=1e-2)
"""

# ---------------------------------------------------------------------------- setup code
MLP_SETUP = """
import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
initial_net = copy.deepcopy(net)
x, y = torch.randn(8, 4), torch.randn(8, 2)
x_test, y_test = torch.randn(3, 4), torch.randn(3, 2)
loader = [(x[i : i + 4], y[i : i + 4]) for _ in range(2) for i in (0, 4)]  # 2 epochs, 4 steps
opt = torch.optim.SGD(net.parameters(), lr=0.05)
"""

# Query gradients at the final weights, captured the way the snippet captures training.
QUERY_CAPTURE = """
from dattri_llm import GradientStorageManager, HookManager, HookManagerConfig, OffloadCallback

test_store = GradientStorageManager("runs/test_grads")
with HookManager(net, config=HookManagerConfig(linear_io=REGISTER_ALL),
                 callbacks=[OffloadCallback(1, test_store, recording_type="per_sample")]
                 ).collect(deregister_on_exit=True):
    net.zero_grad()
    ((net(x_test) - y_test) ** 2).sum().backward()
"""

LAYERS = ("0", "2")


def sq_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    """Sum-reduced squared error (per-sample gradient = ∇ℓ_i)."""
    inputs, targets = batch
    return ((model(inputs) - targets) ** 2).sum()


def flat_grads(grads: dict[str, torch.Tensor], layers=LAYERS) -> torch.Tensor:
    """Per-sample ``[W | b]`` rows of each layer, concatenated: ``(B, Σ d)``."""
    blocks = []
    for name in layers:
        w, b = grads[f"{name}.weight"], grads[f"{name}.bias"]
        blocks.append(torch.cat([w, b.unsqueeze(-1)], dim=2).flatten(1))
    return torch.cat(blocks, dim=1)


def replay(ns: dict) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
    """Re-run the snippet's training on a copy of the initial net.

    Returns per step ``(x_batch, per-sample grads (B, d), layer inputs {layer: (B, K)})``.
    """
    net = copy.deepcopy(ns["initial_net"])
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    inputs: dict[str, torch.Tensor] = {}
    for name in LAYERS:
        net.get_submodule(name).register_forward_hook(
            lambda _m, i, _o, n=name: inputs.__setitem__(n, i[0].detach())
        )
    steps = []
    for xb, yb in ns["loader"]:
        grads = flat_grads(per_sample_loop_grads(net, sq_loss, (xb, yb)))
        net(xb)
        steps.append((xb, grads, dict(inputs)))
        opt.zero_grad()
        sq_loss(net, (xb, yb)).backward()
        opt.step()
    return steps


def query_grads(ns: dict) -> torch.Tensor:
    """Per-sample query gradients ``(num_test, d)`` at the snippet's final weights."""
    return flat_grads(per_sample_loop_grads(ns["net"], sq_loss, (ns["x_test"], ns["y_test"])))


def run(code: str, ns: dict) -> dict:
    """``exec`` dedented ``code`` in the shared namespace ``ns``."""
    exec(textwrap.dedent(code), ns)  # noqa: S102
    return ns


def agnostic_reference(ns, steps, row_score, ids: list[str]) -> torch.Tensor:
    """``Σ_steps row_score(step grads, step index)`` per sample, rows in ``ids`` order."""
    total = {hash_sample({"_arg0": x_i}): 0.0 for x_i in ns["x"]}
    for k, (xb, grads, _inputs) in enumerate(steps):
        values = row_score(grads, k)
        for row, x_i in enumerate(xb):
            h = hash_sample({"_arg0": x_i})
            total[h] = total[h] + values[row]
    return torch.stack([total[h] for h in ids])


def check_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale)


@pytest.fixture
def disk_run(tmp_path, monkeypatch):
    """Namespace after the capture, query capture and score-from-disk snippets."""
    monkeypatch.chdir(tmp_path)
    ns: dict = {"copy": copy}
    run(MLP_SETUP, ns)
    run(CAPTURE_FROM_LOOP, ns)
    run(QUERY_CAPTURE, ns)
    run(SCORE_FROM_DISK, ns)
    return ns


def test_capture_then_score_from_disk(disk_run, tmp_path):
    ns = disk_run
    steps, query = replay(ns), query_grads(ns)
    assert ns["store"].available_steps() == [0, 1, 2, 3]
    assert ns["m"].shape == (8, 3) and len(set(ns["ids"])) == 8
    expected = agnostic_reference(ns, steps, lambda grads, _k: grads @ query.T, ns["ids"])
    check_close(ns["m"], expected)

    def cosine(grads, _k):
        return grads @ query.T / (torch.outer(grads.norm(dim=1), query.norm(dim=1)) + 1e-8)

    cos_ids, cos_matrix = ns["cos"].agnostic_matrix()
    assert cos_ids == ns["ids"] and ns["cos"].algorithm == "GradCos"
    check_close(cos_matrix, agnostic_reference(ns, steps, cosine, cos_ids))
    assert ns["score"].algorithm == "TracIn" and ns["cos"].algorithm_meta["normalized_grad"]
    assert (tmp_path / "runs" / "scores" / "metadata.json").is_file()


def test_look_a_sample_up_by_content(disk_run):
    ns = disk_run
    ns["x_i"] = ns["x"][5]
    run(LOOKUP_BY_CONTENT, ns)
    assert ns["row"].shape == (1, 3)
    torch.testing.assert_close(ns["row"][0], ns["m"][ns["ids"].index(ns["h"])])
    # sample 5 is in the second batch of each epoch; "per_sample" records hold one row each
    assert ns["steps"] == [(1, 0), (3, 0)]
    g = ns["g"]
    assert g.batch_size == 1
    stored = g.materialize()
    flat = torch.cat([stored.data[name].reshape(1, -1) for name in LAYERS], dim=1)
    _xb, grads, _inputs = replay(ns)[1]
    torch.testing.assert_close(flat, grads[1:2], rtol=1e-5, atol=1e-6)


def test_kfac_covariances_at_capture_fit_once_redamp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns: dict = {"copy": copy, "REGISTER_ALL": REGISTER_ALL}
    run(MLP_SETUP, ns)
    query = query_grads(ns)  # the queries are captured at the initial weights
    run(QUERY_CAPTURE, ns)
    ns["args"] = AttributionArguments(output_dir="runs/scores", use_cpu=True)
    ns["store"] = GradientStorageManager("runs/train_grads")
    ns["KFACAttributor"] = KFACAttributor

    def train() -> None:
        for xb, yb in ns["loader"]:
            ns["opt"].zero_grad()
            sq_loss(ns["net"], (xb, yb)).backward()
            ns["opt"].step()

    ns["train"] = train
    run(KFAC_COVARIANCES_AT_CAPTURE, ns)
    s2 = ns["kf"].attribute_from_cache(
        "runs/train_grads", "runs/test_grads", fisher_dir=ns["fdir"], damping=1e-1
    )

    steps = replay(ns)
    operators = []
    for name, offset, width in (("0", 0, 6 * 5), ("2", 6 * 5, 2 * 7)):
        a = torch.cat(
            [torch.cat([inp[name], torch.ones(len(inp[name]), 1)], 1) for *_, inp in steps]
        )
        # one token per sample: the output gradient is the bias gradient (last column of [W | b])
        g = torch.cat([grads[:, offset : offset + width].reshape(len(grads), -1, a.shape[1])
                       for _, grads, _ in steps])[..., -1]  # fmt: skip
        operators.append((slice(offset, offset + width), (a.T @ a / len(a)).double(),
                          (g.T @ g / len(g)).double()))  # fmt: skip

    def kfac_scores(damping: float, ids: list[str]) -> torch.Tensor:
        def row_score(grads, _k):
            total = sum(
                grads[:, block].double() @ kfac_operator(a_cov, g_cov, damping)
                @ query[:, block].double().T
                for block, a_cov, g_cov in operators
            )  # fmt: skip
            return total.float()

        return agnostic_reference(ns, steps, row_score, ids)

    assert ns["fdir"].resolve() == tmp_path / "runs" / "scores" / "kfac_fisher"
    assert (ns["fdir"] / "fisher_factors.pt").is_file()
    ids1, m1 = ns["s1"].agnostic_matrix()
    check_close(m1, kfac_scores(1e-2, ids1), rtol=1e-4)
    ids2, m2 = s2.agnostic_matrix()
    check_close(m2, kfac_scores(1e-1, ids2), rtol=1e-4)
    assert ns["s1"].algorithm == "KFAC" and ns["s1"].algorithm_meta["damping"] == 1e-2


# ---------------------------------------------------------------------------- live snippets
def dict_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Sum-reduced squared error on dict batches (the model is called positionally)."""
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


def test_token_level_scores(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from attribution_helpers import MLP, MLP_LAYERS

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = MLP()  # per-token linear layers on (B, T=3, 4)
    x, y, x_test, y_test = (torch.randn(n, 3, d) for n, d in ((5, 4), (5, 3), (2, 4), (2, 3)))
    ns = {
        "TracInAttributor": TracInAttributor,
        "args": AttributionArguments(
            output_dir="runs/scores", use_cpu=True, per_device_train_batch_size=2
        ),
        "task": AttributionTask(dict_loss, model),
        "train_ds": [{"x": x[i], "y": y[i]} for i in range(5)],
        "test_ds": [{"x": x_test[i], "y": y_test[i]} for i in range(2)],
        "train_hash": hash_sample({"_arg0": x[1]}),
    }
    run(TOKEN_LEVEL, ns)

    # The layers act per token, so position t's share of a sample's gradient is the
    # gradient of that position's loss alone: single-token samples give the reference.
    tokens = (x.reshape(15, 1, 4), y.reshape(15, 1, 3))
    token_grads = flat_grads(per_sample_loop_grads(model, sq_loss, tokens), MLP_LAYERS)
    query = flat_grads(per_sample_loop_grads(model, sq_loss, (x_test, y_test)), MLP_LAYERS)
    expected = (token_grads @ query.T).reshape(5, 3, 2)
    assert ns["positions"] == [0, 1, 2]
    check_close(ns["per_pos"], expected[1])
    score = ns["score"]
    assert score.granularity == "token" and score.row_token_ids == [0, 1, 2] * 5
    ids, summed = score.agnostic_matrix()
    assert ids == [hash_sample({"_arg0": x_i}) for x_i in x]
    check_close(summed, expected.sum(dim=1))


GPT2_SETUP = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
lm = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=64,
                                bos_token_id=0, eos_token_id=0))
lm = lm.to("cuda" if torch.cuda.is_available() else "cpu")
ids = torch.randint(0, 97, (6, 8))
train_ds = [{"input_ids": i, "labels": i} for i in ids[:4]]
test_ds = [{"input_ids": i, "labels": i} for i in ids[4:]]
"""


@pytest.fixture
def single_thread():
    """Run on one thread: small eigendecompositions stall on busy 2-core machines otherwise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_one_call_live_kfac(tmp_path, monkeypatch, single_thread):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    run(GPT2_SETUP, ns)
    with pytest.warns(UserWarning):  # the batch-collapsed position embedding is named
        run(ONE_CALL_LIVE, ns)
    score = ns["score"]
    assert score.algorithm == "KFAC" and score.scores.shape == (4, 2)
    assert torch.isfinite(score.scores).all() and score.scores.abs().sum() > 0
    assert (tmp_path / "out" / "scores.pt").is_file()
    # Live re-runs per pass and the disk cache are other code paths to the same scores.
    for residency in (None, "disk"):
        with pytest.warns(UserWarning):
            other = ns["kfac"].attribute(
                ns["train_ds"], ns["test_ds"], damping=1e-3, gradient_cache_residency=residency
            )
        assert other.row_train_ids == score.row_train_ids and other.test_ids == score.test_ids
        check_close(other.scores, score.scores, rtol=1e-4)
