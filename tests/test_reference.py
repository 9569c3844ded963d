import torch
from reference import call, per_sample_loop_grads, per_sample_param_grads


def test_vmap_reference_matches_backward_loop():
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 3)
    x = torch.randn(4, 7, 5)

    def loss_sample(m, p, sample):
        return call(m, p, sample[0]).pow(2).sum()

    ref = per_sample_param_grads(lin, loss_sample, (x,))
    loop = per_sample_loop_grads(lin, lambda m, b: m(b[0]).pow(2).sum(), (x,))
    for k in ref:
        torch.testing.assert_close(ref[k], loop[k])
