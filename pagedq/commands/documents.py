"""The documents a user has, read for `pagedq batch submit`: text and Markdown files,
directories of them (recursively, in name order), JSONL files with one document per line
(its text in `--text-field`, its id in `id` or `custom_id`, else FILE:LINE), and PDFs
through `pypdf` (the `pdf` extra: `pip install 'pagedq[pdf]'`). Each document's id is its
path as given (or the JSONL line's id); ids must be unique."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from pagedq.cli import CommandError

TEXT_SUFFIXES = (".txt", ".md", ".markdown")
PDF_SUFFIX = ".pdf"
JSONL_SUFFIX = ".jsonl"
PDF_MISSING = "PDF needs the pypdf package: pip install 'pagedq[pdf]' (or pip install pypdf)"


def read_documents(inputs: list[str], text_field: str = "text") -> dict[str, str]:
    """Each document's text by its id, in the order given. CommandError for what cannot be
    read; PDFs without pypdf are skipped with a message (an error if nothing else is left)."""
    documents: dict[str, str] = {}
    skipped: list[str] = []
    for given in inputs:
        for path in _files(given):
            if path.suffix.lower() == PDF_SUFFIX and not _have_pypdf():
                skipped.append(str(path))
                continue
            for doc_id, text in _read(path, text_field):
                if doc_id in documents:
                    raise CommandError(f"given more than once: {doc_id}")
                documents[doc_id] = text
    if skipped:
        print(f"pagedq: skipped {len(skipped)} PDF file(s) ({', '.join(skipped)}): {PDF_MISSING}", file=sys.stderr)
    if not documents:
        raise CommandError("no documents to submit" + (f" ({PDF_MISSING})" if skipped else ""))
    return documents


def _files(given: str) -> list[Path]:
    path = Path(given)
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in
                       (*TEXT_SUFFIXES, PDF_SUFFIX, JSONL_SUFFIX))
        if not found:
            raise CommandError(f"{given}: no .txt, .md, .pdf or .jsonl files in this directory")
        return found
    if not path.exists():
        raise CommandError(f"{given}: No such file or directory")
    return [path]


def _read(path: Path, text_field: str) -> list[tuple[str, str]]:
    suffix = path.suffix.lower()
    try:
        if suffix == PDF_SUFFIX:
            return [(str(path), _pdf_text(path))]
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CommandError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise CommandError(f"{path}: {exc.strerror}") from None
    if suffix == JSONL_SUFFIX:
        return _jsonl_documents(path, text, text_field)
    return [(str(path), text)]


def _jsonl_documents(path: Path, content: str, text_field: str) -> list[tuple[str, str]]:
    documents = []
    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError as exc:
            raise CommandError(f"{path}:{number}: not JSON ({exc})") from None
        text = line.get(text_field) if isinstance(line, dict) else None
        if not isinstance(text, str):
            raise CommandError(f"{path}:{number}: no string field {text_field!r} (choose it with --text-field)")
        doc_id = line.get("id", line.get("custom_id"))
        documents.append((str(doc_id) if doc_id is not None else f"{path}:{number}", text))
    return documents


def _have_pypdf() -> bool:
    return importlib.util.find_spec("pypdf") is not None


def _pdf_text(path: Path) -> str:
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        return "\n\n".join(page.extract_text() or "" for page in PdfReader(path).pages)
    except PdfReadError as exc:
        raise CommandError(f"{path}: not a readable PDF ({exc})") from None
