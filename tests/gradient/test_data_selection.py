"""DataSelectionCallback: scores, choices and exact removal against independent references."""

from __future__ import annotations

import itertools
import warnings

import data_selection_helpers as h
import pytest
import torch

from dattri_llm.gradient.callbacks.base import HookManagerCallback
from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
from dattri_llm.gradient.callbacks.data_selection_callback import DataSelectionCallback
from dattri_llm.gradient.callbacks.kronecker_covariance_callback import (
    KroneckerCovarianceCallback,
)
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.gradient.hooks.manager import HookManager

BATCH = 6
FRACTION = 0.5


class Spy(HookManagerCallback):
    """Keeps what the selection callback exposed after each step (runs after it)."""

    def __init__(self, selection: DataSelectionCallback) -> None:
        self.selection = selection
        self.seen: list[tuple[torch.Tensor, list[int]]] = []

    def on_step_end(self, record) -> None:
        self.seen.append((self.selection.last_scores.clone(), list(self.selection.last_dropped)))


class Recorder(HookManagerCallback):
    """Every record and layer event it receives."""

    def __init__(self) -> None:
        self.records = []
        self.events = []

    def on_layer_forward(self, layer_name, activation, layer_type, module_kwargs) -> None:
        self.events.append(("fwd", layer_name, activation.clone()))

    def on_layer_backward(self, layer_name, grad_output, layer_type, module_kwargs) -> None:
        self.events.append(("bwd", layer_name, grad_output.clone()))

    def on_step_end(self, record) -> None:
        self.records.append(record)


def capture_gradient(net, data):
    """A captured Gradient of the sum loss of ``data`` (the fixed target)."""
    cap = CaptureCallback()
    with HookManager(net, callbacks=[cap]).collect(deregister_on_exit=True):
        h.batch_loss(net, data, "sum").backward()
    net.zero_grad(set_to_none=True)
    return cap.record.gradient


def val_loader():
    return [h.batch(50, 2), h.batch(51, 2)]


def val_loss(net, data):
    return h.batch_loss(net, data, "sum")


def reference_targets(net, target, micro, query):
    """Per micro-step target ``{param: summed gradient}`` from torch.func, or None (batch)."""
    if target == "batch":
        return [None] * len(micro)
    if target == "fixed":
        return [h.summed(h.per_sample(net, query))] * len(micro)
    loader = val_loader()
    return [h.summed(h.per_sample(net, loader[m % len(loader)])) for m in range(len(micro))]


CASES = list(
    itertools.product(
        ["batch", "fixed", "val_loader"],
        ["ghost", "materialized"],
        [False, True],
        ["hard", "bottom_fraction", "negative_bottom_fraction"],
        [1, 2],
        ["sum", "mean"],
    )
)


@pytest.mark.parametrize(
    ("target", "score_mode", "layer_wise", "mode", "n_micro", "reduction"), CASES
)
def test_param_grads_equal_kept_only_backward(
    target, score_mode, layer_wise, mode, n_micro, reduction
):
    net = h.build()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    micro = [h.batch(10 + m, BATCH) for m in range(n_micro)]
    query = h.batch(99, 3)
    scale = 1.0 / BATCH if reduction == "mean" else 1.0
    renormalize = reduction == "mean"

    # independent expectation: scores per micro-step, their choices, kept-only gradients
    targets = reference_targets(net, target, micro, query)
    per_micro = []
    for data, tgt in zip(micro, targets):
        grads = h.per_sample(net, data)
        tgt = tgt if tgt is not None else h.summed(grads, scale)
        per_micro.append((grads, {k: s * scale for k, s in h.layer_dots(grads, tgt).items()}))
    first_total = sum(per_micro[0][1].values())
    middle = first_total.sort().values[BATCH // 2 - 1 : BATCH // 2 + 1].mean()  # between two scores
    threshold = FRACTION if mode != "hard" else float(middle)

    kwargs = {}
    if target == "fixed":
        kwargs["target_gradient"] = capture_gradient(net, query)
    if target == "val_loader":
        kwargs.update(val_loader=val_loader(), val_loss_fn=val_loss)
    selection = DataSelectionCallback(
        net,
        target=target,
        renormalize=renormalize,
        scoring_kwargs={"score_mode": score_mode},
        selection_kwargs={"threshold": threshold, "threshold_mode": mode, "layer_wise": layer_wise},
        **kwargs,
    )
    spy = Spy(selection)
    with HookManager(net, callbacks=[selection, spy]).collect():
        for data in micro:
            h.batch_loss(net, data, reduction).backward()

    expected = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    # float32 cancellation error scales with the gradient before removal
    magnitude = {n: sum(float(g[n].abs().sum(0).max()) for g, _ in per_micro) for n in expected}
    for (data, (grads, scores)), (got_scores, got_dropped) in zip(zip(micro, per_micro), spy.seen):
        total = sum(scores.values())
        torch.testing.assert_close(got_scores, total, rtol=1e-5, atol=1e-5 * total.abs().max())
        if layer_wise:
            drops = {layer: h.expected_drop(s, threshold, mode) for layer, s in scores.items()}
            assert got_dropped == sorted(set().union(*drops.values()))
            for layer, names in h.LAYERS.items():
                kept = [i for i in range(BATCH) if i not in drops[layer]]
                weight = (1.0 / len(kept) if kept else 0.0) if renormalize else 1.0
                for n in names:
                    expected[n] += grads[n][kept].sum(dim=0) * weight
        else:
            drop = h.expected_drop(total, threshold, mode)
            assert got_dropped == drop
            kept = [i for i in range(BATCH) if i not in drop]
            for n, g in h.kept_gradient(state, data, kept, reduction).items():
                expected[n] += g
    if mode == "hard":
        assert spy.seen[0][1], "the mid-batch threshold must drop samples"
    for n, p in net.named_parameters():
        torch.testing.assert_close(
            p.grad, expected[n], rtol=1e-5, atol=2e-6 * magnitude[n], msg=lambda m, n=n: f"{n}: {m}"
        )


def test_static_stages_on_a_record():
    net = h.build()
    data = h.batch(3, BATCH)
    cap = CaptureCallback()
    with HookManager(net, callbacks=[cap]).collect():
        h.batch_loss(net, data, "sum").backward()
    grads = h.per_sample(net, data)
    expected = h.layer_dots(grads, h.summed(grads))
    for mode in ("ghost", "materialized"):
        scores = DataSelectionCallback.compute_scores(
            cap.record.gradient, scoring_kwargs={"score_mode": mode}
        )
        assert sorted(scores) == sorted(h.LAYERS)
        for layer, s in scores.items():
            torch.testing.assert_close(s, expected[layer], rtol=1e-5, atol=1e-4)
    scores = torch.tensor([0.5, -2.0, 3.0, -1.0, 0.1, -0.2])
    pick = DataSelectionCallback.select_samples
    assert pick(scores) == [1, 3, 5]
    assert pick(scores, selection_kwargs={"threshold": 0.2}) == [1, 3, 4, 5]
    frac = {"threshold": 0.5, "threshold_mode": "bottom_fraction"}
    assert pick(scores, selection_kwargs=frac) == [1, 3, 5]
    frac = {"threshold": 0.7, "threshold_mode": "negative_bottom_fraction"}  # 4 lowest, 3 < 0
    assert pick(scores, selection_kwargs=frac) == [1, 3, 5]
    assert (
        pick(scores, selection_kwargs={"threshold": 0.0, "threshold_mode": "bottom_fraction"}) == []
    )


def test_validation_pass_does_not_disturb_other_callbacks():
    def run(select: bool):
        net = h.build()
        rec, cov = Recorder(), KroneckerCovarianceCallback()
        callbacks = [rec, cov]
        if select:
            sel = DataSelectionCallback(
                net,
                target="val_loader",
                val_loader=val_loader(),
                val_loss_fn=val_loss,
                selection_kwargs={"threshold": 0.5, "threshold_mode": "bottom_fraction"},
            )
            callbacks.insert(1, sel)
        manager = HookManager(net, callbacks=callbacks)
        with manager.collect():
            for m in range(3):
                h.batch_loss(net, h.batch(20 + m, BATCH), "sum").backward()
            last = manager.get_gradient()
        return rec, cov.result(), manager.steps_collected, last

    plain, with_sel = run(False), run(True)
    assert [r.step for r in with_sel[0].records] == [r.step for r in plain[0].records] == [0, 1, 2]
    assert [r.input_hash for r in with_sel[0].records] == [r.input_hash for r in plain[0].records]
    assert len(with_sel[0].events) == len(plain[0].events)
    for a, b in zip(with_sel[0].events, plain[0].events):
        assert a[:2] == b[:2]
        torch.testing.assert_close(a[2], b[2], rtol=0, atol=0)
    assert plain[1].keys() == with_sel[1].keys()
    for layer in plain[1]:
        for x, y in zip(plain[1][layer], with_sel[1][layer]):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert plain[2] == with_sel[2] == 3
    assert plain[3].layer_names == with_sel[3].layer_names


def test_val_targets_per_pass_splits_one_pass_into_single_row_targets():
    net = h.build()
    loader = [h.batch(60 + i, 1) for i in range(4)]
    passes = []

    def counting_loss(model, data):
        passes.append(data[0].shape[0])
        return val_loss(model, data)

    sel = DataSelectionCallback(
        net,
        target="val_loader",
        val_loader=loader,
        val_loss_fn=counting_loss,
        val_targets_per_pass=2,
        selection_kwargs={"threshold": 0.5, "threshold_mode": "bottom_fraction"},
    )
    spy = Spy(sel)
    micro = [h.batch(30 + m, BATCH) for m in range(3)]
    with HookManager(net, callbacks=[sel, spy]).collect():
        for data in micro:
            net.zero_grad(set_to_none=True)
            h.batch_loss(net, data, "sum").backward()
    assert passes == [2, 2]  # one pass of 2 concatenated batches per 2 steps
    for m, data in enumerate(micro):
        target = h.summed(h.per_sample(net, loader[m % 4]))
        expected = sum(h.layer_dots(h.per_sample(net, data), target).values())
        torch.testing.assert_close(spy.seen[m][0], expected, rtol=1e-5, atol=1e-4)


def test_autocast_selection_is_close_to_kept_only_backward():
    net = h.build()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    data = h.batch(5, BATCH)
    sel = DataSelectionCallback(
        net, selection_kwargs={"threshold": 0.5, "threshold_mode": "bottom_fraction"}
    )
    with HookManager(net, callbacks=[sel]).collect():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(data[0])
        h.sample_losses(out.float(), data[1]).sum().backward()
    assert len(sel.last_dropped) == BATCH // 2
    kept = [i for i in range(BATCH) if i not in sel.last_dropped]
    ref = h.build()
    ref.load_state_dict(state)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ref(data[0][kept])
    h.sample_losses(out.float(), data[1][kept]).sum().backward()
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        scale = q.grad.abs().max()
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=3e-2 * scale, msg=n)


def test_lora_style_adapters_only_frozen_base_untouched():
    net = h.build()
    for p in net.parameters():
        p.requires_grad_(False)
    adapter = torch.nn.Linear(h.OUT, h.OUT)
    model = torch.nn.Sequential(net, adapter)
    data = h.batch(7, BATCH)
    sel = DataSelectionCallback(
        model, selection_kwargs={"threshold": 0.5, "threshold_mode": "bottom_fraction"}
    )
    manager = HookManager(model, callbacks=[sel])
    assert manager.layer_names == ["1"]
    with manager.collect():
        h.sample_losses(model(data[0]), data[1]).sum().backward()
    kept = [i for i in range(BATCH) if i not in sel.last_dropped]
    ref = torch.nn.Linear(h.OUT, h.OUT)
    ref.load_state_dict(adapter.state_dict())
    h.sample_losses(ref(net(data[0][kept])), data[1][kept]).sum().backward()
    torch.testing.assert_close(adapter.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(adapter.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"target": "nope"}, ValueError, "target must be one of"),
        ({"target": "fixed"}, ValueError, "target_gradient"),
        ({"target": "val_loader", "val_loader": [1]}, ValueError, "val_loss_fn"),
        ({"target": "val_loader", "val_loss_fn": val_loss}, ValueError, "val_loader"),
        ({"target_gradient": "g"}, TypeError, "Gradient"),
        ({"scoring_kwargs": {"score_mode": "x"}}, ValueError, "score_mode"),
        ({"scoring_kwargs": {"mode": "ghost"}}, ValueError, "unknown scoring_kwargs"),
        ({"selection_kwargs": {"threshold_mode": "x"}}, ValueError, "threshold_mode"),
        ({"selection_kwargs": {"thresh": 0.1}}, ValueError, "unknown selection_kwargs"),
        (
            {"selection_kwargs": {"threshold": 1.0, "threshold_mode": "bottom_fraction"}},
            ValueError,
            r"\[0, 1\)",
        ),
        (
            {"selection_kwargs": {"threshold": -0.1, "threshold_mode": "negative_bottom_fraction"}},
            ValueError,
            r"\[0, 1\)",
        ),
        ({"selection_kwargs": {"threshold": "0.1"}}, TypeError, "threshold"),
        ({"selection_kwargs": {"layer_wise": 1}}, TypeError, "layer_wise"),
        ({"val_targets_per_pass": 0}, ValueError, "val_targets_per_pass"),
        ({"threshold": 0.1}, TypeError, "threshold"),
    ],
)
def test_invalid_options_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        DataSelectionCallback(h.build(), **kwargs)


def test_hard_with_several_targets_per_pass_warns():
    with pytest.warns(UserWarning, match="val_targets_per_pass"):
        DataSelectionCallback(
            h.build(), target="val_loader", val_loader=[1], val_loss_fn=val_loss,
            val_targets_per_pass=2,
        )  # fmt: skip


def test_unattached_val_loader_target_and_projected_manager_raise():
    net = h.build()
    cap = CaptureCallback()
    with HookManager(net, callbacks=[cap]).collect(deregister_on_exit=True):
        h.batch_loss(net, h.batch(1, 2), "sum").backward()
    sel = DataSelectionCallback(net, target="val_loader", val_loader=[1], val_loss_fn=val_loss)
    with pytest.raises(RuntimeError, match="not attached"):
        sel.on_step_end(cap.record)
    config = HookManagerConfig(projection_kwargs={"__default__": {"style": "logra", "proj_dim": 2}})
    with pytest.raises(ValueError, match="projection_kwargs"):
        HookManager(net, config, callbacks=[DataSelectionCallback(net)])
    with pytest.raises(ValueError, match="capture_style"):
        HookManager(
            net,
            HookManagerConfig(capture_style="materialized"),
            callbacks=[DataSelectionCallback(net)],
        )


def test_unmodified_hf_trainer_with_collect_block(tmp_path):
    """Inside ``Trainer.train()``: the gradient before clipping/step is the kept-only one."""
    pytest.importorskip("transformers")
    from capture_helpers import lm_loss, tiny_gpt2
    from transformers import Trainer, TrainingArguments, default_data_collator

    from dattri_llm.utils.hashing import hash_sample

    rows, seq = 6, 8
    ids = torch.randint(0, 97, (rows, seq), generator=torch.Generator().manual_seed(4))
    model = tiny_gpt2()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sel = DataSelectionCallback(
        model,
        renormalize=True,
        selection_kwargs={"threshold": 0.5, "threshold_mode": "bottom_fraction"},
    )
    seen = {}

    class Grads(HookManagerCallback):
        def on_step_end(self, record):
            seen["hash"] = record.input_hash
            seen["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=rows,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
    )
    data = [{"input_ids": r, "labels": r.clone()} for r in ids]
    trainer = Trainer(
        model=model, args=args, train_dataset=data, data_collator=default_data_collator
    )
    divisors = []
    model.register_forward_pre_hook(
        lambda m, a, kw: divisors.append(kw.get("num_items_in_batch", rows * (seq - 1))),
        with_kwargs=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with HookManager(model, callbacks=[sel, Grads()]).collect():
            trainer.train()
    # The Trainer divides the token-loss sum by num_items_in_batch, the model's loss by
    # the B·(T-1) predicted tokens; renormalize keeps the Trainer's per-token weighting.
    scale = rows * (seq - 1) / float(divisors[0])
    row_of = {hash_sample({"input_ids": r, "labels": r}): i for i, r in enumerate(ids)}
    order = [row_of[x] for x in seen["hash"]]
    assert len(sel.last_dropped) == rows // 2
    kept = [order[i] for i in range(rows) if i not in sel.last_dropped]
    ref = tiny_gpt2()
    ref.load_state_dict(state)
    lm_loss(ref, ids[kept]).backward()
    for n, p in ref.named_parameters():
        if n.startswith("transformer.wpe"):  # positional ids (1, T): batch-level, not removable
            continue
        torch.testing.assert_close(seen["grads"][n], p.grad * scale, rtol=1e-4, atol=1e-6, msg=n)


def test_param_grad_layers_warn_and_keep_their_batch_gradient():
    net = h.build()
    config = HookManagerConfig(hook_types={"head": "param_grad", "conv": "linear_io"})
    sel = DataSelectionCallback(
        net, selection_kwargs={"threshold": 0.5, "threshold_mode": "bottom_fraction"}
    )
    data = h.batch(8, BATCH)
    with pytest.warns(UserWarning, match=r"\['head.bias', 'head.weight'\].*param_grad"):
        with HookManager(net, config, callbacks=[sel]).collect():
            h.batch_loss(net, data, "sum").backward()
    ref = h.build()
    h.batch_loss(ref, data, "sum").backward()
    torch.testing.assert_close(net.head.weight.grad, ref.head.weight.grad, rtol=0, atol=0)
    assert len(sel.last_dropped) == BATCH // 2
