"""The service's wire contracts, shared by api, worker and client.

- `GenerateRequest`: the body of POST /generate (SamplingParams' fields by vLLM's names,
  plus the prompt and a priority).
- `JobPayload`: the kwargs of the RQ job (JSON, never pickle) that the api enqueues and
  `worker.jobs.generate` / the batch worker read back (and hand to the engine with `add_to`).
- `GenerationResult`: the job's return value, identical whichever worker ran it.
- `ResultResponse`: GET /result's body, built from the above.
- `SSE_ERROR_EVENT`: the GET /stream frame that says why a stream stops before its end.

What lives in Redis (keys, job states, job.meta's progress, stream events) is pagedq.redis_schema's.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator

from pagedq.beam_search import BeamSearchParams, LengthPenalty
from pagedq.outputs import CompletionOutput, FinishReason, Logprob, RequestOutput
from pagedq.redis_schema import InvalidJob, JobState
from pagedq.request_rules import INT64_MAX, INT64_MIN, ValidInput, describe_invalid
from pagedq.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedq.front.llm_engine import LLMEngine

# RQ job ids (our seq_ids) must match this.
SEQ_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")

# GET /stream's last frame when the stream cannot go on (Redis unavailable): {message,
# retry_after_s}. The job goes on: reconnect with Last-Event-ID.
SSE_ERROR_EVENT = "error"
STREAM_RETRY_AFTER_S = 2


class Message(ValidInput):
    """One turn of POST /generate's `messages`."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: StrictStr


class GenerateRequest(SamplingParams):
    """POST /generate. Inherits every sampling field (and strict, extra="forbid") from SamplingParams."""

    prompt: StrictStr | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[Message] | None = Field(
        None, description="Instead of prompt: a conversation, rendered through the checkpoint's chat template "
        "with the assistant's turn opened.",
    )
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX, description="Lower runs earlier (vLLM's convention).")
    stream: bool = Field(
        True, description="false: nobody will follow GET /stream (the client polls GET /result): the job's "
        "partial result is written every PAGEDQ_PROGRESS_INTERVAL_S, not every engine step, and its stream keeps "
        "only the end once it finishes.",
    )
    use_beam_search: bool = Field(False, description="Beam search instead of sampling; the result holds every beam, best first.")
    beam_width: int = Field(1, ge=1, le=64)
    length_penalty: LengthPenalty = Field(1.0, description="Beam score = cumulative logprob / length ** length_penalty.")

    @model_validator(mode="after")
    def _one_prompt_one_completion(self) -> GenerateRequest:
        if self.use_beam_search:
            sampling_only = sorted(self.model_fields_set & _SAMPLING_ONLY_FIELDS)
            if sampling_only:
                raise ValueError(f"{', '.join(sampling_only)}: not used by beam search (use_beam_search=true)")
            if self.max_tokens is None:
                raise ValueError("max_tokens: beam search needs a bound")
        elif self.model_fields_set & {"beam_width", "length_penalty"}:
            raise ValueError("beam_width, length_penalty: only with use_beam_search=true")
        if [self.prompt, self.prompt_token_ids, self.messages].count(None) != 2:
            raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt: must be non-empty")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids: must be non-empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: must be non-empty")
        return self

    def sampling_params(self) -> SamplingParams:
        return SamplingParams.model_validate(self.model_dump(include=set(SamplingParams.model_fields)))

    def beam_search_params(self) -> BeamSearchParams | None:
        if not self.use_beam_search:
            return None
        return BeamSearchParams(
            beam_width=self.beam_width, max_tokens=self.max_tokens, length_penalty=self.length_penalty,
            ignore_eos=self.ignore_eos,
        )


# Sampling fields beam search has no use for: setting one alongside use_beam_search is an error.
_SAMPLING_ONLY_FIELDS = set(SamplingParams.model_fields) - {
    "max_tokens", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
}


class JobPayload(ValidInput):
    """Read back from Redis by every worker, under the same rules as a request body: Redis
    may hold jobs that no api of this version checked."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: SamplingParams
    # Set for beam search, which then replaces sampling.
    beam: BeamSearchParams | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    enqueued_at: float
    # False: nobody follows the job's tokens as they come (a batch line, a polling client):
    # its deltas (its partial result) go to its Redis stream every progress_interval_s, not
    # every step, and are dropped when it finishes (ten thousand streams of every token
    # would only fill Redis; its result holds them all).
    stream: bool = True

    @property
    def engine_params(self) -> SamplingParams | BeamSearchParams:
        return self.beam if self.beam is not None else self.sampling

    @classmethod
    def read(cls, kwargs: dict) -> JobPayload:
        """A job's payload as read back from Redis; InvalidJob, naming the field, when it breaks the input rules."""
        try:
            return cls.model_validate(kwargs)
        except ValueError as exc:
            raise InvalidJob(describe_invalid(exc)) from None

    def add_to(self, engine: LLMEngine, request_id: str, report_every_s: float | None = None) -> None:
        """Hand this job to the engine as request `request_id` (the one way a payload becomes an
        engine request; `report_every_s` as LLMEngine.add_request takes it); InvalidJob,
        naming the field, when the engine refuses it."""
        try:
            engine.add_request(
                request_id,
                {"prompt_token_ids": self.prompt_token_ids},
                self.engine_params,
                arrival_time=self.enqueued_at,
                priority=self.priority,
                report_every_s=report_every_s,
            )
        except ValueError as exc:
            raise InvalidJob(str(exc)) from None


# A token its structured output or allowed_token_ids rule out has logprob -inf, which JSON
# cannot hold (a response with one was a 500, a stream's chunk invalid JSON): written as
# this, as vLLM's OpenAI server writes it.
LOGPROB_FLOOR = -9999.0


def logprob_dicts(steps: list[dict[int, Logprob]]) -> list[dict[str, float]]:
    """Logprobs as JSON holds them: {token id as text: logprob} per token, none below LOGPROB_FLOOR."""
    return [{str(token_id): max(lp.logprob, LOGPROB_FLOOR) for token_id, lp in step.items()} for step in steps]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class Timings(BaseModel):
    """Wall-clock times (time.time()) of the job's life; None until reached."""

    enqueued: float | None = None
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None


class Completion(BaseModel):
    """One of a job's outputs: a parallel sample (`index`), or a beam (best first)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # Per generated token: {token id (as a JSON key): logprob}.
    logprobs: list[dict[str, float]] | None = None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None

    @classmethod
    def from_output(cls, output: CompletionOutput, index: int) -> Completion:
        logprobs = None
        if output.logprobs is not None:
            logprobs = logprob_dicts(output.logprobs)
        return cls(
            index=index, text=output.text, token_ids=list(output.token_ids), cumulative_logprob=output.cumulative_logprob,
            logprobs=logprobs, finish_reason=output.finish_reason, stop_reason=output.stop_reason,
        )


class GenerationResult(BaseModel):
    seq_id: str
    prompt: str | None
    # The first output (n > 1: sample 0; beam search: the best beam).
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[str, float]] | None = None
    # With prompt_logprobs: per prompt token, None for the first, then {token id: logprob}
    # (the top alternatives and the prompt's own token).
    prompt_logprobs: list[dict[str, float] | None] | None = None
    # n > 1: every sample, by index.
    completions: list[Completion] | None = None
    # Beam search: every beam, best first.
    beams: list[Completion] | None = None
    # completion_tokens counts every sample's tokens (OpenAI's usage), the best beam's for beam search.
    usage: Usage
    timings: Timings

    @classmethod
    def from_output(
        cls, output: RequestOutput, seq_id: str, payload: JobPayload, started_at: float | None
    ) -> GenerationResult:
        outputs = [Completion.from_output(completion, index) for index, completion in enumerate(output.outputs)]
        first = outputs[0]
        many = len(outputs) > 1
        return cls(
            seq_id=seq_id,
            prompt=payload.prompt,
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason,
            stop_reason=first.stop_reason,
            cumulative_logprob=first.cumulative_logprob,
            logprobs=first.logprobs,
            prompt_logprobs=[None, *logprob_dicts(output.prompt_logprobs[1:])] if output.prompt_logprobs else None,
            completions=outputs if many and payload.beam is None else None,
            beams=outputs if payload.beam is not None else None,
            usage=Usage(
                prompt_tokens=len(output.prompt_token_ids),
                completion_tokens=len(first.token_ids) if payload.beam is not None else sum(len(o.token_ids) for o in outputs),
            ),
            timings=Timings(
                enqueued=payload.enqueued_at,
                started=started_at,
                first_token=output.metrics.first_token_time,
                finished=output.metrics.finished_time,
            ),
        )

    @property
    def outputs(self) -> list[Completion]:
        """Every output, the first included."""
        return self.beams or self.completions or [Completion(
            index=0, text=self.text, token_ids=self.token_ids, cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs, finish_reason=self.finish_reason, stop_reason=self.stop_reason,
        )]

    def output_ends(self) -> list[tuple[int, int, FinishReason | None, int | str | None]]:
        """How each output ended: (index, tokens generated, finish_reason, stop_reason), as
        a finished job's stream "end" event carries it (redis_schema.EVENT_END)."""
        return [(o.index, len(o.token_ids), o.finish_reason, o.stop_reason) for o in self.outputs]


class SubmitResponse(BaseModel):
    seq_id: str
    status: JobState
    result_url: str


class ResultResponse(BaseModel):
    seq_id: str
    status: JobState
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[dict[str, float] | None] | None = None
    completions: list[Completion] | None = None
    beams: list[Completion] | None = None
    usage: Usage | None = None
    timings: Timings = Field(default_factory=Timings)
    error: str | None = None


class ErrorResponse(BaseModel):
    """Every error the api returns."""

    error: str
    message: str
