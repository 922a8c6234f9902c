"""The Batch API and `pagedq batch` end to end: a real redis-server, the api under uvicorn
(more than one, restarted) and `pagedq worker` processes (SIGKILLed mid-batch). Workers
hold 8 jobs, 2 of them reserved for interactive requests."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from redis import Redis
from rq import Queue
from rq.job import Job
from rq.registry import FinishedJobRegistry
from rq.serializers import JSONSerializer
from rq.suspension import resume
from transformers import AutoTokenizer

import pagedq
from pagedq.cli import main
from pagedq.client import Client
from pagedq.redis_server import RedisServer, free_port
from tests.service_helpers import (
    ApiServer,
    WorkerProcess,
    offline_greedy,
    service_settings,
    suspend_workers,
    wait_for_worker,
    wait_until,
)

pytestmark = pytest.mark.slow
QUEUE = "bq"
BATCH_QUEUE = f"{QUEUE}.batch"
BATCH_PRIORITY = 10


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir()


class Service:
    def __init__(self, model: Path, tmp: Path):
        self.tmp = tmp
        self.redis_server = RedisServer(tmp / "redis").start()
        self.redis = Redis.from_url(self.redis_server.url)
        self.settings = service_settings(
            model, self.redis_server.url, tmp, queue_name=QUEUE, max_inflight=8, reserved_interactive_slots=2,
            batch_poll_interval_s=0.3, batch_priority=BATCH_PRIORITY,
        )
        self.workers: list[WorkerProcess] = []
        self.apis: list[ApiServer] = []

    def start_worker(self) -> WorkerProcess:
        worker = WorkerProcess(self.settings, self.tmp / f"worker-{len(self.workers)}.log")
        self.workers.append(worker)
        return worker

    def start_api(self) -> ApiServer:
        """Another api process's worth: same Redis and queue, its own port."""
        api = ApiServer(self.settings.with_overrides(port=free_port())).start()
        self.apis.append(api)
        return api

    def stop(self) -> None:
        for api in self.apis:
            api.stop()
        for worker in self.workers:
            worker.stop()
        self.redis_server.stop()


@pytest.fixture(scope="module")
def service(model, tmp_path_factory):
    service = Service(model, tmp_path_factory.mktemp("batches"))
    try:
        service.start_worker()
        wait_for_worker(service.start_api().url)
        yield service
    finally:
        service.stop()


@pytest.fixture
def api(service) -> ApiServer:
    return service.apis[0]


@pytest.fixture
def oai(api):
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=120)


def completion_line(custom_id: str, model: str, prompt: str, max_tokens: int = 4, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def jsonl(lines: list) -> bytes:
    return "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines).encode() + b"\n"


def wait_for_batch(oai: openai.OpenAI, batch_id: str, timeout_s: float = 120):
    return wait_until(lambda: (b := oai.batches.retrieve(batch_id)).status in ("completed", "failed", "cancelled", "expired")
                      and b, timeout_s, f"batch {batch_id} to end", interval_s=0.2)


def parse_lines(content: bytes) -> list[dict]:
    return [json.loads(line) for line in content.splitlines()]


def fetch_jobs(redis: Redis, ids: list[str]) -> list[Job]:
    return Job.fetch_many(ids, connection=redis, serializer=JSONSerializer)


def test_openai_client_runs_a_batch_and_each_bad_line_fails_alone(service, oai, model):
    names = [f"ok-{i}" for i in range(6)]
    good = [completion_line(name, model.name, f"Document number {i} says hello") for i, name in enumerate(names)]
    lines = [
        *good[:3],
        '{"custom_id": "broken", "method": "POST", "url": "/v1/completions", "body": {',   # not JSON
        {**completion_line("wrong-url", model.name, "x"), "url": "/v1/chat/completions"},
        completion_line("unknown-model", "gpt-4", "x"),
        completion_line("best-of", model.name, "x", best_of=2),
        "",                                                                                  # blank: skipped
        *good[3:],
        completion_line("ok-0", model.name, "a second ok-0"),                                # duplicate custom_id
        completion_line("\ud800", model.name, "x"),                                          # not valid Unicode
    ]
    uploaded = oai.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h",
                               metadata={"run": "nightly"})
    assert batch.status == "in_progress" and batch.request_counts.total == 12 and batch.metadata == {"run": "nightly"}
    batch = wait_for_batch(oai, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (12, 6, 6)
    assert batch.id in [b.id for b in oai.batches.list().data]

    output = parse_lines(oai.files.content(batch.output_file_id).content)
    assert sorted(line["custom_id"] for line in output) == names
    expected = dict(zip(names, offline_greedy(model, [line["body"] for line in good])))
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 4
        (job,) = fetch_jobs(service.redis, [line["response"]["request_id"]])
        assert job.return_value()["token_ids"] == expected[line["custom_id"]]
        assert body["choices"][0]["text"] == job.return_value()["text"]
        # An ordinary job, in the batch queue, at the batch priority, not streamed.
        assert job.origin == BATCH_QUEUE and job.kwargs["priority"] == BATCH_PRIORITY and job.kwargs["stream"] is False

    # The batch's usage sums its completed requests'.
    assert batch.usage.output_tokens == 6 * 4 and batch.usage.total_tokens == batch.usage.input_tokens + 24
    assert batch.usage.input_tokens == sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in output)

    errors = parse_lines(oai.files.content(batch.error_file_id).content)
    by_id = {line["custom_id"]: line for line in errors}
    assert [line["custom_id"] for line in errors] == [None, "wrong-url", "unknown-model", "best-of", "ok-0", None]
    # A custom_id that is not valid Unicode is not written into the (UTF-8) output files.
    assert "custom_id: contains a lone UTF-16 surrogate" in errors[-1]["error"]["message"]
    assert errors[0]["error"]["code"] == "invalid_json" and "line 4" in errors[0]["error"]["message"]
    assert by_id["wrong-url"]["error"]["code"] == "invalid_request" and "url" in by_id["wrong-url"]["error"]["message"]
    assert by_id["unknown-model"]["response"]["status_code"] == 404
    assert by_id["unknown-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert by_id["best-of"]["response"]["status_code"] == 400
    assert "best_of: not supported" in by_id["best-of"]["response"]["body"]["error"]["message"]
    assert "used by an earlier line" in by_id["ok-0"]["error"]["message"]

    with pytest.raises(openai.ConflictError):
        oai.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        oai.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError, match="input_file_id"):
        oai.batches.create(input_file_id="file-missing", endpoint="/v1/completions", completion_window="24h")


def test_cancel_stops_running_lines_and_queued_ones_never_run(service, oai, api, model):
    lines = [completion_line(f"long-{i}", model.name, f"Long document {i}", max_tokens=400) for i in range(20)]
    file_id = oai.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch").id
    batch = oai.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    ids = [f"{batch.id}-{i}" for i in range(20)]
    running = wait_until(lambda: [j for j in fetch_jobs(service.redis, ids) if j.get_status(refresh=False) == "started"]
                         if sum(j.get_status(refresh=False) == "started" for j in fetch_jobs(service.redis, ids)) >= 6
                         else None, 30, "six lines running")
    assert len(running) == 6  # the batch's share of the worker: 8 slots, 2 kept for interactive requests

    cancelling = oai.batches.cancel(batch.id)
    # "cancelled" already when the supervisor held the batch and saw the flag first: it
    # cancels every line itself, and the lines end at once.
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    cancelled = wait_for_batch(oai, batch.id, 30)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    jobs = fetch_jobs(service.redis, ids)
    assert [job.get_status() for job in jobs] == ["canceled"] * 20
    started = [job for job in jobs if job.started_at is not None]
    assert {job.id for job in started} == {job.id for job in running}  # queued lines never ran
    assert Queue(BATCH_QUEUE, connection=service.redis).count == 0
    engine = wait_until(lambda: (w := httpx.get(f"{api.url}/ready").json()["workers"][0]["engine"])["num_running"] == 0
                        and w, 10, "the worker to abort the running lines")
    assert engine["num_free_blocks"] == engine["num_total_blocks"]
    errors = parse_lines(oai.files.content(cancelled.error_file_id).content)
    assert len(errors) == 20 and {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert cancelled.output_file_id is None and cancelled.request_counts.completed == 0


def test_an_input_file_deleted_while_it_is_read_cancels_its_batch_saying_why(service, oai, model):
    """A file in Redis deleted while a batch reads it reads as ending early: the batch ran
    short, "completed" with the lines read (6,030 of 20,000) and no word of the rest. It is
    cancelled now, its errors saying why, and the lines it had queued never all run. (In
    this process, the file deleted after its first megabyte is read.)"""
    from api.auth import ANYONE
    from api.batches.schemas import BatchCreate
    from api.batches.store import BatchStore
    from api.files import FileStore
    from api.jobs import JobStore
    from api.openai_compat import OpenAITranslator
    from api.prompts import PromptChecker

    class DeletedWhileRead(FileStore):
        reads = 0

        def chunks(self, file_id):
            self.reads += 1
            for number, chunk in enumerate(super().chunks(file_id)):
                yield chunk
                if self.reads == 2 and number == 0:  # the second reading (the first counts the lines)
                    self.delete(file_id)

    settings = service.settings
    files = DeletedWhileRead(service.redis, settings)
    lines = [completion_line(f"line-{i}", model.name, f"Document {i} " + "words " * 60) for i in range(3_000)]
    stored = files.create(iter([jsonl(lines)]), "big.jsonl", "batch", ANYONE.tenant, None, settings.max_file_bytes)
    batches = BatchStore(service.redis, settings, JobStore(service.redis, settings), files,
                         OpenAITranslator(settings, PromptChecker(settings)))
    record = batches.create(BatchCreate(input_file_id=stored.id, endpoint="/v1/completions", completion_window="24h"),
                            None, ANYONE)
    assert record.status in ("cancelling", "cancelled")
    (error,) = record.errors["data"]
    assert error["code"] == "file_not_found" and "deleted while the batch read it" in error["message"]
    assert 0 < record.lines_read < len(lines)
    ended = wait_for_batch(oai, record.id, 60)
    assert ended.status == "cancelled" and ended.errors.data[0].code == "file_not_found"


def test_interactive_requests_are_not_stuck_behind_a_large_batch(service, oai, api, model):
    lines = [completion_line(f"bulk-{i}", model.name, f"Bulk document {i}", max_tokens=48) for i in range(48)]
    file_id = oai.files.create(file=("bulk.jsonl", jsonl(lines)), purpose="batch").id
    with pagedq.Client(api.url, api_key=None) as client:
        suspend_workers(service.redis, api.url)
        try:
            batch = oai.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
            # Queued after all 48 lines: in one FIFO queue it would be the 49th to start.
            first = client.submit("an interactive request", max_tokens=8)["seq_id"]
        finally:
            resume(service.redis)
        assert client.wait(first)["status"] == "finished"
        line_jobs = fetch_jobs(service.redis, [f"{batch.id}-{i}" for i in range(48)])
        wait_until(lambda: sum(j.get_status() == "finished" for j in line_jobs) >= 6, 60, "a few lines to finish")
        (first_job,) = fetch_jobs(service.redis, [first])
        assert first_job.started_at <= min(j.started_at for j in fetch_jobs(service.redis, [j.id for j in line_jobs])
                                           if j.started_at is not None)

        # While the batch fills its share of the worker, a new request starts at once.
        second = client.submit("another interactive request", max_tokens=8)["seq_id"]
        done = client.wait(second)
        assert done["status"] == "finished" and done["timings"]["started"] - done["timings"]["enqueued"] < 2.0
        progress = oai.batches.retrieve(batch.id).request_counts
        assert progress.completed < 48, "the batch finished first: nothing was shown"
    assert wait_for_batch(oai, batch.id).request_counts.completed == 48


def test_files_limits_idempotency_and_a_files_directory(service, model, tmp_path):
    files_dir = tmp_path / "files"
    api = ApiServer(service.settings.with_overrides(port=free_port(), files_dir=files_dir, max_file_bytes=1000)).start()
    try:
        with httpx.Client(base_url=f"{api.url}/v1", timeout=30) as http:
            content = jsonl([completion_line("a", model.name, "hi")])
            first = http.post("/files", files={"file": ("a.jsonl", content)}, data={"purpose": "batch"},
                              headers={"Idempotency-Key": "k1"}).json()
            assert (files_dir / first["id"]).read_bytes() == content  # in the directory, not in Redis
            assert http.get(f"/files/{first['id']}/content").content == content
            again = http.post("/files", files={"file": ("a.jsonl", content)}, data={"purpose": "batch"},
                              headers={"Idempotency-Key": "k1"})
            assert again.json() == first
            conflict = http.post("/files", files={"file": ("a.jsonl", content + b"\n")}, data={"purpose": "batch"},
                                 headers={"Idempotency-Key": "k1"})
            assert conflict.status_code == 422 and conflict.json()["error"]["code"] == "idempotency_conflict"
            # A batch's key as a file's and a job's: the same batch again, another body a 422 (not a 409).
            batch = {"input_file_id": first["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
            created = http.post("/batches", json=batch, headers={"Idempotency-Key": "b1"}).json()
            assert http.post("/batches", json=batch, headers={"Idempotency-Key": "b1"}).json()["id"] == created["id"]
            other = http.post("/batches", json={**batch, "metadata": {"x": "y"}}, headers={"Idempotency-Key": "b1"})
            assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_conflict"
            for path, kwargs in (("/batches", {"json": batch}),
                                 ("/files", {"files": {"file": ("a.jsonl", content)}, "data": {"purpose": "batch"}})):
                bad_key = http.post(path, headers={"Idempotency-Key": "two words"}, **kwargs)
                assert bad_key.status_code == 400 and bad_key.json()["error"]["param"] == "Idempotency-Key"
            too_big = http.post("/files", files={"file": ("big.jsonl", b"x" * 1001)}, data={"purpose": "batch"})
            assert too_big.status_code == 413 and "PAGEDQ_MAX_FILE_BYTES" in too_big.json()["error"]["message"]
            assert sorted(p.name for p in files_dir.iterdir()) == [first["id"]]  # nothing left behind
            wrong = http.post("/files", files={"file": ("a.jsonl", content)}, data={"purpose": "fine-tune"})
            assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "purpose"
            listed = http.get("/files").json()
            assert listed["object"] == "list" and first["id"] in [f["id"] for f in listed["data"]]
            assert http.delete(f"/files/{first['id']}").json()["deleted"] is True
            assert first["id"] not in [f["id"] for f in http.get("/files").json()["data"]]
            assert http.get(f"/files/{first['id']}").status_code == 404
            assert not (files_dir / first["id"]).exists()
    finally:
        api.stop()


def test_cli_documents_through_the_chat_template_and_resubmitting_runs_nothing_new(service, api, model, tmp_path,
                                                                                  monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("docs").mkdir()
    texts = {f"docs/note-{i}.txt": f"Note {i}: the meeting moved to room {i + 3}.\n" for i in range(5)}
    for path, text in texts.items():
        Path(path).write_text(text)
    argv = ["batch", "submit", *texts, "--template", "Summarize:\\n{text}", "--chat", "--max-tokens", "3",
            "--url", api.url]
    assert main(argv) == 0
    batch_id = capsys.readouterr().out.strip()
    assert main(["batch", "status", batch_id, "--url", api.url]) == 0
    assert "completed: 5 completed, 0 failed of 5" in capsys.readouterr().out
    finished = FinishedJobRegistry(BATCH_QUEUE, connection=service.redis).count

    assert main(argv) == 0  # again: the same batch, already done
    again = capsys.readouterr()
    assert again.out.strip() == batch_id and "completed, 5 requests (5 completed, 0 failed)" in again.err
    assert main(["batch", "results", batch_id, "-o", "out.jsonl", "--errors", "errors.jsonl", "--url", api.url]) == 0
    assert "5 results to out.jsonl" in capsys.readouterr().err
    assert FinishedJobRegistry(BATCH_QUEUE, connection=service.redis).count == finished  # nothing ran again

    output = parse_lines(Path("out.jsonl").read_bytes())
    assert sorted(line["custom_id"] for line in output) == sorted(texts) and Path("errors.jsonl").read_bytes() == b""
    tokenizer = AutoTokenizer.from_pretrained(model)
    for line in output:
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] <= 3
        (job,) = fetch_jobs(service.redis, [line["response"]["request_id"]])
        messages = [{"role": "user", "content": "Summarize:\n" + texts[line["custom_id"]].rstrip("\n")}]
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert job.kwargs["prompt_token_ids"] == list(expected)
        assert body["choices"][0]["message"]["content"] == job.return_value()["text"]


def test_cli_bad_input_fails_with_a_message(service, api, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("bad.txt").write_bytes(b"\xff\xfe not text")
    Path("doc.txt").write_text("fine")
    Path("requests.jsonl").write_text("{}\n")
    unreachable = f"http://127.0.0.1:{free_port()}"
    cases = [
        (["batch", "status", "batch_x", "--url", unreachable], f"cannot reach the pagedq api at {unreachable}"),
        (["batch", "results", "batch_x", "--url", unreachable], "cannot reach the pagedq api"),
        (["batch", "submit", "doc.txt", "--template", "{text}", "--url", unreachable], "cannot reach the pagedq api"),
        (["batch", "submit", "doc.txt", "--template", "no placeholder", "--url", api.url], "must contain {text}"),
        (["batch", "submit", "bad.txt", "--template", "{text}", "--url", api.url], "bad.txt: not UTF-8 text"),
        (["batch", "submit", "missing.txt", "--template", "{text}", "--url", api.url], "No such file"),
        (["batch", "submit", "doc.txt", "--url", api.url], "exactly one .jsonl"),
        (["batch", "submit", "doc.txt", "--summarize", "--top-p", "0.5", "--url", api.url], "not top_p"),
        (["batch", "submit", "doc.txt", "--map-template", "{text}", "--url", api.url], "go with --summarize"),
        (["batch", "submit", "doc.txt", "--summarize", "--map-template", "x", "--url", api.url], "exactly once"),
        (["batch", "submit", "requests.jsonl", "--max-tokens", "3", "--url", api.url], "carry their own bodies"),
        (["batch", "submit", "requests.jsonl", "--url", api.url], "cannot tell the batch's endpoint"),
        (["batch", "status", "batch_nope", "--url", api.url], "no batch 'batch_nope'"),
        (["batch", "submit", "doc.txt", "doc.txt", "--template", "{text}", "--url", api.url], "more than once"),
    ]
    for argv, message in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


def test_ids_a_dead_worker_took_but_never_started_go_back_to_the_queue(service, api):
    """A worker that dies between taking ids from a queue (RQ's LMOVE to the intermediate
    list) and starting them strands them there; RQ's own maintenance frees them only after
    minutes. Workers put them back after a heartbeat TTL."""
    queue = Queue(QUEUE, connection=service.redis)
    with Client(api.url) as client:
        suspend_workers(service.redis, api.url)
        try:
            seq_id = client.submit("stranded", max_tokens=3)["seq_id"]
            # What a worker's per-step sync does, done by one that then died.
            assert service.redis.lmove(queue.key, queue.intermediate_queue_key, "LEFT", "RIGHT").decode() == seq_id
            stranded_at = time.monotonic()
        finally:
            resume(service.redis)
        ttl = service.settings.heartbeat_ttl_s
        wait_until(lambda: client.result(seq_id)["status"] == "finished", ttl + 10, "the stranded job to run",
                   interval_s=0.2)
    waited = time.monotonic() - stranded_at
    assert ttl - 1 <= waited and service.redis.llen(queue.intermediate_queue_key) == 0


def test_200_documents_with_the_cli_survive_a_worker_kill_and_an_api_restart(service, model, tmp_path, monkeypatch,
                                                                            capsys):
    """The issue's must-show: 200 documents summarized through `pagedq batch`, one malformed
    line in the error file, the worker SIGKILLed half-way and the api restarted; nothing lost,
    nothing run twice to the end."""
    monkeypatch.chdir(tmp_path)
    Path("docs").mkdir()
    paths = [f"docs/doc-{i:03d}.txt" for i in range(200)]
    for i, path in enumerate(paths):
        Path(path).write_text(f"Report {i}. " + " ".join(f"item{(i * 7 + j) % 50}" for j in range(5 + i % 20)) + "\n")
    api = service.start_api()
    assert main(["batch", "submit", *paths, "--template", "Summarize:\\n{text}", "--max-tokens", "6", "--dry-run",
                 "--url", api.url]) == 0
    requests = capsys.readouterr().out
    assert len(requests.splitlines()) == 200
    Path("batch.jsonl").write_text(requests + '{"custom_id": "broken", "method": "POST", "url": "/v1/comp\n')
    assert main(["batch", "submit", "batch.jsonl", "--url", api.url]) == 1  # one line refused; the others run
    submitted = capsys.readouterr()
    batch_id = submitted.out.strip()
    assert "1 of 201 requests were refused (the others run)" in submitted.err
    assert "pagedq: failed: (no custom_id): line 201: not JSON" in submitted.err

    line_ids = [f"{batch_id}-{i}" for i in range(200)]

    def running() -> list[str]:
        return [job.id for job in fetch_jobs(service.redis, line_ids) if job.get_status(refresh=False) == "started"]

    with Client(api.url) as client:
        at_kill = wait_until(lambda: (b := client.batch_get(batch_id))["request_counts"]["completed"] >= 40
                             and running() and b, 120, "40 documents done and more running")
    (victim,) = [worker for worker in service.workers if worker.process.poll() is None]
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait()
    killed_at = time.monotonic()
    # What the dead worker held: started, or taken from the queue and not yet started.
    started = running()
    victims = {job.worker_name for job in fetch_jobs(service.redis, started)}
    taken = [i.decode() for i in service.redis.lrange(Queue(BATCH_QUEUE, connection=service.redis).intermediate_queue_key, 0, -1)]
    assert started or taken
    api.stop()  # and a new api process takes over
    service.start_worker()
    api = service.start_api()
    assert at_kill["request_counts"]["completed"] < 200, "the batch ended before the kill"

    assert main(["batch", "status", batch_id, "--url", api.url]) == 1  # a request failed: said, with its reason
    status = capsys.readouterr()
    assert f"{batch_id}: completed: 200 completed, 1 failed of 201" in status.out
    assert "pagedq: failed: (no custom_id): line 201: not JSON" in status.err
    elapsed = time.monotonic() - killed_at
    assert main(["batch", "results", batch_id, "-o", "out.jsonl", "--errors", "errors.jsonl", "--url", api.url]) == 1
    results = capsys.readouterr().err
    assert "200 results to out.jsonl; 1 requests failed (see errors.jsonl)" in results and "line 201: not JSON" in results

    output = parse_lines(Path("out.jsonl").read_bytes())
    assert len(output) == 200 and sorted(line["custom_id"] for line in output) == paths
    for line in output:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and 1 <= body["usage"]["completion_tokens"] <= 6
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
    (error,) = parse_lines(Path("errors.jsonl").read_bytes())
    assert error["custom_id"] is None and error["error"]["code"] == "invalid_json"
    assert error["error"]["message"].startswith("line 201: not JSON")

    # Every line finished exactly once; the killed worker's lines ran again from the start.
    jobs = fetch_jobs(service.redis, [line["response"]["request_id"] for line in output])
    assert [len(job.results()) for job in jobs] == [1] * 200
    # (By who recorded the result: a kill between marking a job started and its first
    # progress write leaves no attempt to count.)
    finished_by = {job.id: job.results()[0].worker_name for job in jobs}
    assert all(finished_by[job_id] not in victims for job_id in started)

    assert main(["batch", "submit", "batch.jsonl", "--url", api.url]) == 1  # resumable: the same batch, ended
    again = capsys.readouterr()
    assert again.out.strip() == batch_id and "line 201: not JSON" in again.err
    with capsys.disabled():
        print(f"\n200-document batch {batch_id}: {at_kill['request_counts']['completed']} done when the worker was "
              f"SIGKILLed holding {len(started)} started and {len(taken)} taken lines, all run by the next worker; all 200 done "
              f"{elapsed:.1f}s after the kill; error line: {error}")
