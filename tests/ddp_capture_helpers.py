"""Cases and the fork worker for the 2-process DDP capture test (gloo, CPU).

A *case* is a tiny model with its dataset, the hooked layers, a sum loss and a
single-device reference. DDP training replays as: every rank takes its
``DistributedSampler`` shard (``shuffle=False``: rank ``r`` gets rows
``r, r + W, r + 2W, ...``) in per-rank batches of ``BATCH``; the update is one
SGD step with learning rate ``LR`` on the rank-averaged gradient of the sum loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from reference import call, per_sample_param_grads
from torch import nn

WORLD = 2
BATCH = 2
STEPS = 2
N_SAMPLES = WORLD * BATCH * STEPS
LR = 0.5


@dataclass(frozen=True)
class Case:
    """One model + dataset of the DDP capture test.

    ``inputs(x)`` turns a batch (or one sample's) tensor into model kwargs (a dict,
    the fields hashed by the capture), ``loss(model, inputs)`` is the sum loss.
    """

    name: str
    build: Callable[[], nn.Module]
    data: Callable[[], torch.Tensor]
    queries: Callable[[], torch.Tensor]
    layers: tuple[str, ...]
    inputs: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    reference_model: Callable[[nn.Module], nn.Module]


class TokenMLP(nn.Module):
    """Two linear layers applied per token of a ``(B, T, D)`` input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, 4) -> (B, T, 3)``."""
        return self.fc2(torch.tanh(self.fc1(x)))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return TokenMLP()


def _mlp_data() -> torch.Tensor:
    return torch.randn(N_SAMPLES, 3, 4, generator=torch.Generator().manual_seed(1))


def _mlp_queries() -> torch.Tensor:
    return torch.randn(3, 3, 4, generator=torch.Generator().manual_seed(2))


def _mlp_loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(inputs["_arg0"]).pow(2).sum()


GPT2_KW = dict(
    n_layer=1,
    n_embd=16,
    n_head=2,
    vocab_size=97,
    n_positions=16,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=0,
    eos_token_id=0,
)
GPT2_LAYERS = (
    "transformer.wte",
    "transformer.h.0.ln_1",
    "transformer.h.0.attn.c_attn",
    "transformer.h.0.attn.c_proj",
    "transformer.h.0.ln_2",
    "transformer.h.0.mlp.c_fc",
    "transformer.h.0.mlp.c_proj",
    "transformer.ln_f",
    "lm_head",
)  # every capable layer but the batch-collapsed positional embedding wpe


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**GPT2_KW, attn_implementation="eager"))


def _gpt2_untied(model: nn.Module) -> nn.Module:
    """Same function as ``model`` with ``lm_head`` as its own parameter (one per use site)."""
    copy = _gpt2()
    copy.load_state_dict(model.state_dict())
    copy.lm_head.weight = nn.Parameter(copy.transformer.wte.weight.detach().clone())
    return copy


def _gpt2_data() -> torch.Tensor:
    return torch.randint(0, 97, (N_SAMPLES, 6), generator=torch.Generator().manual_seed(1))


def _gpt2_queries() -> torch.Tensor:
    return torch.randint(0, 97, (3, 6), generator=torch.Generator().manual_seed(2))


def _gpt2_loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy summed over samples and positions."""
    ids = inputs["input_ids"]
    logits = model(input_ids=ids).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
    )


CASES = {
    "mlp": Case(
        name="mlp",
        build=_mlp,
        data=_mlp_data,
        queries=_mlp_queries,
        layers=("fc1", "fc2"),
        inputs=lambda x: {"_arg0": x},
        loss=_mlp_loss,
        reference_model=lambda model: model,
    ),
    "gpt2": Case(
        name="gpt2",
        build=_gpt2,
        data=_gpt2_data,
        queries=_gpt2_queries,
        layers=GPT2_LAYERS,
        inputs=lambda x: {"input_ids": x},
        loss=_gpt2_loss,
        reference_model=_gpt2_untied,
    ),
}


def rank_rows(rank: int, step: int) -> list[int]:
    """Dataset rows of ``rank``'s batch at ``step`` (DistributedSampler, ``shuffle=False``)."""
    shard = list(range(rank, N_SAMPLES, WORLD))
    return shard[step * BATCH : (step + 1) * BATCH]


def step_rows(step: int) -> list[int]:
    """Rows of the global batch at ``step`` (all ranks)."""
    return [row for rank in range(WORLD) for row in rank_rows(rank, step)]


def parameter_trajectory(case: Case) -> list[dict[str, torch.Tensor]]:
    """State dicts ``θ_0 .. θ_{STEPS-1}`` of the DDP run, replayed on one device.

    Each step: every rank's sum-loss gradient on its batch, averaged over ranks
    (DDP's all-reduce), then ``θ ← θ - LR · ḡ``.
    """
    model, data = case.build(), case.data()
    states = []
    for step in range(STEPS):
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        total = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
        for rank in range(WORLD):
            model.zero_grad(set_to_none=True)
            case.loss(model, case.inputs(data[rank_rows(rank, step)])).backward()
            for name, p in model.named_parameters():
                total[name] += p.grad
        with torch.no_grad():
            for name, p in model.named_parameters():
                p -= LR * total[name] / WORLD
    return states


def per_sample_reference(case: Case, state: dict, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """``torch.func`` per-sample gradients ``{param: (B, *shape)}`` at ``state`` (per use site)."""
    model = case.build()
    model.load_state_dict(state)
    model = case.reference_model(model)

    def loss_of_sample(module: nn.Module, params: dict, sample: tuple) -> torch.Tensor:
        functional = _Functional(module, params)
        return case.loss(functional, case.inputs(sample[0]))

    return per_sample_param_grads(model, loss_of_sample, (rows,))


class _Functional(nn.Module):
    """Calls ``module`` with ``params`` through ``functional_call`` (for ``case.loss``)."""

    def __init__(self, module: nn.Module, params: dict) -> None:
        super().__init__()
        self.inner, self.params = module, params

    def forward(self, *args, **kwargs):
        """``functional_call(inner, params, args, kwargs)``."""
        return call(self.inner, self.params, *args, **kwargs)


def hook_config(case: Case):
    """Capture exactly the case's layers as ``linear_io``."""
    from dattri_llm.gradient.hooks.config import HookManagerConfig

    return HookManagerConfig(hook_types=dict.fromkeys(case.layers, "linear_io"))


def train_and_capture(
    model: nn.Module, case: Case, batches: list[torch.Tensor], store_dir: str, lr: float
) -> None:
    """Train ``model`` with SGD over ``batches``, capturing every step into ``store_dir``.

    The hook manager is built on ``model`` as given (a DDP wrapper hooks ``.module``).
    """
    from dattri_llm.gradient.callbacks.offload_callback import OffloadCallback
    from dattri_llm.gradient.hooks.manager import HookManager
    from dattri_llm.gradient.storage_manager import GradientStorageManager

    store = GradientStorageManager(store_dir)
    manager = HookManager(model, hook_config(case), callbacks=[OffloadCallback(1, store)])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    with manager.collect(deregister_on_exit=True):
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            case.loss(model, case.inputs(batch)).backward()
            optimizer.step()


def ddp_worker(rank: int, case_name: str, init_method: str, store_dir: str) -> None:
    """One rank: DDP-wrap the case's model, train ``STEPS`` steps on its shard, capture."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    try:
        case = CASES[case_name]
        data = case.data()
        sampler = DistributedSampler(data, num_replicas=WORLD, rank=rank, shuffle=False)
        batches = list(DataLoader(data, batch_size=BATCH, sampler=sampler))
        assert [b.tolist() for b in batches] == [
            data[rank_rows(rank, s)].tolist() for s in range(STEPS)
        ]
        model = DistributedDataParallel(case.build())
        train_and_capture(model, case, batches, store_dir, LR)
    finally:
        dist.destroy_process_group()


class Scale(nn.Module):
    """Elementwise ``x * w``: a layer only ``param_grad`` can capture."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, 3) -> (B, 3)``."""
        return x * self.w


def scale_model() -> nn.Module:
    """``Linear(3, 3)`` then ``Scale``: one ``linear_io`` and one ``param_grad`` layer."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), Scale())


def scale_input(rank: int) -> torch.Tensor:
    """Rank ``r``'s one-sample batch ``(1, 3)`` filled with ``r + 1``."""
    return torch.full((1, 3), float(rank + 1))


def param_grad_worker(rank: int, init_method: str, store_dir: str) -> None:
    """One rank: DDP-wrapped ``scale_model`` (``Scale`` as ``param_grad``) into ``store_dir``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dattri_llm.gradient.callbacks.offload_callback import OffloadCallback
    from dattri_llm.gradient.hooks.config import HookManagerConfig
    from dattri_llm.gradient.hooks.manager import HookManager
    from dattri_llm.gradient.storage_manager import GradientStorageManager

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    try:
        model = DistributedDataParallel(scale_model())
        store = GradientStorageManager(store_dir)
        config = HookManagerConfig(hook_types={"0": "linear_io", "1": "param_grad"})
        manager = HookManager(model, config, callbacks=[OffloadCallback(1, store)])
        for p in model.parameters():  # a zero_grad(set_to_none=False) loop: .grad allocated
            p.grad = torch.zeros_like(p)
        with manager.collect(deregister_on_exit=True):
            model(scale_input(rank)).sum().backward()
    finally:
        dist.destroy_process_group()
