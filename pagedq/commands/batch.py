"""`pagedq batch submit | status | results | cancel`: many requests through the Batch API.

    pagedq batch submit --summarize reports/ --wait -o summaries.jsonl --markdown summaries/
    pagedq batch submit docs/*.txt --template "Summarize:\\n{text}" [--chat] [--max-tokens N]
    pagedq batch submit requests.jsonl            # OpenAI's batch input format
    pagedq batch status BATCH_ID                  # progress bars until it ends
    pagedq batch results BATCH_ID -o out.jsonl [--errors errors.jsonl] [--markdown DIR]

Every command exits 1 when any request (document) failed, and prints each failure's
reason. Submitting is resumable: the same input gives the same batch
(pagedq.Client.batch_submit), so running a submit again after an interruption, or after
the batch finished, queues nothing new.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from pagedq.cli import CommandError
from pagedq.client import BATCH_TERMINAL
from pagedq.commands.batch_report import print_failures, summary_records, wait_with_progress, write_markdown
from pagedq.commands.documents import read_documents
from pagedq.commands.service import SAMPLING_FIELDS, an_id, client_flags, connect, given_fields, sampling_flags
from pagedq.summaries import DEFAULT_MAP_TEMPLATE, DEFAULT_REDUCE_TEMPLATE, SUMMARIES_ENDPOINT

_ENDPOINTS = {False: "/v1/completions", True: "/v1/chat/completions"}
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}
_SUMMARY_SAMPLING = ("max_tokens", "temperature")


def register(subparsers) -> None:
    batch = subparsers.add_parser(
        "batch", help="run many requests or summarize many documents (submit, status, results, cancel)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = batch.add_subparsers(dest="batch_command", required=True, metavar="BATCH_COMMAND")

    submit = commands.add_parser(
        "submit", help="submit documents (--summarize or --template) or an OpenAI batch JSONL file",
        description="Submit a batch. Documents are .txt/.md files, directories of them, JSONL files with one "
        "document per line (--text-field) or PDFs (with the pdf extra). With --summarize each document gets one "
        "summary however long it is (split by the model's tokens, summarized in stages on the server); with "
        "--template each document is one prompt. Without either, INPUT is one .jsonl of OpenAI batch requests.")
    client_flags(submit)
    submit.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="documents (files, directories, JSONL, PDF), or one .jsonl of OpenAI batch requests")
    kind = submit.add_mutually_exclusive_group()
    kind.add_argument("--summarize", action="store_true",
                      help="one summary per document of any length (map-reduce over chunks that fit the model)")
    kind.add_argument("--template", help=r"one prompt per document: a template with {text} (the document); \n, \t escapes")
    submit.add_argument("--map-template", help=r"--summarize: the prompt for each chunk, with {text} "
                        f"(default: {DEFAULT_MAP_TEMPLATE!r})")
    submit.add_argument("--reduce-template", help=r"--summarize: the prompt that combines partial summaries, with "
                        f"{{text}} (default: {DEFAULT_REDUCE_TEMPLATE!r})")
    submit.add_argument("--overlap-tokens", type=int, help="--summarize: tokens each chunk repeats from the one "
                        "before (default 32)")
    submit.add_argument("--text-field", default="text", help="the field holding a JSONL document's text (default text)")
    submit.add_argument("--chat", action="store_true", help="send each prompt through the model's chat template")
    submit.add_argument("--model", help="the model's id (default: the one the server serves)")
    sampling_flags(submit)
    submit.add_argument("--endpoint", help="an OpenAI JSONL file's endpoint (default: the first line's url)")
    submit.add_argument("--dry-run", action="store_true", help="print the batch's JSONL instead of submitting it")
    submit.add_argument("--wait", action="store_true", help="wait for the batch to end (progress bars), then write "
                        "its results as `batch results` does")
    _result_flags(submit)
    submit.set_defaults(handler=cmd_submit)

    status = commands.add_parser("status", help="show a batch's progress until it ends",
                                 description="Progress bars (per document and stage for --summarize batches) until "
                                 "the batch ends; exits 1 if any request failed, printing why.")
    client_flags(status)
    status.add_argument("batch_id", type=an_id, help="the id `batch submit` printed")
    status.add_argument("--once", action="store_true", help="print the batch object (JSON) once and exit")
    status.add_argument("--poll", type=float, default=1.0, help="seconds between polls (default 1)")
    status.set_defaults(handler=cmd_status)

    results = commands.add_parser("results", help="write an ended batch's results (and failures)",
                                  description="Write an ended batch's output: OpenAI's output lines, or for a "
                                  "--summarize batch one line per document (id, summary, stages with their usage, "
                                  "usage). Exits 1 if any request failed, printing why; never writes an empty file.")
    client_flags(results)
    results.add_argument("batch_id", type=an_id, help="the id `batch submit` printed")
    results.add_argument("--wait", action="store_true", help="wait for the batch to end first")
    _result_flags(results)
    results.set_defaults(handler=cmd_results)

    cancel = commands.add_parser("cancel", help="cancel a batch: queued requests never run, running ones stop",
                                 description="Cancel a batch; it ends as cancelled once its running requests stop.")
    client_flags(cancel)
    cancel.add_argument("batch_id", type=an_id, help="the id `batch submit` printed")
    cancel.set_defaults(handler=cmd_cancel)


def _result_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", help="results JSONL file (default: stdout)")
    parser.add_argument("--errors", help="also write the failed requests' lines (OpenAI's error JSONL) to this file")
    parser.add_argument("--markdown", metavar="DIR", help="--summarize batches: also one Markdown file per document")


# ---- building the input ---------------------------------------------------------------------


def _unescape(template: str) -> str:
    return re.sub(r"\\([nt\\])", lambda match: _ESCAPES[match.group(1)], template)


def documents_jsonl(documents: dict[str, str], template: str, chat: bool, model: str, sampling: dict) -> bytes:
    """One request per document, custom_id = its id."""
    lines = []
    for doc_id, text in documents.items():
        prompt = template.replace("{text}", text.rstrip("\n"))
        body = {"model": model, **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}),
                **sampling}
        lines.append(json.dumps({"custom_id": doc_id, "method": "POST", "url": _ENDPOINTS[chat], "body": body}))
    return ("\n".join(lines) + "\n").encode()


def summary_jsonl(documents: dict[str, str]) -> bytes:
    lines = [json.dumps({"custom_id": doc_id, "method": "POST", "url": SUMMARIES_ENDPOINT, "body": {"text": text}})
             for doc_id, text in documents.items()]
    return ("\n".join(lines) + "\n").encode()


def _summary_options(args: argparse.Namespace, sampling: dict) -> dict:
    unused = sorted(set(sampling) - set(_SUMMARY_SAMPLING))
    if unused:
        raise CommandError(f"--summarize takes --max-tokens and --temperature; not {', '.join(unused)}")
    options = {**sampling, "chat": args.chat}
    for name in ("map_template", "reduce_template"):
        if getattr(args, name) is not None:
            template = _unescape(getattr(args, name))
            if template.count("{text}") != 1:
                raise CommandError(f"--{name.replace('_', '-')}: must contain {{text}} exactly once")
            options[name] = template
    if args.overlap_tokens is not None:
        options["overlap_tokens"] = args.overlap_tokens
    return options


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
    summary = None
    # Everything that can be checked here is, before anything is sent.
    if not args.summarize and (args.map_template or args.reduce_template or args.overlap_tokens is not None):
        raise CommandError("--map-template, --reduce-template and --overlap-tokens go with --summarize")
    if args.markdown and not (args.summarize and args.wait):
        raise CommandError("--markdown needs --summarize and --wait (or use it with `batch results`)")
    if (args.output or args.errors) and not args.wait:
        raise CommandError("-o/--output and --errors need --wait (or use them with `batch results`)")
    if args.summarize:
        summary = _summary_options(args, sampling)
        content, endpoint = summary_jsonl(read_documents(args.inputs, args.text_field)), SUMMARIES_ENDPOINT
    elif args.template is not None:
        template = _unescape(args.template)
        if "{text}" not in template:
            raise CommandError("--template: must contain {text}, where each document goes")
        documents = read_documents(args.inputs, args.text_field)
    else:
        if len(args.inputs) != 1 or not args.inputs[0].endswith(".jsonl"):
            raise CommandError("give documents with --summarize or --template, or exactly one .jsonl file of "
                               "OpenAI batch requests")
        if sampling or args.chat or args.model:
            raise CommandError("--chat, --model and sampling flags apply to documents (with --summarize or "
                               "--template); a JSONL file's lines carry their own bodies")
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
        batch = client.batch_submit(content, endpoint, summary=summary)
        counts = batch["request_counts"]
        print(f"batch {batch['id']}: {batch['status']}, {counts['total']} requests "
              f"({counts['completed']} completed, {counts['failed']} failed)", file=sys.stderr)
        print(batch["id"], flush=True)
        if args.wait:
            return _write_results(client, wait_with_progress(client, batch["id"], 1.0), args)
        if batch["status"] in BATCH_TERMINAL:  # submitted before and already ended
            return _exit_status(client, batch)
        if counts["failed"]:
            print_failures("".join(json.dumps(line) + "\n" for line in client.batch_refused(batch["id"])).encode())
            raise CommandError(f"{counts['failed']} of {counts['total']} requests were refused (the others run)")
    return 0


def _batch_failed(batch: dict) -> CommandError:
    errors = (batch.get("errors") or {}).get("data") or []
    detail = "; ".join(error.get("message") or error.get("code") or "" for error in errors)
    return CommandError(f"batch {batch['id']} {batch['status']}" + (f": {detail}" if detail else ""))


def _write_results(client, batch: dict, args: argparse.Namespace) -> int:
    """Write an ended batch's results where `args` say; 1 if any request failed (each reason printed)."""
    if batch["status"] == "failed":
        raise _batch_failed(batch)
    output, errors = client.batch_results(batch["id"])
    summaries = batch.get("summary") is not None
    if summaries:
        records = summary_records(output)
        text = "".join(json.dumps(record) + "\n" for record in records)
        if args.markdown and records:
            written = write_markdown(records, args.markdown)
            print(f"{len(written)} Markdown files in {args.markdown}", file=sys.stderr)
    else:
        text = output.decode()
    if args.errors:
        Path(args.errors).write_bytes(errors)
    failed = print_failures(errors)
    counts = batch["request_counts"]
    if not text:
        # Nothing to write: say so rather than leave an empty file.
        raise CommandError(f"batch {batch['id']} {batch['status']} with no results: "
                           f"{failed or counts['failed']} of {counts['total']} requests failed")
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    done = len(text.splitlines())
    print(f"{done} results" + (f" to {args.output}" if args.output else "")
          + (f"; {failed} requests failed" + (f" (see {args.errors})" if args.errors else "") if failed else ""),
          file=sys.stderr)
    if batch["status"] != "completed":
        raise _batch_failed(batch)
    return 1 if failed else 0


def _exit_status(client, batch: dict) -> int:
    """An ended batch's exit status: 1 if it did not complete or any request failed (each reason printed)."""
    if batch["status"] == "failed":
        raise _batch_failed(batch)
    failed = print_failures(client.batch_results(batch["id"])[1]) if batch["request_counts"]["failed"] else 0
    if batch["status"] != "completed":
        raise _batch_failed(batch)
    return 1 if failed or batch["request_counts"]["failed"] else 0


def cmd_status(args: argparse.Namespace) -> int:
    with connect(args) as client:
        if args.once:
            batch = client.batch_get(args.batch_id)
            print(json.dumps(batch, indent=2))
            return 1 if batch["request_counts"]["failed"] or batch["status"] == "failed" else 0
        batch = wait_with_progress(client, args.batch_id, args.poll)
        counts = batch["request_counts"]
        print(f"{batch['id']}: {batch['status']}: {counts['completed']} completed, {counts['failed']} failed "
              f"of {counts['total']}")
        return _exit_status(client, batch)


def cmd_results(args: argparse.Namespace) -> int:
    with connect(args) as client:
        batch = wait_with_progress(client, args.batch_id, 1.0) if args.wait else client.batch_get(args.batch_id)
        return _write_results(client, batch, args)


def cmd_cancel(args: argparse.Namespace) -> int:
    with connect(args) as client:
        print(json.dumps(client.batch_cancel(args.batch_id), indent=2))
    return 0
