"""``attribute --method trak | datainf | influence``: live runs equal the library's own call.

TRAK and DataInf on the tiny GPT-2 of the shared corpus (one small layer each);
the influence functions on a tiny Llama (its projections are ``nn.Linear``, which
the exact Hessian needs), one 64-parameter layer, conjugate gradients.
"""

from __future__ import annotations

import pytest
import torch
from cli_helpers import QUERIES, TRAIN, fails, nothing_written, write_jsonl, write_model
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dattri_llm.attribution.algorithm.datainf import DataInfAttributor
from dattri_llm.attribution.algorithm.influence import InfluenceFunctionAttributor
from dattri_llm.attribution.algorithm.trak import TRAKAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.cli import main
from dattri_llm.cli.arguments import DataArguments, ModelArguments
from dattri_llm.cli.data import load_records, tokenize
from dattri_llm.cli.model import causal_lm_loss, load_model
from dattri_llm.gradient.hooks.config import HookManagerConfig
from dattri_llm.task import AttributionTask

LAYERS = {"trak": r"^transformer\.ln_f$", "datainf": r"h\.1\.attn\.c_proj",
          "influence": r"layers\.0\.self_attn\.q_proj"}  # fmt: skip


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("live_methods")
    paths = {
        "root": root,
        "gpt2": write_model(root / "gpt2"),
        "train": write_jsonl(root / "train.jsonl", [{"text": t} for t in TRAIN]),
        "query": write_jsonl(root / "query.jsonl", [{"text": t} for t in QUERIES]),
    }
    tokenizer = AutoTokenizer.from_pretrained(paths["gpt2"])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    paths["llama"] = root / "llama"
    LlamaForCausalLM(config).save_pretrained(paths["llama"])
    tokenizer.save_pretrained(paths["llama"])
    return paths


def live_argv(ws, model, method, out, *extra):
    return ["attribute", "--model", str(ws[model]), "--train_data", str(ws["train"]),
            "--query_data", str(ws["query"]), "--method", method, "--linear_io", LAYERS[method],
            "--use_cpu", "--quiet", "--output_dir", str(out), *extra]  # fmt: skip


def library_score(ws, model_name, build):
    """The library's live ``attribute`` over the same model, data and layer selection."""
    model, tokenizer = load_model(ModelArguments(model=str(ws[model_name])), quiet=True)
    data = DataArguments(train_data=str(ws["train"]), query_data=str(ws["query"]))
    train, query = (
        tokenize(load_records(str(ws[side])), tokenizer, data, side) for side in ("train", "query")
    )
    args = AttributionArguments(output_dir=str(ws["root"] / "lib"), use_cpu=True)
    attributor, method, options = build(args, model, train)
    task_config = HookManagerConfig(linear_io=[LAYERS[method]])
    return attributor.attribute(
        train.samples, query.samples, hook_config=task_config, verbose=False, **options
    )


def test_trak_equals_the_library(ws, tmp_path, capsys):
    out = tmp_path / "trak"
    assert main(live_argv(ws, "gpt2", "trak", out, "--damping", "0.5")) == 0
    assert "TRAK: 8 training rows x 2 queries" in capsys.readouterr().out

    def build(args, model, train):
        task = AttributionTask(loss_func=causal_lm_loss, model=model)
        return TRAKAttributor(args, task=task, damping=0.5), "trak", {}

    expected = library_score(ws, "gpt2", build)
    score = AttributionScore.load(out)
    assert score.algorithm == "TRAK" and score.train_ids == expected.train_ids
    torch.testing.assert_close(score.scores, expected.scores, rtol=1e-6, atol=0)


def test_datainf_equals_the_library(ws, tmp_path, capsys):
    out = tmp_path / "datainf"
    assert main(live_argv(ws, "gpt2", "datainf", out)) == 0
    capsys.readouterr()

    def build(args, model, train):
        task = AttributionTask(loss_func=causal_lm_loss, model=model)
        memory = {"gradient_cache_residency": "memory"}
        return DataInfAttributor(args, task=task), "datainf", memory

    expected = library_score(ws, "gpt2", build)
    score = AttributionScore.load(out)
    assert score.algorithm == "DataInf"
    torch.testing.assert_close(score.scores, expected.scores, rtol=1e-6, atol=0)


def test_influence_equals_the_library(ws, tmp_path, capsys):
    out = tmp_path / "influence"
    argv = live_argv(ws, "llama", "influence", out, "--damping", "0.1")
    assert main(argv) == 0
    capsys.readouterr()

    def build(args, model, train):
        model.set_attn_implementation("eager")
        task = AttributionTask(loss_func=causal_lm_loss, model=model)
        batches = [{k: v.unsqueeze(0) for k, v in s.items()} for s in train.samples]
        attributor = InfluenceFunctionAttributor(
            args, task=task, hessian_batches=batches, solver="cg", damping=0.1
        )
        return attributor, "influence", {"gradient_cache_residency": "memory"}

    expected = library_score(ws, "llama", build)
    score = AttributionScore.load(out)
    assert score.algorithm == "InfluenceFunction"
    torch.testing.assert_close(score.scores, expected.scores, rtol=1e-6, atol=0)
    # The inverse Hessian acts: the scores are not Grad-Dot's.
    plain = tmp_path / "graddot"
    graddot = live_argv(ws, "llama", "influence", plain)
    graddot[graddot.index("--method") + 1] = "graddot"
    assert main(graddot) == 0
    assert not torch.allclose(AttributionScore.load(plain).scores, score.scores, rtol=1e-3)
    capsys.readouterr()


def test_refusals_are_one_line(ws, tmp_path, capsys):
    out = tmp_path / "out"
    capture = tmp_path / "captured"
    argv = ["capture", "--model", str(ws["gpt2"]), "--train_data", str(ws["train"]),
            "--query_data", str(ws["query"]), "--linear_io", LAYERS["datainf"], "--use_cpu",
            "--quiet", "--output_dir", str(capture)]  # fmt: skip
    assert main(argv) == 0
    for method in ("trak", "datainf", "influence"):
        err = fails(["attribute", "--store", str(capture), "--method", method, "--quiet",
                     "--output_dir", str(out)], capsys)  # fmt: skip
        assert f"{method} runs only as a live attribute" in err
        err = fails(["top-k", "--store", str(capture), "--method", method, "--quiet",
                     "--output_dir", str(out)], capsys)  # fmt: skip
        assert "top-k --store does not serve it" in err
    err = fails(live_argv(ws, "gpt2", "influence", out, "--influence_solver", "newton"), capsys, 2)
    assert "--influence_solver must be one of ['cg', 'lissa', 'direct']" in err
    err = fails(live_argv(ws, "gpt2", "trak", out, "--fit", str(capture)), capsys)
    assert "--fit is for kfac, ekfac, lorif; trak has no fit" in err
    bad_layer = live_argv(ws, "gpt2", "influence", out)
    bad_layer[bad_layer.index("--linear_io") + 1] = r"h\.0\.attn\.c_proj"
    assert "is Conv1D, not nn.Linear" in fails(bad_layer, capsys)
    nothing_written(out)
