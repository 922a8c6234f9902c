"""The soak's steady mixed load: a fixed number of client threads, each running one
scenario at a time (loopback HTTP to the apis, spread over them) until the load stops:

- generate-poll: POST /generate, then long-poll GET /result?wait=;
- generate-stream: POST /generate, then GET /stream (SSE) to its end, resuming with
  Last-Event-ID when the connection drops;
- submit-twice: the same Idempotency-Key and body twice (the same seq_id, or a violation);
- cancel: POST /generate, DELETE /result/{id} a moment later, then wait for the end;
- chat, chat-stream: POST /v1/chat/completions without and with `stream`;
- batch: a few /v1/completions lines through POST /v1/files and POST /v1/batches, polled
  to the end, the output file read back.

Requests are short and mostly greedy (temperature 0), some seeded, so the offline engine
can check every result. A client waits out what a fault causes (503 or 429 with
Retry-After, a lost connection) by retrying on the next api, with the same
Idempotency-Key so a retry can never make a second job; every answer's status goes to the
ledger. Every wait is bounded: a job not followed to its end is still checked afterwards.
"""

from __future__ import annotations

import itertools
import traceback
import json
import random
import threading
import time
from contextlib import closing
from dataclasses import dataclass

import httpx

from pagedq.chaos.ledger import RETRYABLE_STATUSES, Ledger, route_of
from pagedq.client import BATCH_TERMINAL, SSEParser
from pagedq.redis_schema import TERMINAL

SCENARIO_WEIGHTS = {
    "generate-poll": 3, "generate-stream": 3, "submit-twice": 1, "cancel": 1, "chat": 1, "chat-stream": 1, "batch": 1,
}
_TIMEOUT = httpx.Timeout(30.0, connect=3.0)
# A non-streamed completion holds its request open until the job ends.
_COMPLETION_TIMEOUT = httpx.Timeout(120.0, connect=3.0)
# How long one request keeps being retried through 5xx, 429 and lost connections; the
# longest recovery (a worker restarted on loaded cores) is well within it.
_REQUEST_PATIENCE_S = 60.0
# How long a client follows one job (or batch) to its end.
_FOLLOW_S = 120.0
_RESULT_WAIT_S = 5
_RETRY_S = 0.3
_MAX_RETRY_AFTER_S = 2.0
_BATCH_POLL_S = 1.0
_WORDS = ("the quick brown fox jumps over a lazy dog while seven curious cats count every passing cloud "
          "and rain falls softly on old stone bridges near the quiet river").split()


@dataclass
class LoadWindow:
    """When the load stops (monotonic): new scenarios start until `load_until`, those under
    way are dropped `grace_s` later. The soak's fault injector may move it later, so the
    load runs through every kind of fault however long the recoveries take."""

    load_until: float
    grace_s: float

    @property
    def give_up_at(self) -> float:
        return self.load_until + self.grace_s


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(float(response.headers.get("retry-after", _RETRY_S)), _MAX_RETRY_AFTER_S)
    except ValueError:
        return _RETRY_S


class LoadClient:
    """One client thread: its own connections, random stream and Idempotency-Keys."""

    def __init__(self, index: int, api_urls: list[str], ledger: Ledger, model_id: str, seed: int, window: LoadWindow):
        self.ledger = ledger
        self.model_id = model_id
        self.rng = random.Random(f"{seed}-{index}")
        # Unique within the soak (each soak has a Redis of its own).
        self._keys = (f"chaos-{index}-{n}" for n in itertools.count())
        self._urls = itertools.cycle(api_urls[index % len(api_urls):] + api_urls[:index % len(api_urls)])
        # Whatever a job's state, the client stops following it at the window's give_up_at.
        self.window = window
        self.http = httpx.Client(timeout=_TIMEOUT)

    def run(self) -> None:
        """Scenarios one after another until the window's load_until."""
        scenarios, weights = zip(*SCENARIO_WEIGHTS.items())
        try:
            while time.monotonic() < self.window.load_until:
                scenario = self.rng.choices(scenarios, weights)[0]
                self.ledger.scenario_ran(scenario)
                try:
                    getattr(self, "_" + scenario.replace("-", "_"))()
                except Exception:  # the harness's own fault (an answer it could not read): in the report, not lost
                    self.ledger.violation("harness-error", f"{scenario}: {traceback.format_exc(limit=3)}")
        finally:
            self.http.close()

    # ---- HTTP, through faults ---------------------------------------------------------

    def _request(self, method: str, path: str, *, until: float | None = None, stream: bool = False,
                 **kwargs) -> httpx.Response | None:
        """The first answer that is neither a retryable status nor a 5xx, from whichever api
        gives it; None when none came by `until` or within the request's patience. Every
        answer is recorded. A streamed response is returned open: the caller closes it."""
        patience_until = time.monotonic() + _REQUEST_PATIENCE_S
        until = min(until or patience_until, patience_until, self.window.give_up_at)
        while True:
            try:
                response = self.http.send(self.http.build_request(method, next(self._urls) + path, **kwargs), stream=stream)
            except httpx.TransportError as exc:
                self.ledger.transport_error(method, path, exc)
                wait = _RETRY_S
            else:
                status = response.status_code
                self.ledger.response(method, path, status, response.read().decode(errors="replace") if status >= 500 else "")
                if status < 500 and status not in RETRYABLE_STATUSES:
                    return response
                response.close()
                wait = _retry_after(response)
            if time.monotonic() + wait > until:
                if until == patience_until:  # the service ran out of time, not a deadline of the soak's
                    self.ledger.violation("unavailable", f"{method} {route_of(path)}: no usable answer within "
                                          f"{_REQUEST_PATIENCE_S:.0f}s (only 5xx, 429 or lost connections)")
                return None
            time.sleep(wait)

    def _answered(self, response: httpx.Response | None, expected: int, what: str) -> bool:
        """Whether the request got its `expected` status. Another one (a 4xx: the soak's
        requests are all valid) is a violation; None (given up on) was recorded already."""
        if response is None:
            return False
        if response.status_code != expected:
            self.ledger.violation("unexpected-status", f"{what}: HTTP {response.status_code}: {response.read()[:300]!r}")
        return response.status_code == expected

    def _follow_deadline(self) -> float:
        return min(time.monotonic() + _FOLLOW_S, self.window.give_up_at)

    # ---- requests -----------------------------------------------------------------------

    def _sampling(self, max_tokens: int) -> dict:
        if self.rng.random() < 0.15:
            return {"max_tokens": max_tokens, "temperature": 0.8, "seed": self.rng.randrange(1 << 31)}
        return {"max_tokens": max_tokens, "temperature": 0}

    def _words(self) -> str:
        return " ".join(self.rng.choices(_WORDS, k=self.rng.randint(3, 12)))

    def _generate_body(self, max_tokens: int | None = None) -> dict:
        if self.rng.random() < 0.5:
            prompt = {"prompt_token_ids": [self.rng.randrange(3, 500) for _ in range(self.rng.randint(4, 24))]}
        else:
            prompt = {"prompt": self._words()}
        return {**prompt, **self._sampling(max_tokens or self.rng.randint(8, 32))}

    def _submit(self, body: dict, key: str, scenario: str) -> str | None:
        response = self._request("POST", "/generate", json=body, headers={"Idempotency-Key": key})
        if not self._answered(response, 202, f"POST /generate (Idempotency-Key {key})"):
            return None
        seq_id = response.json()["seq_id"]
        self.ledger.accepted(seq_id, scenario, key)
        return seq_id

    def _wait_for_end(self, seq_id: str) -> dict | None:
        """The job's result once it has ended (long-polling GET /result); None if not in time."""
        deadline = self._follow_deadline()
        while time.monotonic() < deadline:
            response = self._request("GET", f"/result/{seq_id}", params={"wait": _RESULT_WAIT_S}, until=deadline)
            if not self._answered(response, 200, f"GET /result/{seq_id} of an accepted job"):
                return None
            result = response.json()
            if result["status"] in TERMINAL:
                return result
        return None

    def _follow_stream(self, seq_id: str) -> tuple[str, str] | None:
        """(end status, the text after the last reset) from GET /stream, resumed after the last
        event seen whenever the connection ends early; None if the end was not seen in time."""
        text, last_event_id = "", None
        deadline = self._follow_deadline()
        while time.monotonic() < deadline:
            headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
            response = self._request("GET", f"/stream/{seq_id}", until=deadline, stream=True, headers=headers)
            if response is None:
                return None
            with closing(response):
                if not self._answered(response, 200, f"GET /stream/{seq_id} of an accepted job"):
                    return None
                parser = SSEParser()
                try:
                    for piece in response.iter_text():
                        for event, data, event_id in parser.feed_text(piece):
                            last_event_id = event_id or last_event_id
                            if event == "delta":
                                text += data["text"]
                            elif event == "reset":  # a rerun starts over
                                text = ""
                            elif event == "end":
                                return data["status"], text
                except httpx.TransportError as exc:
                    self.ledger.transport_error("GET", f"/stream/{seq_id}", exc)
            time.sleep(_RETRY_S)
        return None

    # ---- the scenarios ------------------------------------------------------------------

    def _generate_poll(self) -> None:
        seq_id = self._submit(self._generate_body(), next(self._keys), "generate-poll")
        if seq_id is not None:
            self._wait_for_end(seq_id)

    def _generate_stream(self) -> None:
        seq_id = self._submit(self._generate_body(), next(self._keys), "generate-stream")
        if seq_id is None:
            return
        ended = self._follow_stream(seq_id)
        if ended is not None and ended[0] == "finished":
            self.ledger.received_text(seq_id, "stream", ended[1])

    def _submit_twice(self) -> None:
        """A client that never saw the first answer sends again: the ledger holds both seq_ids."""
        body, key = self._generate_body(), next(self._keys)
        first = self._submit(body, key, "submit-twice")
        second = self._submit(body, key, "submit-twice")
        if first is not None and second is not None:
            self._wait_for_end(second)

    def _cancel(self) -> None:
        # Long enough (no early eos) that the cancel often meets it queued or running.
        seq_id = self._submit({**self._generate_body(max_tokens=32), "ignore_eos": True}, next(self._keys), "cancel")
        if seq_id is None:
            return
        time.sleep(self.rng.uniform(0, 0.5))
        response = self._request("DELETE", f"/result/{seq_id}")
        if response is not None and response.status_code != 409:  # 409: it had already ended
            if self._answered(response, 200, f"DELETE /result/{seq_id}") and response.json()["status"] == "canceled":
                self.ledger.cancel_confirmed(seq_id)
        self._wait_for_end(seq_id)

    def _chat_body(self, stream: bool) -> dict:
        messages = [{"role": "user", "content": self._words()}]
        return {"model": self.model_id, "messages": messages, "stream": stream, **self._sampling(self.rng.randint(8, 32))}

    def _chat(self) -> None:
        # No Idempotency-Key on /v1: a retry after a lost answer is a new job; the one
        # before it must still end (the checks look at every job in Redis).
        response = self._request("POST", "/v1/chat/completions", json=self._chat_body(stream=False),
                                 timeout=_COMPLETION_TIMEOUT)
        if not self._answered(response, 200, "POST /v1/chat/completions"):
            return
        completion = response.json()
        seq_id = completion["id"].removeprefix("chatcmpl-")
        self.ledger.accepted(seq_id, "chat")
        self.ledger.received_text(seq_id, "chat", completion["choices"][0]["message"]["content"])

    def _chat_stream(self) -> None:
        response = self._request("POST", "/v1/chat/completions", json=self._chat_body(stream=True), stream=True,
                                 until=self._follow_deadline())
        if response is None:
            return
        with closing(response):
            if not self._answered(response, 200, "POST /v1/chat/completions (stream)"):
                return
            seq_id, text = None, ""
            try:
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        if seq_id is not None:
                            self.ledger.received_text(seq_id, "chat-stream", text)
                        return
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        self.ledger.violation("stream-error", f"chat stream of {seq_id}: {chunk['error']}")
                        return
                    if seq_id is None:
                        seq_id = chunk["id"].removeprefix("chatcmpl-")
                        self.ledger.accepted(seq_id, "chat-stream")
                    text += "".join(choice["delta"].get("content") or "" for choice in chunk["choices"])
            except httpx.TransportError as exc:
                # Cut off (its api killed, Redis gone): an OpenAI stream cannot resume; the job still must end.
                self.ledger.transport_error("POST", "/v1/chat/completions", exc)

    def _batch(self) -> None:
        key = next(self._keys)
        lines = [
            {"custom_id": f"{key}-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": self.model_id, "prompt": self._words(), **self._sampling(self.rng.randint(8, 16))}}
            for i in range(self.rng.randint(2, 4))
        ]
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = self._request("POST", "/v1/files", files={"file": ("chaos.jsonl", content)}, data={"purpose": "batch"},
                                 headers={"Idempotency-Key": f"{key}-file"})
        if not self._answered(uploaded, 200, "POST /v1/files"):
            return
        body = {"input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        created = self._request("POST", "/v1/batches", json=body, headers={"Idempotency-Key": f"{key}-batch"})
        if not self._answered(created, 200, "POST /v1/batches"):
            return
        batch_id = created.json()["id"]
        # Each line is a job `<batch id>-<line index>` (api/batches.py): every one must end.
        for index in range(len(lines)):
            self.ledger.accepted(f"{batch_id}-{index}", "batch")
        self._finish_batch(batch_id, len(lines))

    def _finish_batch(self, batch_id: str, total: int) -> None:
        """Poll the batch to its end; it must complete every line; read its output back."""
        deadline = self._follow_deadline()
        batch = None
        while time.monotonic() < deadline:
            response = self._request("GET", f"/v1/batches/{batch_id}", until=deadline)
            if not self._answered(response, 200, f"GET /v1/batches/{batch_id}"):
                return
            batch = response.json()
            if batch["status"] in BATCH_TERMINAL:
                break
            time.sleep(_BATCH_POLL_S)
        if batch is None or batch["status"] not in BATCH_TERMINAL:
            if self.window.give_up_at > time.monotonic():
                self.ledger.violation("batch", f"{batch_id} still {batch and batch['status']} after {_FOLLOW_S:.0f}s")
            return
        if batch["status"] != "completed" or batch["request_counts"] != {"total": total, "completed": total, "failed": 0}:
            self.ledger.violation("batch", f"{batch_id} ended {batch['status']} with {batch['request_counts']} "
                                  f"({total} valid lines sent); errors: {batch.get('errors')}")
        if batch.get("output_file_id"):
            self._read_batch_output(batch["output_file_id"])

    def _read_batch_output(self, file_id: str) -> None:
        response = self._request("GET", f"/v1/files/{file_id}/content")
        if not self._answered(response, 200, f"GET /v1/files/{file_id}/content"):
            return
        for raw in response.text.splitlines():
            line = json.loads(raw)
            answer = line["response"]
            if answer and answer["status_code"] == 200:
                self.ledger.received_text(answer["request_id"], "batch-output", answer["body"]["choices"][0]["text"])


class LoadGenerator:
    def __init__(self, api_urls: list[str], ledger: Ledger, model_id: str, seed: int, clients: int):
        self.api_urls = api_urls
        self.ledger = ledger
        self.model_id = model_id
        self.seed = seed
        self.clients = clients
        self._threads: list[threading.Thread] = []

    def start(self, window: LoadWindow) -> None:
        """New scenarios start until the window's load_until; those under way are dropped at its give_up_at."""
        for index in range(self.clients):
            client = LoadClient(index, self.api_urls, self.ledger, self.model_id, self.seed, window)
            thread = threading.Thread(target=client.run, name=f"chaos-client-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def join(self, window: LoadWindow, slack_s: float) -> int:
        """Wait for the clients until `slack_s` past the window's give_up_at (which may move
        meanwhile); how many are still running then."""
        for thread in self._threads:
            while thread.is_alive() and time.monotonic() < window.give_up_at + slack_s:
                thread.join(1.0)
        return sum(thread.is_alive() for thread in self._threads)
