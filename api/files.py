"""Files of the Batch API: uploads (purpose "batch") and batches' output and error files.

Metadata lives in Redis, so any api replica serves any file; contents live in Redis or,
with `files_dir`, in that directory (which every replica must then mount). Both expire
after `files_ttl_s` in Redis; a directory is never pruned by pagedq. An upload is written
aside, then put in place under its id only if the id is new: a repeated upload with the
same Idempotency-Key and content answers the first file, with other content a 409.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, File, Form, Header, Request, UploadFile
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from redis import Redis

from api.auth import authenticate
from api.errors import ApiError
from api.threads import blocking
from pagedq.redis_schema import file_content_key, file_meta_key
from pagedq.settings import Settings

FILE_ID_PATTERN = re.compile(r"^file-[A-Za-z0-9_-]{1,100}$")
_CHUNK_BYTES = 1 << 20
# A multipart body carries the file plus its headers and the other fields.
MULTIPART_OVERHEAD_BYTES = 64 << 10
# Puts an upload written aside in place, unless the file id is taken.
# KEYS: the metadata key, the content key, the upload's temporary key. ARGV: the metadata, the TTL.
_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 1 then
    redis.call('DEL', KEYS[3])
    return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
if redis.call('EXISTS', KEYS[3]) == 1 then
    redis.call('RENAME', KEYS[3], KEYS[2])
    redis.call('EXPIRE', KEYS[2], ARGV[2])
end
return 1
"""


class FileObject(BaseModel):
    """OpenAI's file object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class StoredFile(FileObject):
    sha256: str


class FileTooLarge(Exception):
    pass


class FileConflict(Exception):
    pass


class FileStore:
    def __init__(self, connection: Redis, settings: Settings):
        self.connection = connection
        self.ttl_s = settings.files_ttl_s
        self.directory: Path | None = settings.files_dir
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def create(
        self, chunks: Iterable[bytes], filename: str, purpose: str, file_id: str | None = None,
        max_bytes: int | None = None,
    ) -> StoredFile:
        """Store a file; `file_id` None: a new id. FileTooLarge past `max_bytes`; FileConflict
        when `file_id` exists with other content (same content: the existing file)."""
        file_id = file_id or f"file-{uuid.uuid4().hex}"
        digest = hashlib.sha256()
        size = 0
        upload = f"upload-{uuid.uuid4().hex}"
        try:
            for chunk in chunks:
                size += len(chunk)
                if max_bytes is not None and size > max_bytes:
                    raise FileTooLarge(f"file: larger than the limit of {max_bytes} bytes (PAGEDQ_MAX_FILE_BYTES)")
                digest.update(chunk)
                self._append(upload, chunk)
            now = int(time.time())
            stored = StoredFile(id=file_id, bytes=size, created_at=now, filename=filename, purpose=purpose,
                                expires_at=now + self.ttl_s, sha256=digest.hexdigest())
            claimed = self._claim(upload, stored)
        finally:
            self._discard(upload)
        if claimed:
            return stored
        existing = self.get(file_id)
        if existing is None or existing.sha256 != stored.sha256:
            raise FileConflict(f"file {file_id} already exists with other content")
        return existing

    def _append(self, upload: str, chunk: bytes) -> None:
        if self.directory is None:
            with self.connection.pipeline(transaction=False) as pipeline:
                pipeline.append(file_content_key(upload), chunk)
                pipeline.expire(file_content_key(upload), 3600)  # an api that dies mid-upload leaves no litter
                pipeline.execute()
        else:
            with open(self.directory / f".{upload}", "ab") as out:
                out.write(chunk)

    def _claim(self, upload: str, stored: StoredFile) -> bool:
        if self.directory is None:
            keys = (file_meta_key(stored.id), file_content_key(stored.id), file_content_key(upload))
            return bool(self.connection.eval(_CLAIM, 3, *keys, stored.model_dump_json(), self.ttl_s))
        if not self.connection.set(file_meta_key(stored.id), stored.model_dump_json(), nx=True, ex=self.ttl_s):
            return False
        aside = self.directory / f".{upload}"
        aside.touch()  # an empty file wrote no chunk
        os.replace(aside, self.directory / stored.id)
        return True

    def _discard(self, upload: str) -> None:
        if self.directory is None:
            self.connection.delete(file_content_key(upload))
        else:
            (self.directory / f".{upload}").unlink(missing_ok=True)

    def get(self, file_id: str) -> StoredFile | None:
        if not FILE_ID_PATTERN.match(file_id):
            return None
        raw = self.connection.get(file_meta_key(file_id))
        return StoredFile.model_validate_json(raw) if raw else None

    def chunks(self, file_id: str) -> Iterator[bytes]:
        """The file's content, a chunk at a time."""
        if self.directory is not None:
            with open(self.directory / file_id, "rb") as content:
                while chunk := content.read(_CHUNK_BYTES):
                    yield chunk
            return
        offset = 0
        while chunk := self.connection.getrange(file_content_key(file_id), offset, offset + _CHUNK_BYTES - 1):
            yield chunk
            offset += len(chunk)

    def lines(self, file_id: str) -> Iterator[bytes]:
        """The file's lines (without their line ends)."""
        rest = b""
        for chunk in self.chunks(file_id):
            *lines, rest = (rest + chunk).split(b"\n")
            yield from lines
        if rest:
            yield rest

    def delete(self, file_id: str) -> bool:
        if self.get(file_id) is None:
            return False
        self.connection.delete(file_meta_key(file_id), file_content_key(file_id))
        if self.directory is not None:
            (self.directory / file_id).unlink(missing_ok=True)
        return True


def idempotent_file_id(idempotency_key: str, api_key: str) -> str:
    digest = hashlib.sha256(f"file\0{api_key}\0{idempotency_key}".encode()).hexdigest()
    return f"file-{digest[:32]}"


# ---- endpoints ----------------------------------------------------------------------------

router = APIRouter(prefix="/v1/files", dependencies=[Depends(authenticate)], tags=["Batch API"])


def _public(stored: StoredFile) -> dict:
    return FileObject.model_validate(stored.model_dump(exclude={"sha256"})).model_dump()


def _existing(request: Request, file_id: str) -> StoredFile:
    stored = request.app.state.files.get(file_id)
    if stored is None:
        raise ApiError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")
    return stored


@router.post("")
async def upload_file(
    request: Request,
    api_key: Annotated[str, Depends(authenticate)],
    file: Annotated[UploadFile, File(description="JSONL, one request per line (OpenAI's batch input format).")],
    purpose: Annotated[str, Form()],
    idempotency_key: Annotated[str | None, Header()] = None,
) -> dict:
    if purpose != "batch":
        raise ApiError(400, f"purpose: only 'batch' files are accepted, got {purpose!r}", param="purpose")
    files: FileStore = request.app.state.files
    settings: Settings = request.app.state.settings
    file_id = idempotent_file_id(idempotency_key, api_key) if idempotency_key else None
    chunks = iter(lambda: file.file.read(_CHUNK_BYTES), b"")
    try:
        stored = await blocking(request, lambda: files.create(
            chunks, file.filename or "upload.jsonl", "batch", file_id, settings.max_file_bytes))
    except FileTooLarge as exc:
        raise ApiError(413, str(exc), param="file") from None
    except FileConflict:
        raise ApiError(409, "Idempotency-Key: already used for a file with other content", code="idempotency_conflict") from None
    return _public(stored)


@router.get("/{file_id}")
async def get_file(file_id: str, request: Request) -> dict:
    return _public(await blocking(request, _existing, request, file_id))


@router.get("/{file_id}/content", response_class=StreamingResponse)
async def file_content(file_id: str, request: Request) -> StreamingResponse:
    await blocking(request, _existing, request, file_id)
    return StreamingResponse(request.app.state.files.chunks(file_id), media_type="application/octet-stream")


@router.delete("/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict:
    await blocking(request, _existing, request, file_id)
    await blocking(request, request.app.state.files.delete, file_id)
    return {"id": file_id, "object": "file", "deleted": True}
