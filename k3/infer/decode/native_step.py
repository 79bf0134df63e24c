"""The native decode step: one C call (k3/ops/csrc/decode_step.c) for the engine's one-token rows.

    step = NativeDecodeStep.build(runner)      # None when the model or machine does not qualify
    logits = step(ids, slots, tables, lengths) # [B, 1, V] fp32, same contract as TorchDecodeStep

It computes exactly the maths of `TorchDecodeStep.step` (k3.infer.decode.torch_step, its reference:
tests compare the two), with the engine's pools updated in place. The C side runs the whole model for
the B rows: every weight matrix is streamed once per step for all rows, no tensor is allocated and
nothing goes through torch's dispatcher, which is where a torch decode step spends most of its time on
a CPU. It uses
`torch.get_num_threads()` threads (an OpenMP team of its own).

It qualifies for fp32 models on the CPU (routed experts fp32, or MXFP4-packed by `k3.quant.packed`:
the kernel decodes the codes in registers, never expanding them) whose config is the release's K3
(`K3Config.release_problems()` empty), within the kernel's fixed buffers (head dims <= 512, latent
rank <= 1024, experts <= 1024), with native kernels on and a C compiler with OpenMP; otherwise the
engine keeps the torch step.
The ctypes structs below mirror decode_step.c's; the build compares their sizes and field offsets with
the C side's own table (`layout_problems`) and raises on any difference.
Weights are read from the model at build time (a few derived vectors are computed once: AttnRes's
key-norm gain times its pseudo-query, exp(A_log)), so a model changed after the engine was built needs
a new engine.
"""

from __future__ import annotations

import ctypes

import torch

from k3.infer import memory
from k3.infer.decode.torch_step import block_table_width
from k3.ops import native

I64, F32, PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
MAX_ROWS = 64  # rows per call; larger decode batches are matrix products torch's GEMMs do well


class Dims(ctypes.Structure):
    _fields_ = [
        *((n, I64) for n in "D V L H K W HM Dn Dr Dv R Q E topk I Dl Is Id".split()),
        *((n, I64) for n in "dense_layers block page_size pages safe_gate latent_norm renorm typed".split()),
        *((n, F32) for n in "rms_eps latent_eps res_eps l2_eps lower_bound beta1 beta2 scaling mla_scale "
          "kda_scale".split()),
    ]  # fmt: skip


_LAYER_PTRS = (
    "attn_norm ffn_norm attn_res ffn_res "
    "wq wk wv conv_q conv_k conv_v wfa wfb dt_bias a_exp wb wg o_norm wo "
    "pool_conv_q pool_conv_k pool_conv_v pool_rec "
    "wqa qa_norm wqb wkva kva_norm wkvb wkbt mg mo pool_lat "
    "w_gate w_up w_down router router_bias lat_down lat_norm lat_up w1 w2 w3"
).split()


_MX_PTRS = "w1q w1s w2q w2s w3q w3s".split()


class Layer(ctypes.Structure):
    _fields_ = [("mla", I64), ("moe", I64), ("mx", I64), *((n, PTR) for n in (*_LAYER_PTRS, *_MX_PTRS))]


class WDesc(ctypes.Structure):  # decode_common.h's: a weight matrix of a typed model
    _fields_ = [("type", I64), ("data", PTR), ("scales", PTR)]


W_F32, W_BF16, W_Q8_0 = 0, 1, 2


class Ends(ctypes.Structure):
    _fields_ = [(n, PTR) for n in ("embed", "norm", "out_res", "lm_head")]


_STEP_ARGS = [PTR, PTR, PTR, I64, PTR, PTR, PTR, PTR, PTR, I64, PTR, PTR, I64]


class _LayoutEntry(ctypes.Structure):  # decode_step.c's LayoutEntry: field "" holds the struct's size
    _fields_ = [("type", ctypes.c_char_p), ("field", ctypes.c_char_p), ("value", I64)]


def layout_problems(structs=(Dims, Layer, Ends, WDesc)) -> list[str] | None:
    """How the ctypes `structs` differ from the C step's own layout table (sizes and field offsets,
    decode_step.c); [] when they agree, None when the C step is not built."""
    fn = native.function("decode_step", "k3_decode_layout", [ctypes.POINTER(ctypes.POINTER(_LayoutEntry))])
    if fn is None:
        return None
    fn.restype = I64
    entries = ctypes.POINTER(_LayoutEntry)()
    n = fn(ctypes.byref(entries))
    c_side = {(e.type.decode(), e.field.decode()): e.value for e in entries[:n]}
    ours = {}
    for cls in structs:
        ours[cls.__name__, ""] = ctypes.sizeof(cls)
        ours.update(((cls.__name__, f), getattr(cls, f).offset) for f, _ in cls._fields_)
    problems = []
    for key in sorted(set(c_side) | set(ours)):
        what = f"sizeof({key[0]})" if key[1] == "" else f"{key[0]}.{key[1]}"
        if key not in ours or key not in c_side:
            problems.append(f"{what}: only in {'C' if key in c_side else 'Python'}")
        elif ours[key] != c_side[key]:
            problems.append(f"{what}: C says {c_side[key]}, Python {ours[key]}")
    return problems


def unsupported(runner) -> str | None:
    """Why the native step cannot run this runner's model (None: it can)."""
    model, c = runner.model, runner.model.config
    la = c.linear_attn_config
    if not native.enabled():
        return "native kernels are off (K3_NATIVE=0)"
    if runner.device.type != "cpu" or weight_dtype(model) is None:  # (packed experts are uint8 buffers,
        # not parameters)
        return "the model's weights are neither fp32, bf16 nor Q8_0 on the CPU"
    from k3.model.moe import RoutedExperts
    from k3.quant.packed import PackedRoutedExperts

    kinds = {type(m.experts) for m in model.modules() if hasattr(m, "experts")}
    if kinds - {RoutedExperts, PackedRoutedExperts}:
        return "the routed experts are neither plain stacked matrices nor MXFP4-packed (QAT?)"
    if c.release_problems():
        return "the config is an ablation variant: " + "; ".join(c.release_problems())
    if la.head_dim > 512 or c.kv_lora_rank > 1024 or c.qk_rope_head_dim > 256 or c.num_experts > 1024:
        return "a dimension exceeds the kernel's buffers"
    if c.num_hidden_layers // c.attn_res_block_size + 2 > 64 or c.num_experts_per_token > 64:
        return "too many AttnRes blocks or experts per token"
    return None


def matrices(model) -> dict[int, object]:
    """id -> each weight matrix the C step reads through `wjob` (linear layers, Q8_0 layers, embeddings,
    stacked routed experts): a tensor, or a k3.quant.q8.Q8Linear."""
    from k3.model.moe import RoutedExperts
    from k3.quant.q8 import Q8Linear

    out: dict[int, object] = {}
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            out[id(m.weight)] = m.weight
        elif isinstance(m, Q8Linear):
            out[id(m)] = m
        elif isinstance(m, RoutedExperts):
            out.update((id(w), w) for w in (m.w1, m.w2, m.w3))
    return out


def weight_dtype(model) -> torch.dtype | str | None:
    """How the weight matrices of `model` are stored: torch.float32 when all are fp32, "typed" when each
    is fp32, bf16 or Q8_0 (not all fp32), None when one is something else; the other parameters (norm
    gains, biases, conv kernels: read as fp32 copies) must be fp32 or bf16."""
    from k3.quant.q8 import Q8Linear

    mats = matrices(model)
    kinds = {"q8_0" if isinstance(w, Q8Linear) else w.dtype for w in mats.values()}
    others = {p.dtype for p in model.parameters() if id(p) not in mats}
    if not kinds <= {torch.float32, torch.bfloat16, "q8_0"} or not others <= {torch.float32, torch.bfloat16}:
        return None
    return torch.float32 if kinds <= {torch.float32} else "typed"


class NativeDecodeStep:
    """The C decode step over `runner`'s model and pools (see the module docstring)."""

    max_rows = MAX_ROWS

    def __init__(self, runner, fn):
        self.runner, self.fn = runner, fn
        self._keep: list = []  # every tensor and WDesc a pointer refers to stays alive here
        self.typed = weight_dtype(runner.model) == "typed"
        self.dims = self._dims()
        self.layers = (Layer * self.dims.L)(*(self._layer(i) for i in range(self.dims.L)))
        m = runner.model
        self.ends = Ends(
            self._mat(m.model.embed_tokens.weight),
            self._vec(m.model.norm.weight),
            self._ptr(_res_query(m.model.output_attn_res_norm, m.model.output_attn_res_proj)),
            self._mat(m.lm_head),
        )
        self._scratch = torch.empty(0)
        self._size_fn = native.function("decode_step", "k3_decode_scratch_floats", [PTR, I64, I64, I64])
        self._size_fn.restype = I64

    @classmethod
    def build(cls, runner) -> NativeDecodeStep | None:
        if unsupported(runner) is not None:
            return None
        fn = native.function("decode_step", "k3_decode_step", _STEP_ARGS)
        if fn is None:
            return None
        problems = layout_problems()
        if problems:  # a struct edited on one side only: the step would read the wrong fields
            raise RuntimeError(
                "the C decode step's structs differ from their ctypes mirrors "
                "(k3/infer/decode/native_step.py): " + "; ".join(problems)
            )
        memory.rehome(runner.model)  # the weights it streams, in 2 MB pages (k3.infer.memory)
        return cls(runner, fn)

    # ---- the call ----------------------------------------------------------------------------------
    def __call__(self, ids: list[int], slots: list[int], tables: list[list[int]], lengths: list[int]):
        """Python rows (token, slot, page list, cached length) -> logits [B, 1, V] fp32."""
        return self.rows(ids, slots, tables, lengths, range(len(ids))).unsqueeze(1)

    def rows(self, ids, slots, tables, lengths, out_rows) -> torch.Tensor:
        """Rows as in `__call__` -> logits [len(out_rows), V] fp32 of the rows `out_rows` (ascending).

        Consecutive rows of one slot at consecutive lengths are a prompt chunk: each row sees what the
        rows before it wrote, and gets the bits it would get if it were decoded alone (decode_step.c)."""
        B, P, n_out = len(ids), self.dims.pages, len(out_rows)
        flat = [*ids, *slots, *lengths, *out_rows]
        for t in tables:  # only the pages a row's next key can reach are read: pad the rest with 0
            flat += t[:P]
            flat += [0] * (P - len(t[:P]))
        packed = torch.tensor(flat, dtype=torch.long)
        base, step = packed.data_ptr(), packed.element_size()
        threads = torch.get_num_threads()
        need = self._size_fn(ctypes.byref(self.dims), B, max(lengths) + 1, threads)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(int(need * 1.25) + 1024)
        logits = torch.empty(n_out, self.dims.V)
        self.fn(
            ctypes.byref(self.dims), self.layers, ctypes.byref(self.ends), B,
            base, base + B * step, base + (3 * B + n_out) * step, base + 2 * B * step,
            base + 3 * B * step, n_out, logits.data_ptr(), self._scratch.data_ptr(), threads,
        )  # fmt: skip
        return logits

    # ---- the tables ----------------------------------------------------------------------------------
    def _mat(self, w) -> int | None:
        """A weight matrix (a tensor, a module with `.weight`, or a Q8Linear): its data pointer, or for a
        typed model the address of its WDesc (decode_common.h)."""
        from k3.quant.q8 import Q8Linear

        if w is None:
            return None
        if not isinstance(w, (torch.Tensor, Q8Linear)):
            w = w.weight
        if not self.typed:
            return self._ptr(w)
        if isinstance(w, Q8Linear):
            desc = WDesc(W_Q8_0, self._ptr(w.codes), self._ptr(w.scales))
        else:
            kind = W_BF16 if w.dtype == torch.bfloat16 else W_F32
            desc = WDesc(kind, self._ptr(w), None)
        self._keep.append(desc)
        return ctypes.addressof(desc)

    def _vec(self, t: torch.Tensor | None) -> int | None:
        """A vector (a norm's gain, a bias, a conv kernel) as fp32, whatever the model's dtype."""
        return None if t is None else self._ptr(t.detach().float())

    def _ptr(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _dims(self) -> Dims:
        c, r = self.runner.model.config, self.runner
        la = c.linear_attn_config
        shared = c.moe_intermediate_size * c.num_shared_experts
        return Dims(
            D=c.hidden_size, V=c.vocab_size, L=c.num_hidden_layers,
            H=la.num_heads, K=la.head_dim, W=la.short_conv_kernel_size,
            HM=c.num_attention_heads, Dn=c.qk_nope_head_dim, Dr=c.qk_rope_head_dim, Dv=c.v_head_dim,
            R=c.kv_lora_rank, Q=c.q_lora_rank or 0,
            E=c.num_experts, topk=c.num_experts_per_token, I=c.moe_intermediate_size, Dl=c.expert_width,
            Is=shared, Id=c.intermediate_size, dense_layers=c.first_k_dense_replace,
            block=c.attn_res_block_size, page_size=r.config.page_size, pages=block_table_width(r.config),
            safe_gate=int(la.gate_lower_bound is not None), latent_norm=int(c.latent_moe_use_norm),
            renorm=int(c.moe_renormalize), typed=int(self.typed),
            rms_eps=c.rms_norm_eps, latent_eps=c.latent_norm_eps, res_eps=_attn_res_eps(),
            l2_eps=_l2_eps(), lower_bound=la.gate_lower_bound or 0.0,
            beta1=c.activation_situ_beta, beta2=c.activation_situ_linear_beta,
            scaling=c.routed_scaling_factor, mla_scale=c.qk_head_dim**-0.5, kda_scale=la.head_dim**-0.5,
        )  # fmt: skip

    def _layer(self, i: int) -> Layer:
        r, layer = self.runner, self.runner.model.model.layers[i]
        p = self._ptr
        v, mat = self._vec, self._mat  # vectors fp32; matrices as the model stores them (Dims.typed)
        fields = dict(
            attn_norm=v(layer.input_layernorm.weight),
            ffn_norm=v(layer.post_attention_layernorm.weight),
            attn_res=p(_res_query(layer.self_attention_res_norm, layer.self_attention_res_proj)),
            ffn_res=p(_res_query(layer.mlp_res_norm, layer.mlp_res_proj)),
        )
        a = layer.self_attn
        if i in r.kda:
            pools = r.kda[i]
            fields.update(
                wq=mat(a.q_proj), wk=mat(a.k_proj), wv=mat(a.v_proj),
                conv_q=v(a.q_conv1d.weight), conv_k=v(a.k_conv1d.weight), conv_v=v(a.v_conv1d.weight),
                wfa=mat(a.f_a_proj), wfb=mat(a.f_b_proj), dt_bias=v(a.dt_bias),
                a_exp=p(a.A_log.detach().float().exp()), wb=mat(a.b_proj), wg=mat(a.g_proj),
                o_norm=v(a.o_norm.weight), wo=mat(a.o_proj),
                pool_conv_q=pools["conv_q"].data_ptr(), pool_conv_k=pools["conv_k"].data_ptr(),
                pool_conv_v=pools["conv_v"].data_ptr(), pool_rec=pools["recurrent"].data_ptr(),
            )  # fmt: skip
        else:
            q_lora = hasattr(a, "q_a_proj")
            fields.update(
                wqa=mat(a.q_a_proj) if q_lora else None,
                qa_norm=v(a.q_a_layernorm.weight) if q_lora else None,
                wqb=mat(a.q_b_proj if q_lora else a.q_proj),
                wkva=mat(a.kv_a_proj_with_mqa), kva_norm=v(a.kv_a_layernorm.weight),
                wkvb=mat(a.kv_b_proj), wkbt=p(_key_absorption(a.kv_b_proj.weight, r.model.config)),
                mg=mat(a.g_proj), mo=mat(a.o_proj),
                pool_lat=r.mla[i].data_ptr(),
            )  # fmt: skip
        if hasattr(layer, "block_sparse_moe"):
            moe = layer.block_sparse_moe
            sh = moe.shared_experts
            fields.update(
                router=v(moe.gate.weight), router_bias=v(moe.gate.e_score_correction_bias),  # fp32 in C
                lat_down=mat(moe.routed_expert_down_proj), lat_up=mat(moe.routed_expert_up_proj),
                lat_norm=v(moe.routed_expert_norm.weight) if moe.routed_expert_norm is not None else None,
                w_gate=mat(sh.gate_proj) if sh else None, w_up=mat(sh.up_proj) if sh else None,
                w_down=mat(sh.down_proj) if sh else None,
            )  # fmt: skip
            ex = moe.experts
            if hasattr(ex.w1, "weight_packed"):  # MXFP4, decoded in registers by the kernel
                fields["mx"] = 1
                for w in ("w1", "w2", "w3"):
                    pw = getattr(ex, w)
                    fields[w + "q"], fields[w + "s"] = p(pw.weight_packed), p(pw.weight_scale)
            else:
                fields.update(w1=mat(ex.w1), w2=mat(ex.w2), w3=mat(ex.w3))
        else:
            mlp = layer.mlp
            fields.update(w_gate=mat(mlp.gate_proj), w_up=mat(mlp.up_proj), w_down=mat(mlp.down_proj))
        fields.setdefault("mx", 0)
        return Layer(mla=int(i not in r.kda), moe=int(hasattr(layer, "block_sparse_moe")), **fields)


def _key_absorption(kv_b: torch.Tensor, c) -> torch.Tensor:
    """kv_b's key rows of every head, transposed: [HM, R, Dn] from kv_b [HM * (Dn + Dv), R], so the C
    step absorbs a query into the latent space (W_uk^T q_nope) as one row-major product over all rows."""
    w = kv_b.detach().float().view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    return w[:, : c.qk_nope_head_dim].transpose(1, 2).contiguous()


def _res_query(norm, proj) -> torch.Tensor:
    """An AttnRes mixture's score vector [D]: key-norm gain times pseudo-query (what scores the RMS-normed
    sources, k3.ops.attnres)."""
    return (norm.weight.detach().float() * proj.weight.detach().float()[0]).contiguous()


def _attn_res_eps() -> float:
    from k3.ops.attnres import ATTN_RES_EPS

    return ATTN_RES_EPS


def _l2_eps() -> float:
    from k3.ops.kda.prep import L2NORM_EPS

    return L2NORM_EPS
