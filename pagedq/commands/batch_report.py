"""What `pagedq batch` shows of a batch: a progress bar (for a summary batch, one per
document in progress with its stage), the failures with their reasons, and a summary
batch's results as JSONL and Markdown."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Progress bars shown at once for the documents in progress (more would not fit a terminal).
_DOCUMENT_BARS = 8
_TOO_LONG_HINT = ("too long for one prompt: `pagedq batch submit --summarize` "
                  "splits it and summarizes it in stages")


class Progress:
    """tqdm bars: the batch's requests (documents) done, and each document in progress's stage."""

    def __init__(self):
        from tqdm import tqdm

        self._tqdm = tqdm
        self.total = tqdm(unit="req", file=sys.stderr, dynamic_ncols=True, position=0)
        self.documents: dict[str, object] = {}

    def update(self, batch: dict) -> None:
        counts = batch["request_counts"]
        self.total.total = counts["total"]
        self.total.n = counts["completed"] + counts["failed"]
        self.total.unit = "doc" if batch.get("summary") else "req"
        self.total.set_description(batch["status"])
        self.total.set_postfix(failed=counts["failed"])
        self.total.refresh()
        running = [d for d in batch.get("documents") or [] if d["status"] == "in_progress"]
        shown = {d["custom_id"]: d for d in running[:_DOCUMENT_BARS]}
        for custom_id in list(self.documents):
            if custom_id not in shown:
                self.documents.pop(custom_id).close()
        for custom_id, document in shown.items():
            bar = self.documents.get(custom_id)
            if bar is None:
                bar = self.documents[custom_id] = self._tqdm(
                    unit="req", file=sys.stderr, dynamic_ncols=True, leave=False, position=len(self.documents) + 1)
            bar.total, bar.n = document["requests"], document["done"]
            bar.set_description(f"{custom_id} {document['kind']} {document['stage']}")
            bar.refresh()

    def close(self) -> None:
        for bar in self.documents.values():
            bar.close()
        self.total.close()


def wait_with_progress(client, batch_id: str, poll_s: float) -> dict:
    progress = Progress()
    try:
        return client.batch_wait(batch_id, poll_s=poll_s, on_update=progress.update)
    finally:
        progress.close()


def failure_reasons(errors: bytes) -> list[str]:
    """One line per failed request: its id and why, from the batch's error file."""
    reasons = []
    for raw in errors.splitlines():
        line = json.loads(raw)
        if line.get("error"):
            message = line["error"].get("message") or line["error"].get("code")
        else:
            message = ((line.get("response") or {}).get("body") or {}).get("error", {}).get("message", "failed")
        if message.startswith("prompt:") and "more than" in message:  # too long, by tokens or characters
            message += f" ({_TOO_LONG_HINT})"
        reasons.append(f"{line.get('custom_id') or '(no custom_id)'}: {message}")
    return reasons


def print_failures(errors: bytes) -> int:
    reasons = failure_reasons(errors)
    for reason in reasons:
        print(f"pagedq: failed: {reason}", file=sys.stderr)
    return len(reasons)


def summary_records(output: bytes) -> list[dict]:
    """A summary batch's output as one record per document: id, summary, per-stage usage."""
    records = []
    for raw in output.splitlines():
        line = json.loads(raw)
        body = line["response"]["body"]
        records.append({"id": line["custom_id"], "summary": body["summary"], "stages": body["stages"],
                        "usage": body["usage"]})
    return records


def write_markdown(records: list[dict], directory: str) -> list[Path]:
    """One Markdown file per document, named after its id."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for record in records:
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in record["id"]).strip("._") or "document"
        path = out / f"{name}.md"
        stages = ", ".join(f"{s['kind']} {s['stage']}: {s['requests']} requests" for s in record["stages"])
        path.write_text(f"# {record['id']}\n\n{record['summary'].strip()}\n\n"
                        f"<!-- {stages}; {record['usage']['total_tokens']} tokens -->\n", encoding="utf-8")
        written.append(path)
    return written
