"""Run one mixed step (prefill chunks + single-token decodes) of a Llama-family decoder over a paged KV cache.

The runner borrows the weights of a loaded HF ``LlamaForCausalLM`` (also Mistral and Qwen2, which share its
layout) and runs its own forward: the whole step is one flat batch of tokens, so every projection, norm and MLP is
one matmul per layer whatever the mix of sequences; only attention (``executor.attention``) looks at sequences.

It turns chunks into tensors and never touches the block manager: the caller owns the block tables.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from switchyard.workers.executor.attention import AttentionMetadata, PagedAttention, make_attention
from switchyard.workers.executor.cuda_graphs import DecodeGraphs, GraphPass
from switchyard.workers.executor.fused_ops import make_ops
from switchyard.workers.executor.linear import Linear, uses_packed_kernel, w4a8_instructions, w8a8_instructions
from switchyard.workers.executor.transfers import to_device

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


@dataclass(slots=True)
class SeqChunk:
    """The part of one sequence computed in a step."""

    token_ids: list[int]  # the tokens to compute this step (a prefill chunk, or 1 token for a decode)
    start_pos: int  # position of token_ids[0] == tokens already in the KV cache for this sequence
    block_table: list[int]  # KV block ids owning positions 0.. (block i holds positions i*bs .. i*bs+bs-1)
    needs_logits: bool  # return logits of the chunk's last token
    num_drafts: int = 0  # its last tokens are drafts (speculative decoding): logits of each, and of the one before


@dataclass(slots=True)
class ForwardPass:
    """A step's forward pass in progress (``ModelRunner.begin``): the hidden state after ``next_layer`` layers."""

    hidden: torch.Tensor  # [T, hidden]
    meta: AttentionMetadata
    cos: torch.Tensor  # [T, head_dim // 2], rotary angles of the step's positions
    sin: torch.Tensor
    logit_rows: list[int]  # rows whose logits the step returns, in chunk order
    next_layer: int = 0


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear  # q, k and v projections stacked: one matmul (with a bias for Qwen2)
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # gate and up projections stacked
    down: Linear


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_parameters(config) -> dict:
    """transformers 5 keeps everything in ``rope_parameters``; 4.x had ``rope_theta`` + ``rope_scaling``."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params.update(getattr(config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` (fp32) and the cos/sin scale, as HF computes them."""
    params = _rope_parameters(config)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial rotary embeddings are not supported")
    dim = _head_dim(config)
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "llama3":  # Llama 3.1: stretch low frequencies, keep high ones, blend in between
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_context = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type in ("linear", "yarn"):  # static, position-independent: HF's own formula is fine
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        return inv_freq.float().cpu(), float(scale)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported")


def _stack_linears(linears, device, dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input.

    When no conversion is needed the HF modules are re-pointed at views of the stacked tensor, so stacking costs
    no memory and the HF model keeps working.
    """
    weight = torch.cat([m.weight.detach() for m in linears]).to(device=device, dtype=dtype)
    if all(m.weight.device == weight.device and m.weight.dtype == weight.dtype for m in linears):
        offset = 0
        for m in linears:
            rows = m.weight.shape[0]
            m.weight.data = weight[offset : offset + rows]
            offset += rows
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat(
            [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in linears]
        ).to(device=device, dtype=dtype)
    return weight, bias


def _row_elems(head_dim: int, kv_cache_dtype: str) -> int:
    """Elements of one cached (position, KV head) row: an int8 cache's row carries its float32 scale after the
    values (``attention/cpu_paged.py``)."""
    if kv_cache_dtype not in ("auto", "int8"):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of ('auto', 'int8')")
    return head_dim + (4 if kv_cache_dtype == "int8" else 0)


def _param(t: torch.Tensor, device, dtype) -> torch.Tensor:
    return t.detach().to(device=device, dtype=dtype)


def _bias(t: torch.Tensor | None, device, dtype) -> torch.Tensor | None:
    return None if t is None else _param(t, device, dtype)


class ModelRunner:
    """Executes mixed prefill/decode steps of a Llama-family model with its own paged KV cache.

    The cache is, per layer, K and V of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``; block ids in
    ``SeqChunk.block_table`` index its first axis.
    """

    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        attention_backend: str | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
    ):
        """``quantization``: ``int8`` stores every projection's weight (the LM head's too) as int8 with a scale per
        output feature (``Linear``: a CPU in float32, or a GPU); ``w8a8`` quantizes each step's activations to int8
        too (a CPU in float32 only); ``int4`` keeps 4 bits a weight, a scale and an offset per 32 inputs, and the LM
        head in 8 bits (a CPU in float32, on int8 activations as w8a8; or a GPU, the head as ``int8``); None keeps
        them as loaded.
        ``kv_cache_dtype``: ``auto`` keeps K and V in the model's dtype; ``int8`` stores each position's row per KV
        head as int8 and its float scale (a CPU in float32, on the cpu_paged kernels: ``attention/cpu_paged.py``)."""
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is not supported ({sorted(SUPPORTED_MODEL_TYPES)})")
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype or next(model.parameters()).dtype
        # Copies of KV blocks between the device and host memory (the KV tiers') run on a stream of their own, so
        # that they overlap the compute stream's steps.
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(config)
        self.eps = config.rms_norm_eps
        self.vocab_size = config.vocab_size
        self.max_context = config.max_position_embeddings
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True):
            # Within the window sliding-window attention is full attention; beyond it we would be wrong.
            self.max_context = min(self.max_context, window)

        dev, dt = self.device, self.dtype
        inv_freq, self.rope_scale = rope_inv_freq(config)
        self.inv_freq = inv_freq.to(dev)
        embed = model.get_input_embeddings().weight
        lm_head = model.get_output_embeddings().weight
        self.embed = _param(embed, dev, dt)
        pack = uses_packed_kernel(dev, dt)
        if quantization == "w8a8" and not pack:
            raise ValueError(f"quantization {quantization!r} runs on a CPU in float32 with the compiled kernels; this "
                             f"runner is {dev.type}, {dt} (on a GPU: int8 or int4)")
        if quantization is not None and not pack and dev.type != "cuda":
            raise ValueError(f"quantization {quantization!r} runs on a GPU (Triton) or on a CPU in float32 with the "
                             f"compiled packed_gemm kernel; this runner is {dev.type}, {dt}")
        self.quantization = quantization

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None, head: bool = False) -> Linear:
            # int4 keeps the LM head in 8 bits, as Q4 GGUF files keep it (the default model's is Q8_0): 4 bits there
            # cost SmolLM2 most of int4's perplexity (bench/RESULTS.md).
            eight_bits = "w8a8" if pack else "int8"
            return Linear(weight, bias, pack, eight_bits if head and quantization == "int4" else quantization)

        self.lm_head = linear(self.embed if lm_head is embed else _param(lm_head, dev, dt), head=True)
        self.final_norm = _param(model.model.norm.weight, dev, dt)
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if getattr(attn, "q_norm", None) is not None:
                raise NotImplementedError("per-head q/k norms (Qwen3) are not supported")
            qkv_w, qkv_b = _stack_linears([attn.q_proj, attn.k_proj, attn.v_proj], dev, dt)
            gate_up_w, gate_up_b = _stack_linears([mlp.gate_proj, mlp.up_proj], dev, dt)
            self.layers.append(
                _Layer(
                    input_norm=_param(layer.input_layernorm.weight, dev, dt),
                    qkv=linear(qkv_w, qkv_b),
                    o=linear(_param(attn.o_proj.weight, dev, dt), _bias(attn.o_proj.bias, dev, dt)),
                    post_norm=_param(layer.post_attention_layernorm.weight, dev, dt),
                    gate_up=linear(gate_up_w, gate_up_b),
                    down=linear(_param(mlp.down_proj.weight, dev, dt), _bias(mlp.down_proj.bias, dev, dt)),
                )
            )
        linears = [self.lm_head, *(x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down))]
        # Packed copies are extra memory next to the HF model's weights: the start-up log names their size.
        self.packed_weight_bytes = sum(x.packed_bytes for x in linears)
        instructions = {"w8a8": w8a8_instructions, "int4": w4a8_instructions}.get(quantization or "")
        self.linear_kernel = ("packed_gemm" if pack else "triton" if quantization else "torch") + (
            f" {quantization}" if quantization else "") + (f" ({instructions()})" if instructions else "")
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            raise NotImplementedError(f"activation {config.hidden_act!r} is not supported (SwiGLU uses silu)")
        self.ops = make_ops(dev, dt)

        self.attention: PagedAttention[Any] = make_attention(
            self.num_heads, self.num_kv_heads, self.head_dim, block_size, dev, attention_backend, dt, kv_cache_dtype
        )
        self.kv_dtype = torch.int8 if kv_cache_dtype == "int8" else dt  # the cache tensors' element type
        # With the triton backend one spare block past the pool takes the K/V writes of a decode graph's padding
        # rows (executor.cuda_graphs).
        self.spare_block = num_blocks if self.attention.name == "triton" else None
        self.row_elems = _row_elems(self.head_dim, kv_cache_dtype)
        shape = (num_blocks + (self.spare_block is not None), block_size, self.num_kv_heads, self.row_elems)
        # Zeroed, not empty: padded gather rows are masked out, but 0 * NaN from garbage memory would still be NaN.
        self.k_cache = [torch.zeros(shape, device=dev, dtype=self.kv_dtype) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, device=dev, dtype=self.kv_dtype) for _ in self.layers]
        self.graphs: DecodeGraphs | None = None

    @staticmethod
    def kv_bytes_per_token(hf_config, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """K and V of one token across all layers."""
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        if kv_cache_dtype == "int8":
            dtype = torch.int8
        row_bytes = _row_elems(_head_dim(hf_config), kv_cache_dtype) * dtype.itemsize
        return 2 * hf_config.num_hidden_layers * num_kv_heads * row_bytes

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block's K and V across layers, as ``read_blocks`` gives them: (layers, 2, block size, KV heads,
        row), a row being head dim elements of ``kv_dtype`` (and an int8 cache's 4 bytes of scale)."""
        return (len(self.layers), 2, self.block_size, self.num_kv_heads, self.row_elems)

    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of these blocks' K and V, ``[len(block_ids), *block_shape]`` on the runner's device. Queued in
        stream order after the step that wrote them, so a block freed and reused later cannot change the copy."""
        ids = torch.tensor(block_ids, device=self.device)
        return torch.stack([torch.stack((k.index_select(0, ids), v.index_select(0, ids)), 1)
                            for k, v in zip(self.k_cache, self.v_cache)], 1)

    @torch.inference_mode()
    def blocks_to_host(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A host copy of these blocks' K and V (``read_blocks``), and on CUDA the event that marks its arrival: the
        blocks are gathered in stream order after the step that wrote them, then copied into pinned memory on the
        copy stream while the compute stream goes on with the next steps."""
        kv = self.read_blocks(block_ids)
        if self._copy_stream is None:
            return kv, None
        host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            host.copy_(kv, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        kv.record_stream(self._copy_stream)  # the gathered blocks are the copy stream's until it has read them
        return host, done

    def blocks_to_device(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying blocks from (pinned) host memory to the device on the copy stream, from any thread (the
        KV tiers' loader: the copy overlaps the steps that run meanwhile); the device tensor and the event that
        marks its arrival, for ``write_blocks``. Elsewhere than CUDA, ``kv`` as it is."""
        if self._copy_stream is None:
            return kv, None
        with torch.cuda.stream(self._copy_stream):
            staged = kv.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        return staged, done

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], kv: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        """Copy ``kv`` (``[len(block_ids), *block_shape]``, on any device) into these blocks; ``ready``: the event
        of its ``blocks_to_device`` copy, which the compute stream waits for."""
        ids = torch.tensor(block_ids, device=self.device)
        if ready is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(ready)
            kv.record_stream(main)  # made on the copy stream, read on this one
        kv = kv.to(self.device, self.kv_dtype, non_blocking=True)
        for layer, (k, v) in enumerate(zip(self.k_cache, self.v_cache)):
            k.index_copy_(0, ids, kv[:, layer, 0])
            v.index_copy_(0, ids, kv[:, layer, 1])

    @staticmethod
    def num_blocks_for_budget(hf_config, dtype: torch.dtype, block_size: int, kv_bytes_budget: int,
                              kv_cache_dtype: str = "auto") -> int:
        return kv_bytes_budget // (ModelRunner.kv_bytes_per_token(hf_config, dtype, kv_cache_dtype) * block_size)

    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Run one step; returns float32 logits ``[rows, vocab]`` in chunk order, on the runner's device: one row
        per chunk with needs_logits, and one more for each of its drafts.

        Each chunk's tokens are appended to its sequence's cache at ``start_pos..``; chunks of one step must
        belong to different sequences.
        """
        if not chunks:
            return torch.empty(0, self.vocab_size)
        logits = self.advance(self.begin(chunks))
        assert logits is not None  # with no layer count, advance runs every layer
        return logits

    @torch.inference_mode()
    def begin(self, chunks: list[SeqChunk]) -> ForwardPass | GraphPass:
        """Start a step's forward pass; ``advance`` runs its layers, all at once or a few per call.

        A pass dropped part-way wrote only K/V at positions past each sequence's computed tokens, in blocks no
        other sequence shares, so running the same chunks again later gives the same result.
        """
        if not chunks:
            raise ValueError("a step needs at least one chunk")
        for c in chunks:
            if not c.token_ids:
                raise ValueError("a chunk must have at least one token")
            if c.start_pos + len(c.token_ids) > self.max_context:
                last = c.start_pos + len(c.token_ids) - 1
                raise ValueError(f"position {last} is past max_context {self.max_context}")
        if self.graphs is not None and self.graphs.fits(chunks):
            return self.graphs.stage(chunks)
        # Multi-token chunks first, then the decodes, which attention handles as one batch.
        order = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
        order += [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        ordered = [chunks[i] for i in order]
        row_end = itertools.accumulate(len(c.token_ids) for c in ordered)
        last_row = {i: end - 1 for i, end in zip(order, row_end)}
        logit_rows = [row for i, c in enumerate(chunks) if c.needs_logits
                      for row in range(last_row[i] - c.num_drafts, last_row[i] + 1)]
        input_ids = to_device(list(itertools.chain.from_iterable(c.token_ids for c in ordered)), torch.long,
                              self.device)
        meta = self.attention.prepare([(c.start_pos, len(c.token_ids), c.block_table) for c in ordered])
        cos, sin = self._rotary(meta.positions)
        return ForwardPass(F.embedding(input_ids, self.embed), meta, cos, sin, logit_rows)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # cos/sin exactly as HF: fp32 angles, then rounded to the model dtype.
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return (freqs.cos() * self.rope_scale).to(self.dtype), (freqs.sin() * self.rope_scale).to(self.dtype)

    @torch.inference_mode()
    def advance(self, fwd: ForwardPass | GraphPass, num_layers: int | None = None) -> torch.Tensor | None:
        """Run the pass's next ``num_layers`` decoder layers (None: all that are left); returns the logits (as
        ``execute``) once the last layer has run, else None. A step replayed from a CUDA graph runs whole."""
        if isinstance(fwd, GraphPass):
            assert self.graphs is not None  # only the graphs stage a GraphPass
            return self.graphs.replay(fwd)
        end = len(self.layers) if num_layers is None else min(len(self.layers), fwd.next_layer + num_layers)
        for index in range(fwd.next_layer, end):
            fwd.hidden = self._layer(index, fwd.hidden, fwd.meta, fwd.cos, fwd.sin)
        fwd.next_layer = end
        if end < len(self.layers):
            return None
        if not fwd.logit_rows:
            return torch.empty(0, self.vocab_size)
        rows = to_device(fwd.logit_rows, torch.long, self.device)
        return self._logits(fwd.hidden.index_select(0, rows))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.after_rms_norm(hidden, self.final_norm, self.eps, self.ops).float().contiguous()

    def forward_logits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Every layer over ``input_ids`` and logits of every row: the body a CUDA graph records."""
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = self._rotary(meta.positions)
        for index in range(len(self.layers)):
            hidden = self._layer(index, hidden, meta, cos, sin)
        return self._logits(hidden)

    def capture_cuda_graphs(self, max_batch: int, max_context: int | None = None) -> DecodeGraphs:
        """Record decode steps of up to ``max_batch`` sequences with up to ``max_context`` positions (triton
        attention; on CPU replayed eagerly, see ``cuda_graphs``); later decode-only steps that fit replay them."""
        if self.spare_block is None:
            raise ValueError("CUDA graphs need the triton attention backend")
        self.graphs = DecodeGraphs(self, max_batch, min(max_context or self.max_context, self.max_context),
                                   self.spare_block)
        self.graphs.capture()
        return self.graphs

    def _layer(self, index: int, h: torch.Tensor, meta: AttentionMetadata, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """Decoder layer ``index`` over the step's flat batch ``h [T, hidden]``."""
        layer, ops = self.layers[index], self.ops
        num_tokens = h.shape[0]
        heads, kv_heads, d, eps = self.num_heads, self.num_kv_heads, self.head_dim, self.eps
        qkv = layer.qkv.after_rms_norm(h, layer.input_norm, eps, ops).contiguous()
        # q and k rotate together: one rotary pass over [T, heads + kv_heads, d].
        qk = ops.rotary(qkv, heads + kv_heads, d, cos, sin)
        q, k = qk.split((heads, kv_heads), dim=1)
        v = qkv[:, (heads + kv_heads) * d :].view(num_tokens, kv_heads, d)
        o = self.attention.forward(q, k, v, self.k_cache[index], self.v_cache[index], meta)
        h = layer.o(o, residual=h)

        return layer.down.after_silu_mul(layer.gate_up.after_rms_norm(h, layer.post_norm, eps, ops), ops, residual=h)

    def warmup(self) -> None:
        """Run a tiny prefill and a decode so first-request latency excludes lazy init (kernels, allocator).

        Writes garbage into block 0 only; call it before serving, when no sequence owns any block.
        """
        n = min(4, self.block_size)
        table = [0] * ((n + self.block_size) // self.block_size)
        self.execute([SeqChunk(list(range(n)), 0, table, True)])
        self.execute([SeqChunk([0], n, table, True)])
