"""Summary batches end to end (`pagedq batch submit --summarize`): a real redis-server, the
api under uvicorn and `pagedq worker` processes, the tiny model at a 160-token context so
that a few pages need several stages. The stages' jobs are counted in Redis: each chunk and
each reduce is summarized once, also when the worker is SIGKILLed and the api restarted
mid-run. Exit codes and messages tell the truth about failed documents."""

from __future__ import annotations

import importlib.util
import json
import signal
import time
from pathlib import Path

import httpx
import pytest
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from api.prompts import PromptChecker
from api.summaries.summarizer import Summarizer
from pagedq.cli import main
from pagedq.client import Client
from pagedq.redis_server import RedisServer
from pagedq.summaries import SUMMARIES_ENDPOINT, SummarizeOptions
from tests.service_helpers import ApiServer, WorkerProcess, service_settings, wait_for_worker, wait_until
from tests.test_summary_chunking import document

pytestmark = pytest.mark.slow
CONTEXT = 160
OPTIONS = {"max_tokens": 8, "temperature": 0}


class Service:
    def __init__(self, model: Path, tmp: Path):
        self.tmp = tmp
        self.redis_server = RedisServer(tmp / "redis").start()
        self.redis = Redis.from_url(self.redis_server.url)
        self.settings = service_settings(model, self.redis_server.url, tmp, queue_name="sq", max_inflight=8,
                                         max_model_len=CONTEXT, batch_poll_interval_s=0.2, max_document_chars=50_000)
        self.worker = WorkerProcess(self.settings, tmp / "worker-0.log")
        self.api = ApiServer(self.settings).start()

    def restart(self) -> None:
        """SIGKILL the worker, stop the api; a new api and worker take over."""
        self.worker.process.send_signal(signal.SIGKILL)
        self.worker.process.wait()
        self.api.stop()
        self.worker = WorkerProcess(self.settings, self.tmp / f"worker-{time.monotonic_ns()}.log")
        self.api = ApiServer(self.settings).start()

    def stop(self) -> None:
        self.api.stop()
        self.worker.stop()
        self.redis_server.stop()

    def jobs(self, batch_id: str, index: int) -> list[Job]:
        """Every job made for one document, whatever its stage."""
        keys = sorted(k.decode() for k in self.redis.scan_iter(match=f"rq:job:{batch_id}-{index}-*", count=1000)
                      if k.decode().count(":") == 2)
        return Job.fetch_many([k.removeprefix("rq:job:") for k in keys], self.redis, serializer=JSONSerializer)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir()


@pytest.fixture(scope="module")
def service(model, tmp_path_factory):
    service = Service(model, tmp_path_factory.mktemp("summaries"))
    try:
        wait_for_worker(service.api.url)
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def summarizer(service):
    return Summarizer(PromptChecker(service.settings), SummarizeOptions(**OPTIONS), service.settings.batch_priority)


def test_a_document_past_the_limit_fails_its_line_and_the_others_run(service, tmp_path, monkeypatch, capsys):
    """The api tokenizes a document whole to plan its chunks (a 30 MB one took its memory,
    at every restart): past PAGEDQ_MAX_DOCUMENT_CHARS a document fails its own line, named."""
    monkeypatch.chdir(tmp_path)
    limit = service.settings.max_document_chars
    Path("huge.txt").write_text("word " * (limit // 5 + 1))
    Path("small.txt").write_text("The meeting moved to Tuesday.\n")
    argv = ["batch", "submit", "--summarize", "huge.txt", "small.txt", "--max-tokens", "8", "--temperature", "0",
            "--wait", "-o", "out.jsonl", "--url", service.api.url]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"huge.txt: line 1: text: {limit + 5} characters, more than a document may have ({limit}, " \
           "PAGEDQ_MAX_DOCUMENT_CHARS)" in err
    assert [record["id"] for record in map(json.loads, Path("out.jsonl").read_text().splitlines())] == ["small.txt"]


def test_cli_summarizes_documents_of_any_length_in_stages(service, summarizer, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("docs").mkdir()
    long_text = document(45, seed=1)
    Path("docs/long.md").write_text(long_text)
    Path("docs/short.txt").write_text("The meeting moved to Tuesday.\n")
    Path("docs/empty.txt").write_text("  \n")
    Path("docs/notes.jsonl").write_text(json.dumps({"id": "note-1", "text": document(3, seed=2)}) + "\n")
    without_pypdf = importlib.util.find_spec("pypdf") is None
    if without_pypdf:
        Path("docs/scan.pdf").write_bytes(b"%PDF-1.4\n")  # read only with the pdf extra (pypdf), else skipped
    url = service.api.url
    argv = ["batch", "submit", "--summarize", "docs", "--max-tokens", "8", "--temperature", "0", "--url", url]
    assert main([*argv, "--wait", "-o", "out.jsonl", "--markdown", "md"]) == 1  # one document failed: said
    submitted = capsys.readouterr()
    batch_id = submitted.out.strip()
    assert "pagedq: failed: docs/empty.txt: line 1: text: the document is empty" in submitted.err
    assert "3 results to out.jsonl; 1 requests failed" in submitted.err
    if without_pypdf:
        assert "skipped 1 PDF file(s) (docs/scan.pdf): PDF needs the pypdf package" in submitted.err

    records = {record["id"]: record for record in map(json.loads, Path("out.jsonl").read_text().splitlines())}
    assert sorted(records) == ["docs/long.md", "docs/short.txt", "note-1"]
    assert sorted(p.name for p in Path("md").iterdir()) == ["docs_long.md.md", "docs_short.txt.md", "note-1.md"]
    assert Path("md/docs_long.md.md").read_text().startswith("# docs/long.md\n\n")
    short = records["docs/short.txt"]
    assert [(s["kind"], s["requests"]) for s in short["stages"]] == [("map", 1)]

    # The long document: its chunks mapped, then reduced until one summary is left.
    stages = records["docs/long.md"]["stages"]
    chunks = summarizer.map_prompts(long_text)
    assert len(stages) >= 3 and [s["kind"] for s in stages] == ["map"] + ["reduce"] * (len(stages) - 1)
    assert stages[0]["requests"] == len(chunks) and stages[-1]["requests"] == 1
    assert all(a["requests"] > b["requests"] for a, b in zip(stages, stages[1:]))
    jobs = service.jobs(batch_id, 1)  # docs/ is read in name order: empty.txt, long.md, notes.jsonl, short.txt
    assert len(jobs) == sum(s["requests"] for s in stages)  # each chunk and each reduce: one job, run once
    assert all(len(job.results()) == 1 for job in jobs)
    assert max(len(job.kwargs["prompt_token_ids"]) for job in jobs) <= CONTEXT - OPTIONS["max_tokens"]
    mapped = sorted((job for job in jobs if job.id.split("-")[-2] == "0"), key=lambda job: int(job.id.split("-")[-1]))
    assert [job.kwargs["prompt_token_ids"] for job in mapped] == chunks
    assert stages[0]["prompt_tokens"] == sum(len(prompt) for prompt in chunks)
    usage = records["docs/long.md"]["usage"]
    assert usage["prompt_tokens"] == sum(s["prompt_tokens"] for s in stages) and usage["total_tokens"] > 0

    # status and results tell the same truth; a batch with no result writes no file.
    assert main(["batch", "status", batch_id, "--url", url]) == 1
    status = capsys.readouterr()
    assert f"{batch_id}: completed: 3 completed, 1 failed of 4" in status.out and "the document is empty" in status.err
    assert main(["batch", "results", batch_id, "-o", "again.jsonl", "--url", url]) == 1
    assert Path("again.jsonl").read_text() == Path("out.jsonl").read_text()
    capsys.readouterr()
    assert main(["batch", "submit", "--summarize", "docs/empty.txt", "--wait", "-o", "none.jsonl", "--url", url]) == 1
    assert "with no results: 1 of 1 requests failed" in capsys.readouterr().err and not Path("none.jsonl").exists()
    # Without --wait, a refused document is known at once: said, with its reason.
    assert main(["batch", "submit", "--summarize", "docs/empty.txt", "docs/short.txt", "--url", url]) == 1
    err = capsys.readouterr().err
    assert "pagedq: failed: docs/empty.txt: line 1: text: the document is empty" in err
    assert "1 of 2 requests were refused (the others run)" in err
    # A document too long for one prompt, sent as one: the failure says what to do.
    assert main(["batch", "submit", "docs/long.md", "--template", "Summarize:\\n{text}", "--wait", "--url", url]) == 1
    err = capsys.readouterr().err
    assert "pagedq: failed: docs/long.md: prompt: " in err and "`pagedq batch submit --summarize` splits it" in err


def test_options_the_model_cannot_run_are_a_400_naming_the_field(service):
    with Client(service.api.url) as client:
        file_id = client.upload_file(b'{"custom_id": "a", "method": "POST", "url": "/v1/summaries", "body": {"text": "x"}}\n')["id"]
    cases = [
        ({"endpoint": SUMMARIES_ENDPOINT, "summary": {"max_tokens": 100}}, "summary.max_tokens"),
        ({"endpoint": SUMMARIES_ENDPOINT, "summary": {"map_template": "no text"}}, "summary.map_template"),
        ({"endpoint": "/v1/completions", "summary": {}}, "summary: only for endpoint /v1/summaries"),
        # As every request's: int64 counts, valid text (a lone surrogate reached the tokenizer).
        ({"endpoint": SUMMARIES_ENDPOINT, "summary": {"overlap_tokens": 2**63}}, "summary.overlap_tokens"),
        ({"endpoint": SUMMARIES_ENDPOINT, "summary": {"map_template": "{text} \ud800"}}, "lone UTF-16 surrogate"),
    ]
    for body, message in cases:
        # json.dumps escapes a lone surrogate (httpx's own encoder refuses to send it).
        response = httpx.post(f"{service.api.url}/v1/batches", timeout=30, headers={"Content-Type": "application/json"},
                              content=json.dumps({"input_file_id": file_id, "completion_window": "24h", **body}))
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_a_worker_killed_and_an_api_restarted_mid_map_redo_no_finished_chunk(service):
    texts = [document(40, seed=10 + i) for i in range(3)]
    lines = [{"custom_id": f"doc-{i}", "method": "POST", "url": SUMMARIES_ENDPOINT, "body": {"text": text}}
             for i, text in enumerate(texts)]
    with Client(service.api.url) as client:
        batch = client.batch_submit("".join(json.dumps(line) + "\n" for line in lines).encode(), SUMMARIES_ENDPOINT,
                                    summary=OPTIONS)
    batch_id = batch["id"]

    def finished_maps() -> list[Job]:
        return [job for i in range(3) for job in service.jobs(batch_id, i)
                if job.id.split("-")[-2] == "0" and job.get_status(refresh=False) == "finished"]

    done_before = wait_until(lambda: (jobs := finished_maps()) and len(jobs) >= 6 and jobs, 60, "six chunks summarized")
    ended_at = {job.id: job.ended_at for job in done_before}
    maps = [job for i in range(3) for job in service.jobs(batch_id, i) if job.id.split("-")[-2] == "0"]
    unfinished = [job.id for job in maps if job.get_status() != "finished"]
    service.restart()
    assert unfinished, "the map stage had ended before the kill"
    with Client(service.api.url) as client:
        batch = client.batch_wait(batch_id, poll_s=0.3)
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert [d["status"] for d in batch["documents"]] == ["completed"] * 3
    for i in range(3):
        jobs = service.jobs(batch_id, i)
        stages = batch["documents"][i]
        assert stages["requests"] == 1 and stages["kind"] == "reduce"
        assert all(len(job.results()) == 1 for job in jobs)  # no chunk or reduce summarized twice
    # The chunks summarized before the kill were not summarized again.
    again = {job.id: job.ended_at for job in Job.fetch_many(list(ended_at), service.redis, serializer=JSONSerializer)}
    assert again == ended_at


def test_cancel_stops_every_stage(service):
    lines = [{"custom_id": f"doc-{i}", "method": "POST", "url": SUMMARIES_ENDPOINT, "body": {"text": document(40, seed=30 + i)}}
             for i in range(2)]
    with Client(service.api.url) as client:
        batch_id = client.batch_submit("".join(json.dumps(line) + "\n" for line in lines).encode(), SUMMARIES_ENDPOINT,
                                       summary=OPTIONS)["id"]
        wait_until(lambda: any(job.get_status() == "finished" for job in service.jobs(batch_id, 0)), 60, "a chunk done")
        assert client.batch_cancel(batch_id)["status"] == "cancelling"
        batch = client.batch_wait(batch_id, poll_s=0.2)
        output, errors = client.batch_results(batch_id)
    assert batch["status"] == "cancelled" and [d["status"] for d in batch["documents"]] == ["cancelled"] * 2
    assert output == b"" and [json.loads(line)["error"]["code"] for line in errors.splitlines()] == ["batch_cancelled"] * 2
    jobs = service.jobs(batch_id, 0) + service.jobs(batch_id, 1)
    assert {job.get_status() for job in jobs} <= {"finished", "canceled"}
    assert all(job.id.split("-")[-2] == "0" for job in jobs)  # no reduce was queued


def test_a_document_whose_text_is_not_valid_unicode_is_refused_naming_its_text():
    """A lone surrogate in a summary line's text reached the tokenizer: the line failed as
    "could not be read", its custom_id lost. Refused as the other bodies' text is."""
    from pydantic import ValidationError

    from api.batches.documents import DocumentBody

    with pytest.raises(ValidationError, match="lone UTF-16 surrogate") as caught:
        DocumentBody.model_validate({"text": "\ud800abc"})
    assert caught.value.errors()[0]["loc"] == ("text",)
