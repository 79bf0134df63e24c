"""The chunked head + cross-entropy equals the plain one, forward and backward."""

import pytest
import torch

from k3.train.loss import chunked_linear_cross_entropy, linear_cross_entropy


@pytest.mark.parametrize("chunk", [1, 7, 64, 5000])
def test_chunked_equals_reference(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 24, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (0.3 * torch.randn(97, 24, generator=g)).requires_grad_()
    labels = torch.randint(0, 97, (300,), generator=g)
    labels[::5] = -100
    ref = linear_cross_entropy(h, w, labels)
    gh, gw = torch.autograd.grad(3 * ref, (h, w))
    got = chunked_linear_cross_entropy(h, w, labels, chunk)
    ch, cw = torch.autograd.grad(3 * got, (h, w))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ch, gh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(cw, gw, rtol=1e-5, atol=1e-7)


def test_all_ignored_gives_zero_loss_and_gradient():
    h = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    loss = chunked_linear_cross_entropy(h, w, torch.full((10,), -100))
    loss.backward()
    assert loss.item() == 0 and h.grad.abs().sum() == 0 and w.grad.abs().sum() == 0


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="labels"):
        chunked_linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 8), torch.zeros(3, dtype=torch.long))


def test_training_forward_uses_it_and_matches_the_model(make_tc):
    """forward_loss's chunked path gives the model's own loss and gradients on a real batch."""
    from k3.train.step import _chunked_head, forward_loss
    from k3.train.trainer import Trainer

    trainer = Trainer(make_tc(steps=1), quiet=True)
    model, batch = trainer.model, next(trainer.loader)
    assert _chunked_head(model)
    loss = forward_loss(model, batch, bf16=False)
    grads = torch.autograd.grad(loss, [model.lm_head.weight, model.model.embed_tokens.weight])
    ref = model(batch["input_ids"], labels=batch["labels"], cu_seqlens=batch["cu_seqlens"],
                doc_ids=batch["doc_ids"]).loss  # fmt: skip
    ref_grads = torch.autograd.grad(ref, [model.lm_head.weight, model.model.embed_tokens.weight])
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
