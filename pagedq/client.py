"""`pagedq.Client`: a small synchronous client of the pagedq HTTP api (the CLI is built on it).

    client = Client("http://127.0.0.1:8000", api_key=None)
    seq_id = client.submit("Hello", max_tokens=32, temperature=0)["seq_id"]
    for delta in client.stream(seq_id):
        print(delta, end="")
    client.result(seq_id, wait=30)["text"]

    batch = client.batch_submit(jsonl_bytes, "/v1/completions")   # OpenAI's batch input format
    batch = client.batch_wait(batch["id"])
    output, errors = client.batch_results(batch["id"])             # OpenAI's output lines (bytes)

`batch_submit` is resumable: the same input and endpoint give the same batch, whether it
is still running, done, or was cut off half-way through being created.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from pagedq.protocol import SSE_ERROR_EVENT

BATCH_TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


class ClientError(Exception):
    """The api answered with an error (`status`, `message` from its JSON body)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class ServiceUnreachable(ClientError):
    def __init__(self, base_url: str, reason: str):
        super().__init__(0, f"cannot reach the pagedq api at {base_url} ({reason}); is `pagedq up` running?")


class Client:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict] | None = None,
        idempotency_key: str | None = None,
        **sampling: Any,
    ) -> dict:
        """POST /generate (one of prompt, prompt_token_ids, messages: [{role, content}] for the
        model's chat template); `sampling` takes SamplingParams' fields and `priority`.
        Returns {seq_id, status, result_url}."""
        given = {"prompt": prompt, "prompt_token_ids": prompt_token_ids, "messages": messages}
        body = {key: value for key, value in given.items() if value is not None}
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._request("POST", "/generate", json={**body, **sampling}, headers=headers)

    def result(self, seq_id: str, wait: float | None = None) -> dict:
        """GET /result; with `wait`, the api holds the request until the job ends (bounded server-side)."""
        params = {"wait": wait} if wait else {}
        timeout = httpx.Timeout(self._http.timeout.read + (wait or 0), connect=self._http.timeout.connect)
        return self._request("GET", f"/result/{seq_id}", params=params, timeout=timeout)

    def wait(self, seq_id: str, poll_s: float = 30.0) -> dict:
        """Long-poll until the job is finished, failed or canceled."""
        while True:
            result = self.result(seq_id, wait=poll_s)
            if result["status"] in ("finished", "failed", "canceled"):
                return result

    def cancel(self, seq_id: str) -> dict:
        return self._request("DELETE", f"/result/{seq_id}")

    def stream(self, seq_id: str) -> Iterator[str]:
        """Yield text deltas of the job's first output as it produces them (with n > 1,
        `events()` carries every output's, by index). A job retried after its worker died
        starts over (a `reset` event): callers printing live may see its text repeated;
        use `events()` to handle resets."""
        for event, data in self.events(seq_id):
            if event == "delta" and data.get("index", 0) == 0:
                yield data["text"]

    def events(self, seq_id: str, reconnects: int = 3) -> Iterator[tuple[str, dict]]:
        """The job's SSE events (`delta` {index, text, num_tokens}, `reset` {attempt}, `end` {status, finish_reason}),
        reconnecting with Last-Event-ID when the connection drops."""
        last_event_id: str | None = None
        failures = 0
        while True:
            headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
            try:
                with self._http.stream("GET", f"/stream/{seq_id}", headers=headers, timeout=None) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise self._error(response)
                    reason = "the stream ended early"
                    for event, data, event_id in _parse_sse(response.iter_lines()):
                        if event == SSE_ERROR_EVENT:  # the service cannot go on now: reconnect
                            reason = data.get("message", reason)
                            break
                        last_event_id = event_id or last_event_id
                        failures = 0
                        yield event, data
                        if event == "end":
                            return
            except httpx.TransportError as exc:
                reason = str(exc) or type(exc).__name__
            failures += 1
            if failures > reconnects:
                raise ServiceUnreachable(self.base_url, reason)
            time.sleep(min(2.0, 0.25 * 2**failures))

    # ---- OpenAI-compatible models and the Batch API -------------------------------------

    def models(self) -> list[dict]:
        return self._request("GET", "/v1/models")["data"]

    def upload_file(self, content: bytes, filename: str = "batch.jsonl", idempotency_key: str | None = None) -> dict:
        """POST /v1/files (purpose "batch"); the same Idempotency-Key and content give the same file."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._request("POST", "/v1/files", files={"file": (filename, content)}, data={"purpose": "batch"},
                             headers=headers)

    def file_content(self, file_id: str) -> bytes:
        return self._request("GET", f"/v1/files/{file_id}/content", raw=True)

    def batch_create(
        self, input_file_id: str, endpoint: str, completion_window: str = "24h", metadata: dict | None = None,
        idempotency_key: str | None = None, summary: dict | None = None,
    ) -> dict:
        """`summary`: with endpoint /v1/summaries, how to summarize (pagedq.summaries.SummarizeOptions' fields)."""
        body = {"input_file_id": input_file_id, "endpoint": endpoint, "completion_window": completion_window}
        if metadata:
            body["metadata"] = metadata
        if summary is not None:
            body["summary"] = summary
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        # Creating a batch queues its lines before answering: allow for a large file.
        return self._request("POST", "/v1/batches", json=body, headers=headers, timeout=max(self._http.timeout.read, 300))

    def batch_submit(self, jsonl: bytes, endpoint: str, filename: str = "batch.jsonl", summary: dict | None = None) -> dict:
        """Upload `jsonl` and create its batch, idempotently: keys derived from the content,
        endpoint and summary options, so running this again finds the same file and batch."""
        digest = hashlib.sha256(jsonl).hexdigest()
        uploaded = self.upload_file(jsonl, filename, idempotency_key=f"batch-input-{digest}")
        options = hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:16] if summary else ""
        return self.batch_create(uploaded["id"], endpoint, idempotency_key=f"batch-{digest}-{endpoint}{options}",
                                 summary=summary)

    def batch_get(self, batch_id: str) -> dict:
        return self._request("GET", f"/v1/batches/{batch_id}")

    def batch_list(self, limit: int = 20, after: str | None = None) -> dict:
        params = {"limit": limit, **({"after": after} if after else {})}
        return self._request("GET", "/v1/batches", params=params)

    def batch_refused(self, batch_id: str) -> list[dict]:
        """The input lines the batch refused so far (error-file lines), before it ends."""
        return self._request("GET", f"/v1/batches/{batch_id}/refused")["data"]

    def batch_cancel(self, batch_id: str) -> dict:
        return self._request("POST", f"/v1/batches/{batch_id}/cancel")

    def batch_wait(self, batch_id: str, poll_s: float = 1.0, on_update: Callable[[dict], None] | None = None) -> dict:
        """Poll until the batch has ended (completed, failed, expired or cancelled)."""
        while True:
            batch = self.batch_get(batch_id)
            if on_update is not None:
                on_update(batch)
            if batch["status"] in BATCH_TERMINAL:
                return batch
            time.sleep(poll_s)

    def batch_results(self, batch_id: str) -> tuple[bytes, bytes]:
        """The output and error files' contents (OpenAI's JSONL) of an ended batch."""
        batch = self.batch_get(batch_id)
        if batch["status"] not in BATCH_TERMINAL:
            counts = batch["request_counts"]
            raise ClientError(409, f"batch {batch_id} is {batch['status']} "
                              f"({counts['completed'] + counts['failed']}/{counts['total']} done)")
        output = self.file_content(batch["output_file_id"]) if batch.get("output_file_id") else b""
        errors = self.file_content(batch["error_file_id"]) if batch.get("error_file_id") else b""
        return output, errors

    def _request(self, method: str, path: str, raw: bool = False, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ServiceUnreachable(self.base_url, str(exc) or type(exc).__name__) from exc
        if response.status_code >= 400:
            raise self._error(response)
        return response.content if raw else response.json()

    @staticmethod
    def _error(response: httpx.Response) -> ClientError:
        try:
            error = response.json()
            # /v1 answers OpenAI's {"error": {"message": ...}}, the rest {"error": kind, "message": ...}.
            message = error["error"]["message"] if isinstance(error.get("error"), dict) else error.get("message")
        except (ValueError, KeyError, TypeError, AttributeError):
            message = None
        return ClientError(response.status_code, message or response.text)


class SSEParser:
    """Server-Sent Events, fed one line at a time (sync or async readers alike)."""

    def __init__(self) -> None:
        self._partial = ""
        self._reset()

    def _reset(self) -> None:
        self.event, self.data, self.event_id = "message", [], None

    def feed_text(self, text: str) -> list[tuple[str, dict, str | None]]:
        """The frames that this piece of the stream completes, however it was cut (the
        part of a line after the last newline waits for the next piece). Cheaper than a
        line iterator per line: a streaming client's CPU goes into its reader, per token."""
        *lines, self._partial = (self._partial + text).split("\n")
        return [frame for line in lines if (frame := self.feed(line.rstrip("\r"))) is not None]

    def feed(self, line: str) -> tuple[str, dict, str | None] | None:
        """The (event, data, id) that this line completes, else None."""
        if not line:
            frame = (self.event, json.loads("\n".join(self.data)), self.event_id) if self.data else None
            self._reset()
            return frame
        if line.startswith("event:"):
            self.event = line[6:].strip()
        elif line.startswith("data:"):
            self.data.append(line[5:].strip())
        elif line.startswith("id:"):
            self.event_id = line[3:].strip()
        return None


def _parse_sse(lines: Iterator[str]) -> Iterator[tuple[str, dict, str | None]]:
    parser = SSEParser()
    for line in lines:
        if (frame := parser.feed(line)) is not None:
            yield frame
