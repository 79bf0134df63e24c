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


def test_native_softmax_gradient_equals_the_torch_ops(monkeypatch):
    """The chunk's softmax, loss and dlogits as one native call (csrc/cross_entropy.c) against the torch
    ops beside it: V not a multiple of 16, logits from tiny to large (a row's max far above the rest),
    ignored rows, on 1 and 3 threads."""
    from k3.train import loss as loss_mod

    if loss_mod._xent_kernel(torch.zeros(1), torch.zeros(1, dtype=torch.long)) is None:
        pytest.skip("no C compiler: the native kernel cannot be built")
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(257, 40, generator=g) * torch.logspace(-2, 1.5, 257)[:, None]).requires_grad_()
    w = torch.randn(1003, 40, generator=g).requires_grad_()
    labels = torch.randint(0, 1003, (257,), generator=g)
    labels[3::7] = -100
    results = {}
    before = torch.get_num_threads()
    try:
        for name, threads in (("native-1", 1), ("native-3", 3), ("torch", 1)):
            torch.set_num_threads(threads)
            if name == "torch":
                monkeypatch.setattr(loss_mod, "_xent_kernel", lambda h, labels: None)
            out = chunked_linear_cross_entropy(h, w, labels, 64)
            results[name] = (out, *torch.autograd.grad(out, (h, w)))
    finally:
        torch.set_num_threads(before)
    for name in ("native-1", "native-3"):
        for a, b in zip(results[name], results["torch"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5 * b.abs().max().item())
