import contextlib
import warnings

import pytest
import torch
from capture_helpers import dense, flat_reference, gpt2_reference, lm_loss, tiny_gpt2

from dattri_llm.gradient.callbacks.capture_callback import CaptureCallback
from dattri_llm.gradient.hooks.manager import HookManager
from dattri_llm.utils.hashing import hash_sample

pytest.importorskip("transformers")

B, T = 4, 8
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def setup():
    ids = torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(1))
    state = {k: v.clone() for k, v in tiny_gpt2().state_dict().items()}
    return ids, state, gpt2_reference(state, ids)


def check_against_reference(gradient, ref, order=None, scale=1.0):
    """Every hooked GPT-2 layer equals its per-use-site per-sample reference (fp32)."""
    assert "transformer.wte" in gradient.layer_names and "lm_head" in gradient.layer_names
    assert not any("@" in name for name in gradient.layer_names)
    for name in gradient.layer_names:
        expected = flat_reference(ref, name, gradient.layer_types[name], B)
        if order is not None:
            expected = expected[order]
        if name == "transformer.wpe":  # positional ids (1, T): batch-summed
            expected = expected.sum(0, keepdim=True)
        expected = expected * scale
        torch.testing.assert_close(dense(gradient, name), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("checkpointing", [None, False, True])
def test_gpt2_loop_tied_embedding_and_checkpointing(setup, checkpointing):
    ids, state, ref = setup
    model = tiny_gpt2()
    model.load_state_dict(state)
    model.train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing}
        )
    cb = CaptureCallback()
    manager = HookManager(model, callbacks=[cb])
    with pytest.warns(UserWarning, match="'transformer.wpe' has batch size 1"):
        with manager.collect():
            lm_loss(model, ids).backward()
    assert manager.steps_collected == 1
    assert cb.record.gradient.layer_types["transformer.h.0.mlp.c_fc"] == (
        "transformers.pytorch_utils.Conv1D"
    )
    check_against_reference(cb.record.gradient, ref)


def train_dataset(ids):
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def trainer_for(model, dataset, tmp_path, callbacks=()):
    from transformers import Trainer, TrainingArguments, default_data_collator

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=B,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
    )
    return Trainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=default_data_collator,
        callbacks=list(callbacks),
    )


def batch_order(record, ids):
    """Row order the Trainer used, recovered from the record's content hashes."""
    row_of = {hash_sample({"input_ids": r, "labels": r}): i for i, r in enumerate(ids)}
    return [row_of[h] for h in record.input_hash]


@pytest.mark.parametrize("pattern", ["with_block", "trainer_callback"])
def test_unmodified_hf_trainer(setup, tmp_path, pattern):
    from transformers import TrainerCallback

    ids, state, ref = setup
    model = tiny_gpt2()
    model.load_state_dict(state)
    records = []

    class Keep(CaptureCallback):
        def on_step_end(self, record):
            records.append(record)

    manager = HookManager(model, callbacks=[Keep()])
    divisors = []

    def read_divisor(module, args, kwargs):
        divisors.append(kwargs.get("num_items_in_batch", B * (T - 1)))

    model.register_forward_pre_hook(read_divisor, with_kwargs=True)

    class CollectCallback(TrainerCallback):
        def __init__(self):
            self.stack = contextlib.ExitStack()

        def on_train_begin(self, args, state, control, **kwargs):
            self.stack.enter_context(manager.collect())

        def on_train_end(self, args, state, control, **kwargs):
            self.stack.close()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if pattern == "with_block":
            trainer = trainer_for(model, train_dataset(ids), tmp_path)
            with manager.collect():
                trainer.train()
        else:
            trainer = trainer_for(model, train_dataset(ids), tmp_path, [CollectCallback()])
            trainer.train()
    assert [r.step for r in records] == [0, 1]
    # The Trainer's scalar is sum(token losses) / num_items_in_batch; the reference is the
    # model's mean over the B·(T-1) predicted tokens, so rescale it to the Trainer's divisor.
    scale = B * (T - 1) / float(divisors[0])
    check_against_reference(records[0].gradient, ref, batch_order(records[0], ids), scale)
    # the second step ran at updated parameters
    assert not torch.equal(
        dense(records[1].gradient, "lm_head"), dense(records[0].gradient, "lm_head")
    )
