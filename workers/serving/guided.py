"""Constrained decoding: grammars compiled with llguidance, applied as a token mask before sampling.

    request ──▶ grammar text (JSON schema, or tool_calls.py's Lark) ──▶ Grammars.matcher(): a fresh matcher, from
                a compiled one kept per grammar text (intake thread)
    step    ──▶ fill_masks(): each constrained row's allowed tokens, computed in parallel in llguidance's own
                threads while the device still runs the forward ──▶ apply_masks(): the rest at -inf ──▶ sample
    token   ──▶ matcher.consume_token(); a matcher that is done allows only EOS

llguidance, not xgrammar: it builds a grammar's token automaton lazily, so a new schema costs about a millisecond
to start (xgrammar compiles the whole grammar first, which a service seeing a new schema per request pays every
time); it has no dependencies (one abi3 wheel, 3 MB, so it travels to a GPU machine), and its Lark grammars with
lazy lexemes let a tool call be constrained from its opening tag on while the text around it stays free.

JSON is generated compact with a space after ``,`` and ``:`` (Python's ``json.dumps`` style): bounded, so even a
model that loves whitespace finishes its object, and the style models have seen most.

llguidance is imported, and the tokenizer's automaton built, at the first request with a grammar: an engine that
never sees one needs neither (a slow or stand-in tokenizer, a machine without the wheel).

A grammar's compile is bounded (``max_bytes`` of grammar text, ``lexer_fuel``: out of either, the request is
refused, 400) and runs on threads of its own at a lower CPU priority, so a tenant's huge schema costs what the
worker's serving leaves, and nobody else's request waits for it (the intake prepares other tenants' requests
meanwhile: workers/service/intake.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import msgspec
import torch

from switchyard.shared.messages import ResponseFormat
from switchyard.workers.cpu_priority import lower_priority
from switchyard.workers.executor.transfers import to_device

if TYPE_CHECKING:
    import llguidance

# Applied to every JSON schema: see the module docstring.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept (a service sees a handful of schemas again and again)
_BITS = 32


class GrammarError(ValueError):
    """The schema or grammar cannot be compiled; the message says why (for a 400)."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:
        raise GrammarError("constrained decoding needs the llguidance package (pip install llguidance)") from exc
    return llguidance


def json_schema_grammar(schema: dict) -> str:
    """The grammar of JSON text valid against ``schema``: llguidance's grammar document, written here rather than
    by ``LLMatcher.grammar_from_json_schema``, which holds the GIL while it reads the schema (every other thread of
    the worker stopped for as long as a large schema takes); msgspec writes it in a fraction of that. The schema is
    read (and checked) when the matcher is built, outside the GIL."""
    try:
        return msgspec.json.encode({"grammars": [{"name": "json_schema", "json_schema": with_json_style(schema)}]}
                                   ).decode()
    except (TypeError, ValueError, UnicodeEncodeError) as exc:
        raise GrammarError(f"the schema is not JSON: {exc}") from exc


def response_format_grammar(fmt: ResponseFormat) -> str:
    """``json_object``: any JSON object; ``json_schema``: an instance of its schema. Lark text (``%json`` of the
    schema in our JSON style), the one grammar form both engines take: ours compiles it, vLLM's guidance backend
    too."""
    if fmt.type == "json_object":
        schema = {"type": "object"}
    elif fmt.type == "json_schema":
        schema = fmt.schema or {}
    else:
        raise GrammarError(f"unknown response_format type {fmt.type!r}")
    return "%llguidance {}\nstart: %json " + json.dumps(with_json_style(schema))


def with_json_style(schema: dict) -> dict:
    """``schema`` carrying the JSON style itself, for a schema embedded in a Lark grammar (``%json``)."""
    return {**schema, "x-guidance": {**schema.get("x-guidance", {}), **JSON_STYLE}}


class Grammars:
    """Compiles grammars for one tokenizer and keeps the compiled ones; hands out a fresh matcher per request."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE, lexer_fuel: int = 1_000_000,
                 max_bytes: int = 1_048_576, compile_threads: int = 1) -> None:
        """``vocab_size``: the model's logits (may exceed the tokenizer's vocabulary: padded embeddings).
        ``lexer_fuel`` and ``max_bytes``: a grammar's compile budget, llguidance's lexer fuel and the largest
        grammar text compiled at all (either exceeded: ``GrammarError``). ``compile_threads``: grammars compiled
        at once (one per thread calling ``matcher``). Nothing is built until the first ``matcher`` call (see the
        module docstring)."""
        self._compile_threads = compile_threads
        self._compiler: ThreadPoolExecutor | None = None
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._lexer_fuel = lexer_fuel
        self._max_bytes = max_bytes
        self._tokenizer = None  # llguidance's view of the tokenizer, built at the first grammar
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0  # since start: grammars compiled (the rest came from the cache)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher at the start of ``grammar``; raises ``GrammarError`` when it does not compile within its
        budget."""
        if len(grammar) > self._max_bytes:
            raise GrammarError(f"its grammar takes {len(grammar)} bytes, over this worker's limit of "
                               f"{self._max_bytes}; simplify the schema")
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled.deep_copy()
            if self._tokenizer is None:
                try:
                    self._tokenizer = _llguidance().hf.from_tokenizer(self._hf_tokenizer, n_vocab=self._vocab_size)
                except ValueError as exc:  # "Only fast tokenizers are supported"
                    raise GrammarError(f"this model's tokenizer cannot be used for grammars: {exc}") from exc
        compiled = self._compile(grammar)
        if compiled.is_error():
            error = compiled.get_error()
            if "fuel exhausted" in error:
                raise GrammarError(f"it is too complex to compile within this worker's budget ({error})")
            raise GrammarError(error)
        with self._lock:
            self.num_compiled += 1
            self._compiled[grammar] = compiled
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        """Build the matcher on a compile thread, at a lower CPU priority than every other thread of the worker
        (the steps, the event loop, tokenizing other requests): a compile takes up to its fuel of a core, and what
        it takes must be what serving leaves. llguidance builds it with the GIL released, so nothing else waits
        for it but its own request."""
        with self._lock:
            if self._compiler is None:
                self._compiler = ThreadPoolExecutor(self._compile_threads, thread_name_prefix="switchyard-grammar",
                                                    initializer=lower_priority)
        llg = _llguidance()
        limits = llg.LLParserLimits(initial_lexer_fuel=self._lexer_fuel, verbose_errors=False)
        return self._compiler.submit(llg.LLMatcher, self._tokenizer, grammar, log_level=0, limits=limits).result()



_executor: llguidance.LLExecutor | None = None


def fill_masks(matchers: list[llguidance.LLMatcher], vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """The allowed tokens of each matcher as a ``[len(matchers), ceil(vocab/32)]`` int32 bitmask (bit ``t % 32``
    of word ``t // 32`` set: token ``t`` allowed), computed in llguidance's threads. ``pin_memory`` (masks bound
    for a GPU): in page-locked memory, so the copy to the device is a real asynchronous one."""
    global _executor
    if _executor is None:
        _executor = _llguidance().LLExecutor()
    bitmask = torch.full((len(matchers), -(-vocab_size // _BITS)), -1, dtype=torch.int32, pin_memory=pin_memory)
    _executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                      bitmask.shape[1] * 4, len(matchers))
    return bitmask


def fill_masks_along(matchers: list[llguidance.LLMatcher], drafts: list[list[int]], vocab_size: int,
                     pin_memory: bool = False) -> torch.Tensor:
    """The masks of each matcher before each of its drafts and after the last (speculative decoding: the rows a
    step computes for it), ``len(drafts[j]) + 1`` rows for matcher ``j``, matcher after matcher. The drafts must be
    ones the matcher takes (``validate_tokens``); each matcher is left as it was found."""
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    bitmask = torch.full((starts[-1], -(-vocab_size // _BITS)), -1, dtype=torch.int32, pin_memory=pin_memory)
    depth = 0
    while live := [j for j, d in enumerate(drafts) if len(d) >= depth]:  # one parallel fill per depth
        for j in live if depth else ():
            matchers[j].consume_token(drafts[j][depth - 1])
        bitmask[[starts[j] + depth for j in live]] = fill_masks([matchers[j] for j in live], vocab_size)
        depth += 1
    for matcher, d in zip(matchers, drafts):
        if d:
            matcher.rollback(len(d))
    return bitmask


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_masks(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set the disallowed tokens of ``logits[rows]`` to -inf, in place (on the logits' device).

    The words are read as little-endian bytes (byte ``t // 8``, bit ``t % 8``: the same bit as in the word) and
    unpacked 8 to a byte: half the work of unpacking 32-bit words, a visible part of a CPU step with a large
    vocabulary."""
    vocab, device = logits.shape[1], logits.device
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    packed = bitmask.to(device, non_blocking=True).view(torch.uint8)
    disallowed = ((packed.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab] == 0
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(disallowed, float("-inf"))
        return
    index = to_device(rows, torch.long, device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(disallowed, float("-inf")))
