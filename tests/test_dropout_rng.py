"""Dropout under TP: the ranks of a TP group must draw the same masks on the replicated
residual stream, or "replicated" activations and the gradients of replicated weights (the
layer norms) differ between ranks. `parallelize` gives the TP ranks one random state."""

from __future__ import annotations

from harness import run_ranks


def _dropout_step(seed_per_rank: bool):
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    import taco_accel

    torch.manual_seed(0)  # the same weights everywhere
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                       resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2))
    if seed_per_rank:
        torch.manual_seed(1000 + dist.get_rank())  # e.g. a data-loading seed per process
    taco_accel.parallelize(model, compression=None)
    model.train()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = torch.cat([model.transformer.ln_f.weight.grad, model.transformer.h[0].ln_1.weight.grad])
    return loss.item(), grads


def test_tp_ranks_draw_the_same_dropout_masks():
    import torch

    (loss0, g0), (loss1, g1) = run_ranks(_dropout_step, 2, True)
    assert loss0 == loss1
    assert torch.equal(g0, g1)
