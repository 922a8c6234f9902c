"""What crosses the engine core's boundary, in both directions: the one definition of each
message, whether the core runs in this process or its own (then msgpack-encoded by
msgspec, as vLLM V1's core messages are).

Into the core: `AddRequest` (token ids and settings; the front has tokenized and
validated it), `Abort`, `StopSequences`, `SetEosTokenIds`, `Shutdown`. Out of the core: one `CoreOutputs`
per step: each sequence's new token ids (a delta, never the tokens before it), how
sequences finished, requests the core failed alone, beam search's final hypotheses, and
when the core's state is asked for, its stats.

Request ids here are the front's internal integers: an id the front reuses after an abort
can never be confused with the request it named before.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagedq.beam_search import BeamSearchParams
from pagedq.sampling_params import SamplingParams
from pagedq.structured_outputs_params import StructuredOutputsParams


class AddRequest(msgspec.Struct, array_like=True, gc=False, tag=True):
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    # Beam search: `params` then holds what every beam shares (greedy, max_tokens, ignore_eos).
    beam: BeamSearchParams | None = None
    # Report each step's tokens as they come; False: each sequence's tokens arrive in
    # chunks (`CoreOutputs.token_chunks`), once when it ends or, with `report_every_s`, also
    # at most that often while it runs. The front asks for chunks when nobody watches the
    # tokens go by (final-only outputs; a service job nobody streams, whose progress is
    # published only every so often), and never with stop strings or logprobs.
    stream: bool = True
    report_every_s: float | None = None
    # params.bad_words as token id sequences (the core has no tokenizer; the front does).
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)


class Abort(msgspec.Struct, array_like=True, gc=False, tag=True):
    request_ids: list[int]


class StopSequences(msgspec.Struct, array_like=True, gc=False, tag=True):
    """Sequences the front ended (a stop string): (request id, sequence index)."""

    sequences: list[tuple[int, int]]


class SetEosTokenIds(msgspec.Struct, array_like=True, gc=False, tag=True):
    """For tests that make an ordinary token the eos."""

    token_ids: list[int]


class Shutdown(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


CoreInput = AddRequest | Abort | StopSequences | SetEosTokenIds | Shutdown


class BeamHypothesis(msgspec.Struct, array_like=True, gc=False):
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str


class CoreOutputs(msgspec.Struct, array_like=True, gc=False):
    """What one step made known. Rows i of `request_ids`, `seq_indexes` and `token_ids`
    say: output `seq_indexes[i]` of request `request_ids[i]` gained `token_ids[i]`."""

    request_ids: list[int] = msgspec.field(default_factory=list)
    seq_indexes: list[int] = msgspec.field(default_factory=list)
    token_ids: list[int] = msgspec.field(default_factory=list)
    # For rows whose request asked for logprobs: (row, the token's logprob, top entries as
    # (token id, logprob, rank), the sampled token among them).
    logprobs: list[tuple[int, float, list[tuple[int, float, int]]]] = msgspec.field(default_factory=list)
    # (request id, per prompt position of this step in order: (token id, logprob, rank) of
    # the top prompt_logprobs tokens and the prompt's next token), for requests that asked.
    prompt_logprobs: list[tuple[int, list[list[tuple[int, float, int]]]]] = msgspec.field(default_factory=list)
    # (request id, sequence index, finish_reason "stop" or "length", stop_reason)
    finished: list[tuple[int, int, str, int | None]] = msgspec.field(default_factory=list)
    # Output tokens of requests added with stream=False, each sequence's since its last
    # chunk: when it ends (or fails) and as its report_every_s falls due. (request id,
    # sequence index, token ids, when the request's first token came).
    token_chunks: list[tuple[int, int, list[int], float]] = msgspec.field(default_factory=list)
    # Requests scheduled for the first time: (request id, when, prompt tokens found cached).
    scheduled: list[tuple[int, float, int]] = msgspec.field(default_factory=list)
    # Requests the core failed alone, for something they caused: (request id, why, whether
    # their input alone is to blame: constraints that leave no token, a grammar that does
    # not compile: the client's error, 4xx in the service).
    failed: list[tuple[int, str, bool]] = msgspec.field(default_factory=list)
    # Beam search requests that ended: (request id, best hypotheses first).
    beams: list[tuple[int, list[BeamHypothesis]]] = msgspec.field(default_factory=list)
    # Output tokens this step made for requests whose tokens come in chunks (not in the
    # rows): a core in its own process sends such a step all the same, so a front that
    # paces itself by the core's steps (the service's worker) is not left waiting for a chunk.
    unreported_tokens: int = 0
    # When the host learned these tokens (time.time()).
    timestamp: float = 0.0
    # The core's counters and queue sizes after this step (EngineCore.stats()), when sent.
    stats: dict[str, Any] | None = None
    # The step raised: every request of the core was dropped (set by the core's process).
    error: str | None = None


class CoreInfo(msgspec.Struct, gc=False):
    """What the front needs to know of the core it drives, once, when the core is ready."""

    vocab_size: int
    max_model_len: int
    device: str
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    attention_backend: str
    # 2: overlapped steps (the next launched before the last one's tokens are read).
    max_steps_in_flight: int


def _encode_hook(value: Any) -> Any:
    if isinstance(value, (SamplingParams, BeamSearchParams)):
        return value.model_dump()
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


def _decode_hook(kind: type, value: Any) -> Any:
    if kind in (SamplingParams, BeamSearchParams):
        # Validated once, by the front; rebuilt here without checking again.
        params = kind.model_construct(**value)
        if value.get("structured_outputs") is not None:
            params.__dict__["structured_outputs"] = StructuredOutputsParams.model_construct(**value["structured_outputs"])
        return params
    raise NotImplementedError(f"cannot decode {kind.__name__}")


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_encode_hook)


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreInput, dec_hook=_decode_hook)


def outputs_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreOutputs)
