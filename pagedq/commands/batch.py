"""`pagedq batch submit | status | results | cancel`: pipelines over the Batch API.

    pagedq batch submit docs/*.txt --template "Summarize:\\n{text}" [--chat] [--max-tokens N]
    pagedq batch submit requests.jsonl            # OpenAI's batch input format
    pagedq batch status BATCH_ID                  # a progress bar until it ends
    pagedq batch results BATCH_ID -o out.jsonl [--errors errors.jsonl]

Documents become one request each, the custom_id being the path as given. Submitting is
resumable: the same input gives the same batch (pagedq.Client.batch_submit), so running a
submit again after an interruption, or after the batch finished, queues nothing new.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from pagedq.cli import CommandError
from pagedq.commands.service import SAMPLING_FIELDS, client_flags, connect, given_fields, sampling_flags

_ENDPOINTS = {False: "/v1/completions", True: "/v1/chat/completions"}
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def register(subparsers) -> None:
    batch = subparsers.add_parser("batch", help="run many requests through the Batch API (submit, status, results)")
    commands = batch.add_subparsers(dest="batch_command", required=True, metavar="BATCH_COMMAND")

    submit = commands.add_parser("submit", help="submit documents (with --template) or an OpenAI batch JSONL file")
    client_flags(submit)
    submit.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, or one .jsonl of OpenAI batch requests")
    submit.add_argument("--template", help=r"prompt template with {text} (the document) and \n, \t escapes")
    submit.add_argument("--chat", action="store_true", help="send each prompt as a user message to /v1/chat/completions")
    submit.add_argument("--model", help="the model's id (default: the one the server serves)")
    sampling_flags(submit)
    submit.add_argument("--endpoint", help="a JSONL file's endpoint (default: the first line's url)")
    submit.add_argument("--dry-run", action="store_true", help="print the batch's JSONL instead of submitting it")
    submit.set_defaults(handler=cmd_submit)

    status = commands.add_parser("status", help="show a batch's progress until it ends")
    client_flags(status)
    status.add_argument("batch_id")
    status.add_argument("--once", action="store_true", help="print the batch object once and exit")
    status.add_argument("--poll", type=float, default=1.0, help="seconds between polls (default 1)")
    status.set_defaults(handler=cmd_status)

    results = commands.add_parser("results", help="write an ended batch's output (and errors)")
    client_flags(results)
    results.add_argument("batch_id")
    results.add_argument("-o", "--output", help="output JSONL file (default: stdout)")
    results.add_argument("--errors", help="error JSONL file (default: the error lines go to stderr)")
    results.add_argument("--wait", action="store_true", help="wait for the batch to end first")
    results.set_defaults(handler=cmd_results)

    cancel = commands.add_parser("cancel", help="cancel a batch: queued requests never run, running ones stop")
    client_flags(cancel)
    cancel.add_argument("batch_id")
    cancel.set_defaults(handler=cmd_cancel)


# ---- building the input ---------------------------------------------------------------------


def _unescape(template: str) -> str:
    return re.sub(r"\\([nt\\])", lambda match: _ESCAPES[match.group(1)], template)


def read_documents(paths: list[str]) -> dict[str, str]:
    """Each document's text by its path as given (its custom_id)."""
    duplicates = sorted({path for path in paths if paths.count(path) > 1})
    if duplicates:
        raise CommandError(f"given more than once: {', '.join(duplicates)}")
    documents = {}
    for path in paths:
        try:
            documents[path] = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise CommandError(f"{path}: not UTF-8 text") from None
        except OSError as exc:
            raise CommandError(f"{path}: {exc.strerror}") from None
    return documents


def documents_jsonl(documents: dict[str, str], template: str, chat: bool, model: str, sampling: dict) -> bytes:
    """One request per document, custom_id = its path."""
    lines = []
    for path, text in documents.items():
        prompt = template.replace("{text}", text.rstrip("\n"))
        body = {"model": model, **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}),
                **sampling}
        lines.append(json.dumps({"custom_id": path, "method": "POST", "url": _ENDPOINTS[chat], "body": body}))
    return ("\n".join(lines) + "\n").encode()


def _jsonl_endpoint(content: bytes) -> str:
    for raw in content.splitlines():
        try:
            url = json.loads(raw).get("url")
        except (ValueError, AttributeError):
            continue
        if isinstance(url, str):
            return url
    raise CommandError("cannot tell the batch's endpoint from the file (no line has a url); pass --endpoint")


# ---- commands --------------------------------------------------------------------------------


def cmd_submit(args: argparse.Namespace) -> int:
    sampling = given_fields(args, SAMPLING_FIELDS)
    # Everything that can be checked here is, before anything is sent.
    if args.template is not None:
        template = _unescape(args.template)
        if "{text}" not in template:
            raise CommandError("--template: must contain {text}, where each document goes")
        documents = read_documents(args.inputs)
    else:
        if len(args.inputs) != 1 or not args.inputs[0].endswith(".jsonl"):
            raise CommandError("give documents with --template, or exactly one .jsonl file of OpenAI batch requests")
        if sampling or args.chat or args.model:
            raise CommandError("--chat, --model and sampling flags apply to documents (with --template); "
                               "a JSONL file's lines carry their own bodies")
        try:
            content = Path(args.inputs[0]).read_bytes()
        except OSError as exc:
            raise CommandError(f"{args.inputs[0]}: {exc.strerror}") from None
        endpoint = args.endpoint or _jsonl_endpoint(content)
    with connect(args) as client:
        if args.template is not None:
            model = args.model or client.models()[0]["id"]
            content = documents_jsonl(documents, template, args.chat, model, sampling)
            endpoint = _ENDPOINTS[args.chat]
        if args.dry_run:
            sys.stdout.write(content.decode())
            return 0
        batch = client.batch_submit(content, endpoint)
    counts = batch["request_counts"]
    print(f"batch {batch['id']}: {batch['status']}, {counts['total']} requests "
          f"({counts['completed']} completed, {counts['failed']} failed)", file=sys.stderr)
    print(batch["id"])
    return 0


def _ended(batch: dict) -> int:
    """The exit status for an ended batch: 0 if it completed (some lines may have failed)."""
    if batch["status"] == "completed":
        return 0
    errors = (batch.get("errors") or {}).get("data") or []
    detail = "; ".join(error.get("message") or error.get("code") or "" for error in errors)
    raise CommandError(f"batch {batch['id']} {batch['status']}" + (f": {detail}" if detail else ""))


def _wait_with_progress(client, batch_id: str, poll_s: float) -> dict:
    from tqdm import tqdm

    with tqdm(unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
        def update(batch: dict) -> None:
            counts = batch["request_counts"]
            bar.total = counts["total"]
            bar.n = counts["completed"] + counts["failed"]
            bar.set_description(batch["status"])
            bar.set_postfix(failed=counts["failed"])
            bar.refresh()

        return client.batch_wait(batch_id, poll_s=poll_s, on_update=update)


def cmd_status(args: argparse.Namespace) -> int:
    with connect(args) as client:
        if args.once:
            print(json.dumps(client.batch_get(args.batch_id), indent=2))
            return 0
        batch = _wait_with_progress(client, args.batch_id, args.poll)
    counts = batch["request_counts"]
    print(f"{batch['id']}: {batch['status']}: {counts['completed']} completed, {counts['failed']} failed "
          f"of {counts['total']}")
    return _ended(batch)


def cmd_results(args: argparse.Namespace) -> int:
    with connect(args) as client:
        batch = _wait_with_progress(client, args.batch_id, 1.0) if args.wait else client.batch_get(args.batch_id)
        if batch["status"] == "failed":
            return _ended(batch)
        output, errors = client.batch_results(args.batch_id)
    if args.output:
        Path(args.output).write_bytes(output)
    else:
        sys.stdout.write(output.decode())
    if args.errors:
        Path(args.errors).write_bytes(errors)
    elif errors:
        sys.stderr.write(errors.decode())
    failed = len(errors.splitlines())
    print(f"{len(output.splitlines())} results" + (f" to {args.output}" if args.output else "")
          + (f"; {failed} requests failed" + (f" (see {args.errors})" if args.errors else "") if failed else ""),
          file=sys.stderr)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with connect(args) as client:
        print(json.dumps(client.batch_cancel(args.batch_id), indent=2))
    return 0
