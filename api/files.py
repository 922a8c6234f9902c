"""Files of the Batch API: uploads (purpose "batch") and batches' output and error files.

Metadata lives in Redis, so any api replica serves any file; contents live in Redis or,
with `files_dir`, in that directory (which every replica must then mount). Both expire
after `files_ttl_s` in Redis; a directory is never pruned by pagedq. An upload is written
aside, then put in place under its id only if the id is new: a repeated upload with the
same Idempotency-Key and content answers the first file, with other content a 422.
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

from fastapi import APIRouter, Depends, File, Form, Header, Query, Request, UploadFile
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from redis import Redis

from api.auth import Caller, authenticate
from api.errors import ApiError, check_idempotency_key, idempotency_conflict
from api.threads import bulk
from pagedq.redis_schema import FILES_KEY, file_content_key, file_meta_key
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
    # The tenant that uploaded it, or whose batch wrote it (api.auth.Caller.tenant).
    owner: str = ""


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
        self, chunks: Iterable[bytes], filename: str, purpose: str, owner: str, file_id: str | None = None,
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
                                expires_at=now + self.ttl_s, sha256=digest.hexdigest(), owner=owner)
            claimed = self._claim(upload, stored)
        finally:
            self._discard(upload)
        if claimed:
            # Scored by the exact time, so files created in one second keep their order.
            self.connection.zadd(FILES_KEY, {stored.id: time.time()})
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

    def list(self, caller: Caller, purpose: str | None, limit: int, descending: bool, after: str | None) -> tuple[list[StoredFile], bool]:
        """Up to `limit` of the caller's files (of `purpose`, if given) in creation order,
        starting past the file `after`; and whether more follow."""
        page = 500
        id_range = self.connection.zrevrange if descending else self.connection.zrange
        start = 0
        if after is not None:
            # Only the caller's own file is a cursor: another tenant's id answers as an unknown
            # one, or the listing would confirm that it exists (and when it was made).
            cursor = self.get(after)
            rank = None
            if cursor is not None and caller.owns(cursor.owner):
                rank = (self.connection.zrevrank if descending else self.connection.zrank)(FILES_KEY, after)
            if rank is None:
                return [], False
            start = rank + 1
        found: list[StoredFile] = []
        gone: list[str] = []
        while len(found) <= limit:
            ids = [i.decode() if isinstance(i, bytes) else i for i in id_range(FILES_KEY, start, start + page - 1)]
            if not ids:
                break
            start += page
            for file_id, raw in zip(ids, self.connection.mget([file_meta_key(i) for i in ids])):
                if raw is None:
                    gone.append(file_id)
                    continue
                stored = StoredFile.model_validate_json(raw)
                if caller.owns(stored.owner) and (purpose is None or stored.purpose == purpose):
                    found.append(stored)
        if gone:
            self.connection.zrem(FILES_KEY, *gone)
        return found[:limit], len(found) > limit

    def delete(self, file_id: str) -> bool:
        if self.get(file_id) is None:
            return False
        self.connection.zrem(FILES_KEY, file_id)
        self.connection.delete(file_meta_key(file_id), file_content_key(file_id))
        if self.directory is not None:
            (self.directory / file_id).unlink(missing_ok=True)
        return True


def idempotent_file_id(idempotency_key: str, owner: str) -> str:
    digest = hashlib.sha256(f"file\0{owner}\0{idempotency_key}".encode()).hexdigest()
    return f"file-{digest[:32]}"


# ---- endpoints ----------------------------------------------------------------------------

router = APIRouter(prefix="/v1/files", tags=["Batch API"])
Auth = Annotated[Caller, Depends(authenticate)]


def _public(stored: StoredFile) -> dict:
    return FileObject.model_validate(stored.model_dump(exclude={"sha256", "owner"})).model_dump()


def _existing(request: Request, file_id: str, caller: Caller) -> StoredFile:
    """The file, if the caller may see it: another tenant's file is as absent as none."""
    stored = request.app.state.files.get(file_id)
    if stored is None or not caller.owns(stored.owner):
        raise ApiError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")
    return stored


@router.post("")
async def upload_file(
    request: Request,
    caller: Auth,
    file: Annotated[UploadFile, File(description="JSONL, one request per line (OpenAI's batch input format).")],
    purpose: Annotated[str, Form()],
    idempotency_key: Annotated[str | None, Header()] = None,
) -> dict:
    check_idempotency_key(idempotency_key)
    if purpose != "batch":
        raise ApiError(400, f"purpose: only 'batch' files are accepted, got {purpose!r}", param="purpose")
    files: FileStore = request.app.state.files
    settings: Settings = request.app.state.settings
    file_id = idempotent_file_id(idempotency_key, caller.tenant) if idempotency_key else None
    chunks = iter(lambda: file.file.read(_CHUNK_BYTES), b"")
    try:
        stored = await bulk(request, caller.tenant, lambda: files.create(
            chunks, file.filename or "upload.jsonl", "batch", caller.tenant, file_id, settings.max_file_bytes))
    except FileTooLarge as exc:
        raise ApiError(413, str(exc), param="file") from None
    except FileConflict:
        raise idempotency_conflict("Idempotency-Key: already used for a file with other content") from None
    return _public(stored)


@router.get("")
async def list_files(
    request: Request,
    caller: Auth,
    purpose: Annotated[str | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
    after: Annotated[str | None, Query(description="A file id: list the files after it.")] = None,
) -> dict:
    """OpenAI's file list: the caller's files, newest first unless order=asc, paged with limit/after."""
    files: FileStore = request.app.state.files
    found, has_more = await bulk(request, caller.tenant, files.list, caller, purpose, limit, order == "desc", after)
    data = [_public(stored) for stored in found]
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


@router.get("/{file_id}")
async def get_file(file_id: str, request: Request, caller: Auth) -> dict:
    return _public(await bulk(request, caller.tenant, _existing, request, file_id, caller))


@router.get("/{file_id}/content", response_class=StreamingResponse)
async def file_content(file_id: str, request: Request, caller: Auth) -> StreamingResponse:
    await bulk(request, caller.tenant, _existing, request, file_id, caller)
    return StreamingResponse(request.app.state.files.chunks(file_id), media_type="application/octet-stream")


@router.delete("/{file_id}")
async def delete_file(file_id: str, request: Request, caller: Auth) -> dict:
    await bulk(request, caller.tenant, _existing, request, file_id, caller)
    await bulk(request, caller.tenant, request.app.state.files.delete, file_id)
    return {"id": file_id, "object": "file", "deleted": True}
