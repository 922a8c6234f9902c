"""Structured outputs inside the engine core: grammars compiled against the tokenizer, one
matcher per sequence, and each step's token bitmask.

Compiling a JSON schema against a 50k-token vocabulary takes from milliseconds to seconds,
so it runs on a thread of its own (xgrammar's compiler works outside the GIL) while the
core steps the other requests; a request waits outside the scheduler until its grammar
is ready (`EngineCore._admit_compiled`), as vLLM V1's WAITING_FOR_FSM requests do.
Compiled grammars are kept by their params' key, so the second request with a schema
costs nothing; a grammar that fails to compile fails its request alone.

The mask and the overlapped step (pagedq.core.engine_core): a sequence's mask for step N+1
depends on the token step N sampled. The core queues step N+1's forward first, then reads
step N's tokens (collecting it early), advances the matchers and fills the masks on the
host while the device runs the forward, and only then queues the sampling: the mask costs
the host's time beside the device's, not the device's.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy
import torch

from pagedq.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (a compiled JSON schema holds a few hundred kB of token masks).
_CACHE_SIZE = 256


class GrammarCompiler:
    """Compiles requests' StructuredOutputsParams against the model's tokenizer, off the step loop."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: set[int]):
        self._tokenizer_path = tokenizer_path
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._compiler = None  # built on the first request: loading the tokenizer's vocabulary takes a second
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._compiled: OrderedDict[str, Future] = OrderedDict()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the CompiledGrammar; its exception is a ValueError naming the field."""
        key = params.cache_key()
        future = self._compiled.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._compiled.move_to_end(key)
            return future
        future = self._compiled[key] = self._pool.submit(self._compile, params)
        while len(self._compiled) > _CACHE_SIZE:
            self._compiled.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams):
        if self._compiler is None:
            self._compiler = self._build_compiler()
        grammar = params.to_grammar()
        try:
            return self._compiler.compile_grammar(grammar)
        except RuntimeError as exc:
            raise ValueError(f"structured_outputs.{params.kind}: it does not compile: {exc}") from None

    def _build_compiler(self):
        import xgrammar as xgr

        from pagedq.model_info import load_tokenizer

        tokenizer = load_tokenizer(self._tokenizer_path)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._eos_token_ids
        )
        return xgr.GrammarCompiler(info, max_threads=1)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def new_matcher(compiled):
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


class TokenBitmask:
    """One step's masks, a row per sampling row (rows without a grammar allow everything),
    filled on the host and copied to the device in one transfer."""

    def __init__(self, vocab_size: int, device: torch.device):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.device = device
        self._host = self._allocate(8)
        # Rows filled in parallel, outside the GIL: inside a JSON string a 49k vocabulary took
        # ~430 us a row here, 5% of a step's time with 32 constrained rows on one thread.
        self._batch = xgr.BatchGrammarMatcher(max(1, torch.get_num_threads()))

    def _allocate(self, rows: int) -> torch.Tensor:
        # Pinned on CUDA, so the copy is asynchronous. Refilling it is safe: the next fill
        # comes after the step that read it has been collected (EngineCore._grammar_masks).
        host = self._xgr.allocate_token_bitmask(rows, self.vocab_size)
        return host.pin_memory() if self.device.type == "cuda" else host

    def fill(self, matchers: list) -> torch.Tensor:
        """[len(matchers), words] on the device: each row what its matcher allows next; None
        (no grammar, or a sequence that already ended) allows every token."""
        rows = len(matchers)
        if self._host.shape[0] < rows:
            self._host = self._allocate(max(rows, 2 * self._host.shape[0]))
        host = self._host[:rows]
        self._xgr.reset_token_bitmask(host)
        live = [(row, matcher) for row, matcher in enumerate(matchers) if matcher is not None and not matcher.is_terminated()]
        if live:
            self._batch.batch_fill_next_token_bitmask([matcher for _, matcher in live], host, [row for row, _ in live])
        if self.device.type == "cpu":
            return host
        return host.to(self.device, non_blocking=True)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Each of `rows`' disallowed tokens to -inf, in place (bitmask row i is logits row i)."""
        if logits.device.type != "cpu":
            self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
            return
        # xgrammar's CPU kernel took 6.2 ms for 32 rows of a 49,152-token vocabulary here;
        # unpacking the bits with numpy and filling row by row, 1.4 ms.
        bits = numpy.unpackbits(bitmask[rows].numpy().view(numpy.uint8), axis=1, bitorder="little")
        barred = torch.from_numpy(bits[:, : self.vocab_size]) == 0
        for j, row in enumerate(rows):
            logits[row, : self.vocab_size].masked_fill_(barred[j], float("-inf"))
