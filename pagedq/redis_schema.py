"""Everything the service keeps in Redis, named in one place; api and worker both import it.

RQ's own keys (job hashes, queues, registries) are named by RQ's classes (`Job.key_for`,
`Queue.key`, each registry's `key`), as RQ's nouns own their keys; this module names ours
and the parts of RQ's records that we define:

- jobs: the job function's path, our fields in `job.meta` (the running job's `Progress`),
  the job states the api shows and their mapping from RQ's statuses;
- queues: the batch queue beside each interactive one, and the api's cancel counter;
- each job's event stream (what GET /stream relays): its key, the event names and fields,
  their writers (the api's and the worker's) and their reader;
- files (/v1/files) and batches (/v1/batches).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from pydantic import BaseModel
from redis.client import Pipeline
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

# ---- jobs ---------------------------------------------------------------------------

# The RQ job function, by dotted path so the api never imports engine code.
JOB_FUNCTION = "worker.jobs.generate"
# How every job and result is serialized, by the api, the workers and every reader: JSON,
# never pickle (nothing read from Redis may execute code). The class, as RQ's workers name
# their serializer by its path.
JOB_SERIALIZER = JSONSerializer
# job.meta fields: the running job's partial result, and the request body's hash (Idempotency-Key replays).
PROGRESS_META_KEY = "progress"
BODY_HASH_META_KEY = "request_sha256"
# The tenant that made the job (api.auth.Caller.tenant: a tenant's name or a key's hash, never a key).
OWNER_META_KEY = "owner"


def owner_of(raw_meta: bytes | None) -> str:
    """The owner in a job hash's raw `meta` field (JSON, the jobs' serializer), without fetching the job."""
    return json.loads(raw_meta).get(OWNER_META_KEY, "") if raw_meta else ""

JobState = Literal["queued", "running", "finished", "failed", "canceled"]
TERMINAL: frozenset[JobState] = frozenset({"finished", "failed", "canceled"})
_STATES: dict[str, JobState] = {
    JobStatus.QUEUED: "queued",
    JobStatus.DEFERRED: "queued",
    JobStatus.SCHEDULED: "queued",
    JobStatus.CREATED: "queued",
    JobStatus.STARTED: "running",
    JobStatus.FINISHED: "finished",
    JobStatus.FAILED: "failed",
    JobStatus.STOPPED: "failed",
    JobStatus.CANCELED: "canceled",
}


def job_state(rq_status: str | bytes | None) -> JobState | None:
    """The state shown for a job whose RQ status is this (None: no such job)."""
    if rq_status is None:
        return None
    return _STATES.get(rq_status.decode() if isinstance(rq_status, bytes) else rq_status, "queued")


# How a job failed, as RQ records it (the last line of the job's exc_string starts with
# failure_line(the exception's class)): the worker raises these, the api reads them back.
class InvalidJob(ValueError):
    """A job whose input no engine can run (the same on every attempt): the worker fails it
    at once and never retries it; the api answers it as the client's error (4xx)."""


class RequestFailed(RuntimeError):
    """Something a job's own request caused threw inside an engine step; the engine's other
    requests carried on. Deterministic, so never retried (retries are for lost workers)."""


def request_failure(error: str, invalid_input: bool) -> Exception:
    """What a job whose request the engine failed alone fails with: InvalidJob when its input
    alone is to blame (RequestOutput.invalid_input: the api answers 4xx), else RequestFailed."""
    return (InvalidJob if invalid_input else RequestFailed)(error)


def failure_line(exc_type: type[BaseException]) -> str:
    """How the last line of the exc_string of a job failed by `exc_type` starts."""
    return f"{exc_type.__module__}.{exc_type.__qualname__}: "


class Progress(BaseModel):
    """How a job's current attempt started, kept in job.meta (written once per attempt). What
    it has produced so far is in its stream (read_partial)."""

    prompt_tokens: int = 0
    # 1 for the first run; a requeued job (its worker died) starts over with attempt 2, ...
    attempt: int = 0


def write_progress(pipeline: Pipeline, job: Job, progress: Progress) -> None:
    """Queue the job's meta (what job.save_meta() writes) with this progress in it."""
    job.meta[PROGRESS_META_KEY] = progress.model_dump(mode="json")
    pipeline.hset(job.key, "meta", job.serializer.dumps(job.meta))


def read_progress(job: Job) -> Progress:
    return Progress.model_validate(job.meta.get(PROGRESS_META_KEY) or {})


# ---- queues -------------------------------------------------------------------------


def batch_queue_name(queue_name: str) -> str:
    """The RQ queue of batch requests (/v1/batches lines). Workers take from it only when
    the interactive queue is empty, so a large batch never stands in front of a request."""
    return f"{queue_name}.batch"


# A canceled job is kept as long as a finished one (the api's `result_ttl_s`), then expires
# with everything it holds (prompt, partial text); RQ's cancel sets no TTL, and its registry
# of canceled jobs is pruned by the api's retention sweep (api/retention.py).
# KEYS: job hashes. ARGV: the canceled status, the TTL. Sets the TTL of those canceled and
# without one; a job requeued instead (reaped after a stall) keeps none.
EXPIRE_CANCELED_SCRIPT = """
for i = 1, #KEYS do
    if redis.call('HGET', KEYS[i], 'status') == ARGV[1] and redis.call('TTL', KEYS[i]) == -1 then
        redis.call('EXPIRE', KEYS[i], ARGV[2])
    end
end
return 0
"""


def expire_canceled(pipeline: Pipeline, job_keys: list[str], ttl_s: int) -> None:
    if job_keys:
        # EVAL, not EVALSHA: a pipeline cannot reload a script a restarted Redis forgot.
        pipeline.eval(EXPIRE_CANCELED_SCRIPT, len(job_keys), *job_keys, JobStatus.CANCELED.value, ttl_s)


def cancels_key(queue_name: str) -> str:
    """A counter the api bumps on every cancel, so workers look for canceled jobs only
    when it changes instead of reading every in-flight job's status every engine step."""
    return f"pagedq:cancels:{queue_name}"


# Written (and expiring at once) by every GET /ready: a Redis that refuses writes (out of
# memory, read-only after a failover) is not ready, however well it answers reads.
READY_PROBE_KEY = "pagedq:ready-probe"
READY_PROBE_TTL_S = 5


# ---- job event streams --------------------------------------------------------------


def stream_key(seq_id: str) -> str:
    return f"pagedq:stream:{seq_id}"


# Every job's end, as {"seq_id": ...}, beside the "end" entry in its own stream: the api's
# long-poll waiters (GET /result?wait=, non-streamed /v1 completions) follow this one
# stream instead of every token of their jobs' streams. Trimmed to about ENDED_MAXLEN
# entries: a reader that falls further behind misses ends and finds them by the job's status.
ENDED_KEY = "pagedq:ended"
ENDED_MAXLEN = 10_000


# Every write to jobs' streams is announced here, as {"keys": "<stream key> <stream key> ..."}
# (one entry per script call that wrote, and one per event appended by _append_event), so the api's hub reads only the
# streams that have news instead of every stream it follows on every read (a read's cost
# grows with its keys: 1.9 ms of the api's CPU for 512 streams, 0.6 ms for the 57 with news).
# An engine step's deltas (PUBLISH_STEP_SCRIPT) are announced with the entries themselves,
# "entries": the JSON list of [stream key, the stream's entry before it, entry id, [field,
# value, ...]], so the hub relays them from this one stream without reading the jobs'
# streams: an XREAD of a few hundred streams seeks into each (Redis spent ~1.2 ms a read, a
# third of its CPU under streaming clients, and the api parsed every stream's reply).
# Trimmed to about WRITTEN_MAXLEN entries (with the deltas, the last few seconds of every
# stream's text: ~10 MB at 1,000 steps of 256 jobs): a hub further behind reads every stream it
# follows each second anyway (api.streaming.StreamHub), so nothing is lost, only later.
WRITTEN_KEY = "pagedq:streams-written"
WRITTEN_MAXLEN = 1_000
# announce(written key, space-separated stream keys[, entries]) in a script that writes
# streams; `entries`: a Lua list of {stream key, the entry before, entry id, fields}.
ANNOUNCE_LUA = f"""
local function announce(written_key, stream_keys, entries)
    if entries then
        redis.call('XADD', written_key, 'MAXLEN', '~', {WRITTEN_MAXLEN}, '*', 'keys', stream_keys,
                   'entries', cjson.encode(entries))
    else
        redis.call('XADD', written_key, 'MAXLEN', '~', {WRITTEN_MAXLEN}, '*', 'keys', stream_keys)
    end
end
"""


def announce_written(pipeline: Pipeline, stream_keys: list[str]) -> None:
    """Queue the announcement of writes to these streams (after the writes, in the same pipeline)."""
    pipeline.xadd(WRITTEN_KEY, {"keys": " ".join(stream_keys)}, maxlen=WRITTEN_MAXLEN, approximate=True)


def api_wake_key(token: str) -> str:
    """A stream an api process XADDs to so its own blocked XREAD returns (api.streaming.StreamHub)."""
    return f"pagedq:api-wake:{token}"


# Stream events (fields of one Redis stream entry, all strings).
# {"type": "delta", "index": "I", "text": "...", "num_tokens": "N"[, "logprobs": JSON]}: output
# I's new text (possibly empty: a token that ends mid-character) and its count of tokens
# generated so far; with logprobs asked for, its new tokens as [[id, {id: logprob}], ...].
EVENT_DELTA = "delta"
EVENT_RESET = "reset"  # {"type": "reset", "attempt": "A"}: a retried attempt starts over: drop the text received so far
# {"type": "end", "status": JobState, "finish_reason": ...}; a finished job's also says how
# each output ended, what an OpenAI stream's last chunks need (no read of the job then):
# "outputs": JSON [[index, num_tokens, finish_reason, stop_reason], ...], "completion_tokens": "N".
EVENT_END = "end"


def delta_logprobs(token_ids: list[int], steps: list[dict[str, float]]) -> list:
    """A delta's `logprobs`: each new token with its step's {token id: logprob}, [[id, {id: logprob}], ...]."""
    return [[token, step] for token, step in zip(token_ids, steps)]


# ---- fencing -----------------------------------------------------------------------
# A worker writes for a job (stream events, progress, result, status) only while its
# execution still owns the job: the job hash says STARTED, by this execution (the batch
# worker records its execution's composite key in the job hash, EXECUTION_FIELD, in the
# transaction that starts it). A job reaped after its worker's heartbeats stopped goes back
# to QUEUED (or FAILED), and a rerun records its own execution, so a worker that stalled
# past its heartbeat TTL and wakes up writes nothing for the jobs it lost. The check runs
# in the same script as the writes. One HMGET: the check runs for every job each step.
# `owns(job hash, execution composite key)`; an empty key means unfenced (RQ's own worker
# running worker.jobs.generate owns its one job).
EXECUTION_FIELD = "pagedq_execution"
_OWNS_LUA = f"""
local function owns(job_key, execution)
    if execution == '' then return true end
    local job = redis.call('HMGET', job_key, 'status', '{EXECUTION_FIELD}')
    return job[1] == '{JobStatus.STARTED.value}' and job[2] == execution
end
"""
# owns() skips its check.
UNFENCED = ""


def record_execution(pipeline: Pipeline, job: Job, composite_key: str) -> None:
    """In the transaction that starts the job: from now on only this execution owns it."""
    pipeline.hset(job.key, EXECUTION_FIELD, composite_key)


# Writes one engine step's deltas in one round trip, whatever the number of jobs: on a
# small model the worker's Redis traffic would otherwise cost as much as the step itself.
# A job's stream is also its partial result (read_partial): each token travels once, in
# the delta that carries it, and nothing is rewritten as the job grows.
# KEYS: per job, its hash and its stream, then WRITTEN_KEY (the streams written and the
# entries written to them are announced there, in one entry). ARGV: the stream TTL, then per job: its
# execution's composite key (owns() above), its number of deltas (a job with n > 1 outputs
# has one per output) and DELTA_ARGS per delta: (index, text, num_tokens, new, logprobs,
# check, ids, first_token). `ids`: the delta's token ids, comma-separated. `logprobs` is ""
# unless the job asked for them: then the JSON list of the delta's new tokens (the delta
# event's `logprobs` field). An attempt's first delta (new = 1) carries `first_token` (when
# the attempt's first token came, Unix seconds) and sets the stream's TTL, which XADD then
# keeps. `check` = 1: an earlier send's reply was lost, so the stream may hold this delta
# already; it is written only if the output's last delta in the stream (since its last
# reset) counts fewer tokens. The worker splits such text where each uncertain send ended,
# so each piece is either wholly in the stream or wholly not. A job whose execution no
# longer owns it gets nothing written; the script returns those jobs' positions (1-based).
DELTA_ARGS = 8
PUBLISH_STEP_SCRIPT = _OWNS_LUA + ANNOUNCE_LUA + f"""
-- num_tokens of output `index`'s last delta in the stream since its last reset (0: none).
local function tokens_in(stream, index)
    local before = '+'
    while true do
        local entries = redis.call('XREVRANGE', stream, before, '-', 'COUNT', 64)
        for _, entry in ipairs(entries) do
            local fields = {{}}
            for f = 1, #entry[2], 2 do fields[entry[2][f]] = entry[2][f + 1] end
            if fields['type'] == '{EVENT_RESET}' then return 0 end
            if fields['type'] == '{EVENT_DELTA}' and fields['index'] == index then return tonumber(fields['num_tokens']) end
        end
        if #entries < 64 then return 0 end
        before = '(' .. entries[#entries][1]
    end
end
-- The id of the stream's last entry ("0-0": none), which a delta's announcement carries.
local function last_id(stream)
    local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
    if last[1] then return last[1][1] end
    return '0-0'
end
local ttl, at, lost, written, entries, last_written = ARGV[1], 2, {{}}, {{}}, {{}}, {{}}
for j = 1, (#KEYS - 1) / 2 do
    local job_key, stream = KEYS[2 * j - 1], KEYS[2 * j]
    local execution, deltas = ARGV[at], tonumber(ARGV[at + 1])
    local mine = owns(job_key, execution)
    at = at + 2
    if not mine then
        lost[#lost + 1] = j
        at = at + {DELTA_ARGS} * deltas
    else
        local held = {{}}
        for d = 1, deltas do
            local index, num_tokens = ARGV[at], tonumber(ARGV[at + 2])
            if ARGV[at + 5] == '1' and held[index] == nil then held[index] = tokens_in(stream, index) end
            if held[index] == nil or num_tokens > held[index] then
                local fields = {{'type', '{EVENT_DELTA}', 'index', index, 'text', ARGV[at + 1], 'num_tokens', ARGV[at + 2],
                                'ids', ARGV[at + 6]}}
                if ARGV[at + 4] ~= '' then
                    fields[#fields + 1] = 'logprobs'
                    fields[#fields + 1] = ARGV[at + 4]
                end
                if ARGV[at + 3] == '1' then
                    fields[#fields + 1] = 'first_token'
                    fields[#fields + 1] = ARGV[at + 7]
                end
                if last_written[stream] == nil then last_written[stream] = last_id(stream) end
                local id = redis.call('XADD', stream, '*', unpack(fields))
                entries[#entries + 1] = {{stream, last_written[stream], id, fields}}
                last_written[stream] = id
                if ARGV[at + 3] == '1' then
                    redis.call('EXPIRE', stream, ttl)
                end
                if written[#written] ~= stream then written[#written + 1] = stream end
            end
            at = at + {DELTA_ARGS}
        end
    end
end
if #written > 0 then announce(KEYS[#KEYS], table.concat(written, ' '), entries) end
return lost
"""

# `run_commands(at, wanted)`: the list of recorded commands at ARGV[at] (their number, then
# per command its argument count and arguments, as _add_commands() writes them), run if
# `wanted`; returns where ARGV goes on after it.
_RUN_COMMANDS_LUA = """
local function run_commands(at, wanted)
    local commands = tonumber(ARGV[at])
    at = at + 1
    for c = 1, commands do
        local argc = tonumber(ARGV[at])
        if wanted then redis.call(unpack(ARGV, at + 1, at + argc)) end
        at = at + 1 + argc
    end
    return at
end
"""

# Runs, for each job its execution still owns (owns() above), the commands given for it:
# what RQ's success path would have sent in its own transaction (redis-py queues them
# on a pipeline that is never executed; their arguments come here), then the stream's
# "end". One round trip for every job finished in an engine step, atomic with the check.
# KEYS: per job, its hash. ARGV: per job: its execution's composite key, its number of
# commands, then per command its argument count and arguments. Returns the positions
# (1-based) of the jobs it wrote nothing for.
FENCED_COMMANDS_SCRIPT = _OWNS_LUA + _RUN_COMMANDS_LUA + """
local at, lost = 1, {}
for j = 1, #KEYS do
    local mine = owns(KEYS[j], ARGV[at])
    if not mine then lost[#lost + 1] = j end
    at = run_commands(at + 1, mine)
end
return lost
"""


class FencedWrite(NamedTuple):
    """Commands recorded for one job on `recorder` (a pipeline that never runs: RQ's own
    methods write to it), to run only while `execution_key` owns the job."""

    job_key: str
    execution_key: str
    recorder: Pipeline


def queue_fenced_commands(pipeline: Pipeline, writes: list[FencedWrite]) -> None:
    """Queue on `pipeline` one FENCED_COMMANDS_SCRIPT call that replays each write's
    recorded commands if its execution still owns its job. The call's reply: the 1-based
    positions of the writes refused."""
    keys: list[str] = []
    args: list = []
    for job_key, execution_key, recorder in writes:
        keys.append(job_key)
        args.append(execution_key)
        _add_commands(args, recorder)
    pipeline.eval(FENCED_COMMANDS_SCRIPT, len(keys), *keys, *args)


# Starts the jobs a worker took from its queues (worker/rq/job_starts.py), each atomically
# with the check that its hash is still the queued job the worker read: a cancel or a
# delete landing between that read and this write wins, and a job deleted and enqueued
# again under its id (an Idempotency-Key reused after expiry) is told apart by its
# created_at. What WATCH and MULTI would do, in one script call for every job, without
# a transaction's per-command replies. Each job's removal from the intermediate list it
# was moved to runs whatever the check says.
# KEYS: per job, its hash. ARGV: per job: "1" if a job was read ("0" if none was there), its
# created_at as read ("" if it had none), then its removal's commands and its start's
# commands, each a list of recorded commands as run_commands() takes them. Returns the
# positions (1-based) of the jobs not started.
START_JOBS_SCRIPT = _RUN_COMMANDS_LUA + f"""
local at, skipped = 1, {{}}
for j = 1, #KEYS do
    local job = redis.call('HMGET', KEYS[j], 'status', 'created_at')
    local queued = ARGV[at] == '1' and job[1] == '{JobStatus.QUEUED.value}' and (job[2] or '') == ARGV[at + 1]
    if not queued then skipped[#skipped + 1] = j end
    at = run_commands(run_commands(at + 2, true), queued)
end
return skipped
"""


class JobStart(NamedTuple):
    """Commands recorded for starting one job that a worker took (pipelines that never
    run): `removal` runs whatever, `start` only while the job's hash is still the queued
    job read with `created_at` ("" if it had none; None: no job was read, and `start` holds
    nothing)."""

    job_key: str
    created_at: str | None
    removal: Pipeline
    start: Pipeline


def queue_job_starts(pipeline: Pipeline, starts: list[JobStart]) -> None:
    """Queue on `pipeline` one START_JOBS_SCRIPT call for `starts`. Its reply: the 1-based
    positions of the jobs not started."""
    keys: list[str] = []
    args: list = []
    for job_key, created_at, removal, start in starts:
        keys.append(job_key)
        args += ["0", ""] if created_at is None else ["1", created_at]
        _add_commands(args, removal)
        _add_commands(args, start)
    pipeline.eval(START_JOBS_SCRIPT, len(keys), *keys, *args)


def _add_commands(args: list, recorder: Pipeline) -> None:
    """A recorder's commands as the scripts above take them: their number, then each one's
    argument count and arguments."""
    commands = [command for command, _ in recorder.command_stack]
    args.append(len(commands))
    for command in commands:
        args += [len(command), *command]


def _append_event(pipeline: Pipeline, seq_id: str, stream_ttl_s: int, fields: dict[str, str]) -> None:
    key = stream_key(seq_id)
    pipeline.xadd(key, fields)
    pipeline.expire(key, stream_ttl_s)
    announce_written(pipeline, [key])


def publish_reset(pipeline: Pipeline, seq_id: str, attempt: int, stream_ttl_s: int) -> None:
    _append_event(pipeline, seq_id, stream_ttl_s, {"type": EVENT_RESET, "attempt": str(attempt)})


def publish_end(pipeline: Pipeline, seq_id: str, status: JobState, stream_ttl_s: int, finish_reason: str = "",
                outputs: list[tuple[int, int, str | None, int | str | None]] | None = None,
                completion_tokens: int | None = None) -> None:
    fields = {"type": EVENT_END, "status": status, "finish_reason": finish_reason}
    if outputs is not None:
        fields.update(outputs=json.dumps(outputs), completion_tokens=str(completion_tokens))
    _append_event(pipeline, seq_id, stream_ttl_s, fields)
    pipeline.xadd(ENDED_KEY, {"seq_id": seq_id}, maxlen=ENDED_MAXLEN, approximate=True)


Entry = tuple[str, dict[str, str]]


def decode_entries(raw: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Entry]:
    """Stream entries as redis-py returns them (XRANGE, XREAD's per-stream lists), decoded."""
    return [(entry_id.decode(), {k.decode(): v.decode() for k, v in fields.items()}) for entry_id, fields in raw]


class Announced(NamedTuple):
    """An entry written to a job's stream, as its announcement in WRITTEN_KEY carries it."""

    key: str
    # The stream's entry before it ("0-0": none): a reader whose cursor is behind this has
    # entries to read from the stream itself first.
    before: str
    entry_id: str
    # field, value, field, value, ...: entry_fields() makes them the entry's.
    flat_fields: list[str]


def announced_entries(fields: dict[bytes, bytes]) -> list[Announced]:
    """The stream entries a WRITTEN_KEY announcement carries, oldest first ([]: it names the streams only)."""
    raw = fields.get(b"entries")
    return [Announced(*item) for item in json.loads(raw)] if raw else []


def entry_fields(flat_fields: list[str]) -> dict[str, str]:
    return dict(zip(flat_fields[::2], flat_fields[1::2]))


# (kind, data, entry id): `delta` {index, text, num_tokens[, logprobs]}, `reset` {attempt}, `end` {status, finish_reason}.
Event = tuple[str, dict, str | None]


@dataclass
class PartialOutput:
    """One output's text and token ids so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)


@dataclass
class Partial:
    """What a job's current attempt has produced so far, from its stream: each output (by
    index; n > 1 has several) and when the first token of any of them came."""

    outputs: dict[int, PartialOutput] = field(default_factory=dict)
    first_token: float | None = None

    def output(self, index: int) -> PartialOutput:
        return self.outputs.get(index) or PartialOutput()

    @property
    def completion_tokens(self) -> int:
        """Every output's tokens, as a finished job's usage counts them."""
        return sum(len(output.token_ids) for output in self.outputs.values())


def read_partial(entries: list[Entry]) -> Partial:
    """The partial result in a job's stream entries (all of them, oldest first): each
    output's deltas since the last reset, and when the first token of any output came."""
    partial, texts = Partial(), {}
    for _, fields in entries:
        kind = fields.get("type")
        if kind == EVENT_RESET:
            partial, texts = Partial(), {}
        elif kind == EVENT_DELTA:
            if partial.first_token is None and fields.get("first_token"):
                partial.first_token = float(fields["first_token"])  # on the attempt's first delta, of any output
            index = int(fields.get("index", "0"))
            output = partial.outputs.setdefault(index, PartialOutput())
            texts.setdefault(index, []).append(fields.get("text", ""))
            ids = fields.get("ids", "")
            if ids:
                output.token_ids += map(int, ids.split(","))
    for index, pieces in texts.items():
        partial.outputs[index].text = "".join(pieces)
    return partial


def read_events(batch: list[Entry]) -> list[Event]:
    """The events of a batch of stream entries, up to an `end`. Consecutive deltas of one
    output merge into one (the last one's id and count), so a client that fell behind
    catches up in one event instead of one per token."""
    events: list[Event] = []
    text, logprobs, last_delta = [], None, None
    for entry_id, fields in [*batch, ("", {})]:
        kind = fields.get("type")
        if last_delta is not None and (kind != EVENT_DELTA or fields.get("index") != last_delta[1].get("index")):
            delta_id, delta = last_delta
            data = {"index": int(delta.get("index", "0")), "text": "".join(text), "num_tokens": int(delta.get("num_tokens", "0"))}
            if logprobs is not None:
                data["logprobs"] = logprobs
            events.append(("delta", data, delta_id))
            text, logprobs, last_delta = [], None, None
        if kind == EVENT_DELTA:
            text.append(fields.get("text", ""))
            if "logprobs" in fields:
                logprobs = (logprobs or []) + json.loads(fields["logprobs"])
            last_delta = (entry_id, fields)
        elif kind == EVENT_RESET:
            events.append(("reset", {"attempt": int(fields.get("attempt", "0"))}, entry_id))
        elif kind == EVENT_END:
            end = {"status": fields.get("status"), "finish_reason": fields.get("finish_reason") or None}
            if "outputs" in fields:
                end.update(outputs=json.loads(fields["outputs"]), completion_tokens=int(fields["completion_tokens"]))
            events.append(("end", end, entry_id))
            break
    return events


# ---- files and batches --------------------------------------------------------------


def file_meta_key(file_id: str) -> str:
    return f"pagedq:file:{file_id}"


def file_content_key(file_id: str) -> str:
    return f"pagedq:file:{file_id}:content"


# Every file id by creation time (GET /v1/files); ids whose metadata expired are pruned when listed.
FILES_KEY = "pagedq:files"


# Every batch id, scored by creation time (newest first in listings); the ones still running.
BATCHES_KEY = "pagedq:batches"
ACTIVE_BATCHES_KEY = "pagedq:batches:active"


def tenant_batches_key(owner: str) -> str:
    """The batch ids of one owner (see OWNER_META_KEY), scored like BATCHES_KEY."""
    return f"pagedq:batches:of:{owner}"


def batch_key(batch_id: str, part: str = "") -> str:
    """A batch's record; with `part`, one of its companions (lines, errors, outcomes, docs, cancel, lease)."""
    return f"pagedq:batch:{batch_id}{':' + part if part else ''}"
