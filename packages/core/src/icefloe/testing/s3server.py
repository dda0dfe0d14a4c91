"""The child process of :func:`icefloe.testing.objectstore.running_s3_store`: moto's S3 server
on a free loopback port, answering listings in pages of ``argv[1]`` keys; prints the port,
serves until its stdin closes. Imports moto only (it starts in a second, not ten)."""

from __future__ import annotations

import sys
from typing import Any


def serve(page_size: int) -> None:
    from moto.s3.models import S3Backend
    from moto.server import ThreadedMotoServer

    listing: Any = S3Backend.list_objects_v2

    def small_pages(self: S3Backend, *args: Any, max_keys: int, **kwargs: Any) -> Any:
        return listing(self, *args, max_keys=min(max_keys, page_size), **kwargs)

    S3Backend.list_objects_v2 = small_pages  # type: ignore[method-assign,assignment]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)
    sys.stdin.read()
    server.stop()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
