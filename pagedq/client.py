"""`pagedq.Client`: a small synchronous client of the pagedq HTTP api (the CLI is built on it).

    client = Client("http://127.0.0.1:8000", api_key=None)
    seq_id = client.submit("Hello", max_tokens=32, temperature=0)["seq_id"]
    for delta in client.stream(seq_id):
        print(delta, end="")
    client.result(seq_id, wait=30)["text"]
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx


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
        idempotency_key: str | None = None,
        **sampling: Any,
    ) -> dict:
        """POST /generate; `sampling` takes SamplingParams' fields and `priority`. Returns {seq_id, status, result_url}."""
        body = {key: value for key, value in {"prompt": prompt, "prompt_token_ids": prompt_token_ids}.items() if value is not None}
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
        """Yield text deltas as the job produces them. A job retried after its worker died
        starts over (a `reset` event): callers printing live may see its text repeated;
        use `events()` to handle resets."""
        for event, data in self.events(seq_id):
            if event == "delta":
                yield data["text"]

    def events(self, seq_id: str, reconnects: int = 3) -> Iterator[tuple[str, dict]]:
        """The job's SSE events (`delta` {text, num_tokens}, `reset` {attempt}, `end` {status, finish_reason}),
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
                    for event, data, event_id in _parse_sse(response.iter_lines()):
                        last_event_id = event_id or last_event_id
                        failures = 0
                        yield event, data
                        if event == "end":
                            return
                reason = "the stream ended early"
            except httpx.TransportError as exc:
                reason = str(exc) or type(exc).__name__
            failures += 1
            if failures > reconnects:
                raise ServiceUnreachable(self.base_url, reason)
            time.sleep(min(2.0, 0.25 * 2**failures))

    def _request(self, method: str, path: str, **kwargs: Any) -> dict:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ServiceUnreachable(self.base_url, str(exc) or type(exc).__name__) from exc
        if response.status_code >= 400:
            raise self._error(response)
        return response.json()

    @staticmethod
    def _error(response: httpx.Response) -> ClientError:
        try:
            message = response.json().get("message") or response.text
        except ValueError:
            message = response.text
        return ClientError(response.status_code, message)


class SSEParser:
    """Server-Sent Events, fed one line at a time (sync or async readers alike)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.event, self.data, self.event_id = "message", [], None

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
