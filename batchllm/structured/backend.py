"""Structured outputs over one engine's vocabulary: compiles each grammar once (cached by its
spec) in a thread pool, so that a request's grammar compiles while the steps before its first
sampled token run; gives each request its GrammarState; fills a step's token bitmask."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar

from batchllm.sampling_params import StructuredOutputsParams
from batchllm.structured.errors import StructuredOutputError
from batchllm.structured.grammar_state import GrammarState
from batchllm.structured.grammars import build_grammar
from batchllm.structured.token_bitmask import TokenBitmaskFiller
from batchllm.structured.vocabulary import GrammarVocabulary

DEFAULT_CACHE_LIMIT_BYTES = 1 << 30  # compiled grammars kept for reuse (one is ~0.1-1 MB)


class GrammarBackend:
    def __init__(self, vocabulary: GrammarVocabulary, num_compile_workers: int = 2,
                 cache_limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES) -> None:
        self.vocabulary = vocabulary
        # xgrammar's own cache is off: this one is keyed by the spec and bounded.
        self._compiler = xgrammar.GrammarCompiler(vocabulary.tokenizer_info(), cache_enabled=False,
                                                  max_threads=max(1, min(8, os.cpu_count() or 1)))
        self._pool = ThreadPoolExecutor(max_workers=num_compile_workers, thread_name_prefix="batchllm-grammar")
        self._compiled: OrderedDict[StructuredOutputsParams, Future] = OrderedDict()
        self._lock = threading.Lock()  # _num_cached_bytes is added to by pool threads
        self._num_cached_bytes = 0
        self.cache_limit_bytes = cache_limit_bytes
        self.filler = TokenBitmaskFiller()

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """Start compiling spec's grammar (or find it compiled or compiling); its Future gives the
        compiled grammar. Raises StructuredOutputError at once for a schema, regex or grammar that
        does not parse (the compile itself needs no more checks)."""
        with self._lock:
            future = self._compiled.get(spec)
            if future is not None:
                self._compiled.move_to_end(spec)
                return future
        grammar = build_grammar(spec)
        future = self._pool.submit(self._compile, grammar, spec)
        with self._lock:
            self._compiled[spec] = future
            self._evict()
        return future

    def grammar_state(self, spec: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self.submit(spec), spec)

    def _compile(self, grammar: xgrammar.Grammar, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except RuntimeError as error:
            raise StructuredOutputError(f"{spec.source}: the grammar does not compile: {error}") from None
        with self._lock:
            if spec in self._compiled:
                self._num_cached_bytes += compiled.memory_size_bytes
        return compiled

    def _evict(self) -> None:
        """Drop the least recently used compiled grammars past the cache limit (a request holding
        one keeps it)."""
        for spec in list(self._compiled):
            if self._num_cached_bytes <= self.cache_limit_bytes or len(self._compiled) <= 1:
                return
            future = self._compiled[spec]
            if future.done():
                del self._compiled[spec]
                if future.exception() is None:
                    self._num_cached_bytes -= future.result().memory_size_bytes

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
