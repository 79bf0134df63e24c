"""The whole-model C decode step (k3.infer.decode.native_step) against its reference, the torch step
(k3.infer.decode.torch_step.TorchDecodeStep.step): logits and every pool it writes, over ragged batches,
several steps, variant configs and thread counts; the engine's greedy text with it on and off; the
backend chosen once when the engine is built."""

import ctypes
import dataclasses
import logging

import pytest
import torch

from k3.config import preset
from k3.infer.config import EngineConfig
from k3.infer.decode import native_step
from k3.infer.decode.native_step import NativeDecodeStep, unsupported
from k3.infer.engine import Engine
from k3.infer.sequence import SamplingParams
from k3.model.init import init_weights
from k3.model.transformer import K3ForCausalLM

CFG = dict(page_size=16, prefix_unit=16, num_pages=40, max_model_len=320, max_num_seqs=6)


def model_of(config, seed=0):
    torch.manual_seed(seed)
    model = K3ForCausalLM(config)
    init_weights(model, 0.5, config.num_hidden_layers, seed=seed)
    with torch.no_grad():  # non-trivial norms, AttnRes queries, gates and router biases everywhere
        for name, p in model.named_parameters():
            if p.ndim == 1 or "res_proj" in name:
                p.add_(torch.randn_like(p) * 0.2)
        for b in model.buffers():
            b.add_(torch.randn_like(b) * 0.05)
    return model.eval()


NANO = preset("k3-nano")
VARIANTS = {
    "nano": NANO,
    "no q_lora, softplus gate, no shared experts, no latent norm": NANO.replace(
        q_lora_rank=None, num_shared_experts=0, latent_moe_use_norm=False,
        linear_attn_config=dataclasses.replace(NANO.linear_attn_config, gate_lower_bound=None),
    ),
    "wider, top-3 of 16, 2 shared, AttnRes blocks of 3": NANO.with_layers(6).replace(
        hidden_size=96, num_experts=16, num_experts_per_token=3, num_shared_experts=2, attn_res_block_size=3,
    ),
    # the MLA kernel's 64-column blocks of the value sums and (at one thread) its 4-head blocks
    "5 heads, MLA latent rank 80": NANO.replace(
        num_attention_heads=5, num_key_value_heads=5, kv_lora_rank=80,
        linear_attn_config=dataclasses.replace(NANO.linear_attn_config, num_heads=5),
    ),
}  # fmt: skip


def close_to_rounding(ours: torch.Tensor, ref: torch.Tensor, rel: float = 3e-5) -> bool:
    """Equal to fp32 rounding: the largest difference within `rel` of the tensor's scale. The C step sums
    in another order than torch; on these random states the torch step's own batched and one-row
    results differ by up to 2e-5 of the scale, and both are that far from a float64 step."""
    err, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    return err <= rel * max(scale, 1.0)


def fill_pools(runner, seed):
    g = torch.Generator().manual_seed(seed)
    for pools in runner.kda.values():
        for t in pools.values():
            t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    for pool in runner.mla.values():
        pool.copy_(torch.randn(pool.shape, generator=g))


def pools_of(runner):
    return [t.clone() for d in runner.kda.values() for t in d.values()] + [
        p.clone() for p in runner.mla.values()
    ]


def set_pools(runner, saved):
    live = [t for d in runner.kda.values() for t in d.values()] + list(runner.mla.values())
    for t, s in zip(live, saved, strict=True):
        t.copy_(s)


# ragged rows over their own pages: (token, KDA slot, MLA pages, cached length); six rows run the
# products' 4-row blocks and their remainder
ROWS = [(5, 2, [3, 1, 7], 37), (300, 0, [0], 9), (17, 5, [2, 4], 20), (99, 1, [5, 6], 30),
        (640, 3, [8], 3), (2, 4, [9, 10, 11], 40)]  # fmt: skip


def columns(n: int) -> tuple[list, list, list, list]:
    return tuple(list(c) for c in zip(*ROWS[:n], strict=True))


@pytest.mark.parametrize("name", [*VARIANTS, "nano + MXFP4 experts"])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_native_step_equals_the_torch_step(name, rows):
    """MXFP4: the kernel decodes the packed codes in registers; the torch step dequantizes them."""
    check_against_torch_step(name, rows)


def test_grouped_mla_heads_equal_the_torch_step():
    """With rows enough for the team (here one thread), a row's MLA heads share each pass over its
    latents, in blocks of four (five heads: a full block and a padded one)."""
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        check_against_torch_step("5 heads, MLA latent rank 80", 6)
    finally:
        torch.set_num_threads(n)


def check_against_torch_step(name: str, rows: int) -> None:
    """Three native steps against three torch steps from the same pools: within fp32 rounding of the
    torch step, or (where the torch fp32 step itself is that far from a float64 step, as on badly
    conditioned rows) at most twice its distance from the float64 step."""
    from k3.quant.packed import pack_model_experts

    def engine_of(model):
        return Engine(pack_model_experts(model) if "MXFP4" in name else model, EngineConfig(**CFG))

    model = model_of(VARIANTS[name.removesuffix(" + MXFP4 experts")])
    r = engine_of(model).runner
    native = NativeDecodeStep.build(r)
    assert native is not None, unsupported(r)
    fill_pools(r, seed=rows)
    start = pools_of(r)
    cols = columns(rows)
    ref_logits, ref_pools = torch_steps(r, start, *cols)
    set_pools(r, start)
    ids, slots, tables, lengths = cols
    ours = [native(ids, slots, tables, [n + step for n in lengths]) for step in range(3)]
    exact = None
    for a, b in [*zip(ours, ref_logits, strict=True), *zip(pools_of(r), ref_pools, strict=True)]:
        if close_to_rounding(a, b):
            continue
        if exact is None:  # the float64 step, only when needed
            r64 = Engine(model.double(), EngineConfig(**CFG)).runner
            logits64, pools64 = torch_steps(r64, start, *cols)
            exact = dict(zip([id(t) for t in [*ref_logits, *ref_pools]], [*logits64, *pools64], strict=True))
        truth = exact[id(b)]
        ours_err, torch_err = (a.double() - truth).abs().max().item(), (b.double() - truth).abs().max().item()
        assert ours_err <= 2 * torch_err, f"native {ours_err:.3g} vs torch fp32 {torch_err:.3g} from float64"


def torch_steps(runner, start, ids, slots, tables, lengths):
    """The torch step three times from pools `start` -> (logits of each step, the pools after)."""
    set_pools(runner, start)
    torch_step = runner.decode.torch
    with torch.no_grad():  # the second and third steps read what the first wrote
        logits = [
            torch_step.step(*torch_step.tensors(ids, slots, tables, [n + step for n in lengths]))
            for step in range(3)
        ]
    return logits, pools_of(runner)


def test_a_row_does_not_depend_on_its_batch():
    """Batch invariance: each row's logits and state are bit-identical alone and in any batch."""
    engine = Engine(model_of(VARIANTS["nano"]), EngineConfig(**CFG))
    r = engine.runner
    native = NativeDecodeStep.build(r)
    fill_pools(r, seed=5)
    start = pools_of(r)
    rows = columns(6)
    together = native(*rows)
    for b in range(6):
        set_pools(r, start)
        alone = native(*([v[b]] for v in rows))
        assert torch.equal(alone[0], together[b])


def test_thread_count_does_not_change_a_bit():
    engine = Engine(model_of(VARIANTS["nano"]), EngineConfig(**CFG))
    r = engine.runner
    native = NativeDecodeStep.build(r)
    fill_pools(r, seed=7)
    start = pools_of(r)
    outs = []
    n = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            set_pools(r, start)
            outs.append((native(*columns(6)), pools_of(r)))
    finally:
        torch.set_num_threads(n)
    for logits, pools in outs[1:]:
        assert torch.equal(logits, outs[0][0])
        assert all(torch.equal(a, b) for a, b in zip(pools, outs[0][1], strict=True))


def test_engine_greedy_text_is_the_same_with_and_without_it(prompt):
    model = model_of(VARIANTS["nano"], seed=3)
    prompts = [prompt(40, 1), prompt(7, 2), prompt(65, 3)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    on = Engine(model, EngineConfig(**CFG))
    off = Engine(model, EngineConfig(**CFG, native=False))
    assert on.runner.decode.native is not None and off.runner.decode.native is None
    assert [s.output for s in on.generate(prompts, params)] == [
        s.output for s in off.generate(prompts, params)
    ]


def test_the_backend_is_chosen_once_when_the_engine_is_built_and_logged(caplog):
    model = model_of(VARIANTS["nano"])
    with caplog.at_level(logging.INFO, logger="k3.infer"):
        on = Engine(model, EngineConfig(**CFG))
        off = Engine(model, EngineConfig(**CFG, native=False))
        half = Engine(model_of(VARIANTS["nano"]).to(torch.float16), EngineConfig(**CFG))
    assert isinstance(on.runner.decode.native, NativeDecodeStep)  # built, before any step
    assert off.runner.decode.native is None and half.runner.decode.native is None
    said = [r.getMessage() for r in caplog.records if r.name == "k3.infer"]
    assert said == [
        "decode backend: native C step (up to 64 rows; torch, eager beyond)",
        "decode backend: torch, eager (EngineConfig.native is off)",
        "decode backend: torch, eager (the model's weights are neither fp32, bf16 nor Q8_0 on the CPU)",
    ]


def test_it_declines_what_it_does_not_compute(monkeypatch):
    half = Engine(model_of(VARIANTS["nano"]).to(torch.float16), EngineConfig(**CFG))
    assert "fp32" in unsupported(half.runner) and NativeDecodeStep.build(half.runner) is None
    ablation = Engine(model_of(NANO.replace(use_attn_res=False)), EngineConfig(**CFG))
    assert "use_attn_res" in unsupported(ablation.runner)
    monkeypatch.setenv("K3_NATIVE", "0")
    plain = Engine(model_of(VARIANTS["nano"]), EngineConfig(**CFG))
    assert "K3_NATIVE" in unsupported(plain.runner)


def test_the_ctypes_structs_match_the_c_layout(monkeypatch):
    assert native_step.layout_problems() == []

    class Ends(ctypes.Structure):  # two fields swapped, as a one-sided edit would leave them
        _fields_ = [(n, ctypes.c_void_p) for n in ("embed", "out_res", "norm", "lm_head")]

    class Dims(ctypes.Structure):  # one field short
        _fields_ = native_step.Dims._fields_[:-1]

    problems = native_step.layout_problems((Dims, native_step.Layer, Ends, native_step.WDesc))
    assert problems == [
        "Dims.kda_scale: only in C",
        "Ends.norm: C says 8, Python 16",
        "Ends.out_res: C says 16, Python 8",
    ]  # (the shorter Dims pads to the same size)
    monkeypatch.setattr(native_step, "Ends", Ends)
    monkeypatch.setattr(native_step, "layout_problems", lambda: ["Ends.norm: C says 8, Python 16"])
    with pytest.raises(RuntimeError, match="structs differ from their ctypes mirrors.*Ends.norm"):
        NativeDecodeStep.build(Engine(model_of(NANO), EngineConfig(**CFG, native=False)).runner)


@pytest.mark.parametrize("experts", ["stacked", "mxfp4"])
def test_bf16_weights_give_the_bits_of_their_fp32_copy(prompt, experts):
    """A bf16 model (the release's storage: bf16, routed experts MXFP4 or not) runs natively, every row,
    with its weights widened exactly in registers: tokens and logprobs equal those of the same weights
    as fp32 (an exact copy) in the deterministic engine, bit for bit; its caches are fp32."""
    from k3.quant.packed import pack_model_experts

    pack = pack_model_experts if experts == "mxfp4" else (lambda m: m)
    bf16 = pack(model_of(VARIANTS["wider, top-3 of 16, 2 shared, AttnRes blocks of 3"]).to(torch.bfloat16))
    f32 = pack(
        model_of(VARIANTS["wider, top-3 of 16, 2 shared, AttnRes blocks of 3"]).to(torch.bfloat16).float()
    )
    params = SamplingParams(max_tokens=12, logprobs=5, ignore_eos=True)
    prompts = [prompt(70, 1), prompt(9, 2), prompt(33, 3)]
    a = Engine(bf16, EngineConfig(**CFG))
    b = Engine(f32, EngineConfig(**CFG, deterministic=True))
    assert a.runner.exact and a.runner.dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in a.runner.mla.values())
    got = [(s.output, s.logprobs) for s in a.generate(prompts, params)]
    assert got == [(s.output, s.logprobs) for s in b.generate(prompts, params)]


def test_the_release_format_runs_natively(tmp_path, prompt):
    """`k3 quantize`'s layout (routed experts MXFP4, the rest bf16 with the release's fp32 tensors kept
    fp32), loaded as `k3 serve` loads it: every row through the C step, with the bits of the same
    weights widened to fp32."""
    from k3.quant.checkpoint import save_mxfp4_checkpoint
    from k3.serve.cli import load_engine

    model = model_of(VARIANTS["nano"], seed=5)
    save_mxfp4_checkpoint(model, model.config, tmp_path / "rel")
    rel = load_engine(str(tmp_path / "rel"), EngineConfig(**CFG))
    dtypes = {p.dtype for p in rel.model.parameters()}
    assert dtypes == {torch.bfloat16, torch.float32} and rel.runner.exact
    ref = load_engine(str(tmp_path / "rel"), EngineConfig(**CFG, deterministic=True))
    ref.model.float()
    ref = Engine(ref.model, EngineConfig(**CFG, deterministic=True))
    params = SamplingParams(max_tokens=10, logprobs=3, ignore_eos=True)
    prompts = [prompt(50, 4), prompt(12, 5)]
    got = [(s.output, s.logprobs) for s in rel.generate(prompts, params)]
    assert got == [(s.output, s.logprobs) for s in ref.generate(prompts, params)]


def test_q8_0_weights_give_the_bits_of_their_fp32_copy(prompt):
    """Linear layers held as Q8_0 blocks (k3.quant.q8) run in the C step, every row, reading the codes:
    tokens and logprobs equal those of the widened fp32 matrices, bit for bit."""
    import copy

    from k3.quant.q8 import Q8Linear, quantize_linears

    q8 = quantize_linears(model_of(VARIANTS["wider, top-3 of 16, 2 shared, AttnRes blocks of 3"]), skip=())
    assert sum(isinstance(m, Q8Linear) for m in q8.modules()) > 10
    f32 = copy.deepcopy(q8)
    for name, m in [(n, m) for n, m in f32.named_modules() if isinstance(m, Q8Linear)]:
        parent, _, leaf = name.rpartition(".")
        lin = torch.nn.Linear(m.in_features, m.out_features, bias=False)
        lin.weight.data = m.weight
        setattr(f32.get_submodule(parent) if parent else f32, leaf, lin)
    a = Engine(q8, EngineConfig(**CFG))
    b = Engine(f32, EngineConfig(**CFG, deterministic=True))
    assert a.runner.exact and a.runner.decode.native.typed and not b.runner.decode.native.typed
    params = SamplingParams(max_tokens=12, logprobs=5, ignore_eos=True)
    prompts = [prompt(70, 1), prompt(9, 2), prompt(33, 3)]
    got = [(s.output, s.logprobs) for s in a.generate(prompts, params)]
    assert got == [(s.output, s.logprobs) for s in b.generate(prompts, params)]
