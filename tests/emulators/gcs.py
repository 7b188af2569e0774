"""Cloud Storage for tests: the gcp-storage-emulator package's JSON API server, plus the one call it lacks.

gcsfs renames an object with Objects: move (POST .../b/BUCKET/o/SRC/moveTo/o/DEST,
https://cloud.google.com/storage/docs/json_api/v1/objects/move), which Cloud Storage serves and the emulator
answers 501; gcsfs then retries it six times with backoff (about 30 s) before it copies and deletes. The route
added here does what the real call does: the object under its new name, the old one gone, the new resource
as the answer. gcsfs reaches the server through STORAGE_EMULATOR_HOST.
"""
from __future__ import annotations

import contextlib
from http import HTTPStatus
from typing import Iterator

from tests.awsfaults import free_port


def _move(request, response, storage, *args, **kwargs) -> None:
    from gcp_storage_emulator.exceptions import Conflict, NotFound
    from gcp_storage_emulator.handlers import objects

    bucket = request.params["bucket_name"]
    try:
        moved = objects._copy(request.base_url, storage, bucket, request.params["object_id"], bucket,
                              request.params["dest_object_id"])
        storage.delete_file(bucket, request.params["object_id"])
    except NotFound:
        response.status = HTTPStatus.NOT_FOUND
        return
    except Conflict as err:
        objects._handle_conflict(response, err)
        return
    response.json(moved)


@contextlib.contextmanager
def gcs_server(bucket: str) -> Iterator[str]:
    """An in-memory Cloud Storage on a free local port holding `bucket`, for the block's length; yields its URL."""
    from gcp_storage_emulator import server, settings

    move = (rf"^{settings.API_ENDPOINT}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/"
            rf"(?P<dest_object_id>.*[^/]+)$", {"POST": _move})
    if move[0] not in [regex for regex, _ in server.HANDLERS]:
        server.HANDLERS = (move, *server.HANDLERS)
    port = free_port()
    emulator = server.create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    emulator.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        emulator.stop()
