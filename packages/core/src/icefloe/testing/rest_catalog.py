"""A thin Iceberg REST catalog server over any pyiceberg catalog, for tests.

Why it exists: the REST protocol is what Polaris, Unity, Nessie, Lakekeeper and Glue speak,
and no REST catalog server installs on the test machines (no Java artifacts, no Docker, no
Python server on the package index that is kept up). This adapter serves the endpoints the
REST client (pyiceberg's ``RestCatalog``) uses, from the spec's ``/v1`` tree, on top of a real
catalog (``SqlCatalog`` on SQLite or PostgreSQL), so icefloe's committer runs through the REST
client: its requests, its error mapping (409 is ``CommitFailedException``, 5xx on a commit is
``CommitStateUnknownException``) and its retries.

What it is not: a catalog of its own. Every operation is the backing catalog's: a commit's
requirements (``assert-ref-snapshot-id``, ``assert-table-uuid``, ``assert-create`` ...) are
checked by pyiceberg's requirement models against the table's current metadata, and the swap
of the metadata pointer is the backing catalog's compare-and-set; a requirement that fails or a
lost race answers 409, as the spec says. Requests and responses are parsed and written with
pyiceberg's own models, so the JSON is the client's. Served by werkzeug's threaded WSGI
server: concurrent clients commit concurrently, as against a real server.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError
from pyiceberg.catalog import Catalog, MetastoreCatalog
from pyiceberg.catalog.rest import (
    DEFAULT_NAMESPACE_SEPARATOR,
    ConfigResponse,
    CreateTableRequest,
    ListNamespaceResponse,
    ListTableResponseEntry,
    ListTablesResponse,
    NamespaceResponse,
    TableResponse,
)
from pyiceberg.catalog.rest.response import ErrorResponse, ErrorResponseMessage
from pyiceberg.exceptions import (
    CommitFailedException,
    NamespaceAlreadyExistsError,
    NamespaceNotEmptyError,
    NoSuchNamespaceError,
    NoSuchTableError,
    TableAlreadyExistsError,
)
from pyiceberg.partitioning import UNPARTITIONED_PARTITION_SPEC
from pyiceberg.table import CommitTableRequest, StagedTable, Table
from pyiceberg.table.sorting import UNSORTED_SORT_ORDER
from werkzeug.exceptions import HTTPException, NotFound
from werkzeug.routing import Map, Rule
from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server
from werkzeug.wrappers import Request, Response

#: What each catalog error answers (the spec's codes; pyiceberg's client maps them back).
_STATUS: dict[type[Exception], int] = {
    NoSuchTableError: 404,
    NoSuchNamespaceError: 404,
    TableAlreadyExistsError: 409,
    NamespaceAlreadyExistsError: 409,
    NamespaceNotEmptyError: 409,
    CommitFailedException: 409,
    ValidationError: 400,
}

_NS = "/v1/namespaces/<namespace>"
_URLS = Map(
    [
        Rule("/v1/config", methods=["GET"], endpoint="config"),
        Rule("/v1/namespaces", methods=["GET"], endpoint="list_namespaces"),
        Rule("/v1/namespaces", methods=["POST"], endpoint="create_namespace"),
        Rule(_NS, methods=["GET", "HEAD"], endpoint="load_namespace"),
        Rule(_NS, methods=["DELETE"], endpoint="drop_namespace"),
        Rule(f"{_NS}/tables", methods=["GET"], endpoint="list_tables"),
        Rule(f"{_NS}/tables", methods=["POST"], endpoint="create_table"),
        Rule(f"{_NS}/tables/<table>", methods=["GET", "HEAD"], endpoint="load_table"),
        Rule(f"{_NS}/tables/<table>", methods=["POST"], endpoint="commit_table"),
        Rule(f"{_NS}/tables/<table>", methods=["DELETE"], endpoint="drop_table"),
    ]
)


def _namespace(raw: str) -> tuple[str, ...]:
    """A namespace path parameter (werkzeug decoded it): levels joined by the unit separator.
    A level holding "/" cannot be routed (its quoted slash is decoded before routing)."""
    return tuple(raw.split(DEFAULT_NAMESPACE_SEPARATOR))


class _QuietHandler(WSGIRequestHandler):
    """No access log line per request: a pipeline makes thousands (errors still log)."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status=status, mimetype="application/json")


class RestCatalogServer:
    """The REST protocol over ``catalog``, on a loopback port of its own.

    ``client_config``: properties every client gets from ``GET /v1/config`` and with every
    loaded table (FileIO settings such as ``s3.endpoint``), as a real server hands them out.
    ``before_commit(identifier)`` runs before each table commit is applied (tests use it to
    slip another writer's commit in), ``after_commit(identifier)`` after it was applied; an
    exception from either answers 500, which the client takes for an unknown outcome (whether
    the commit landed or not). Use as a context manager, or call :meth:`start` and
    :meth:`stop`.
    """

    def __init__(
        self,
        catalog: Catalog,
        client_config: Mapping[str, str] | None = None,
        before_commit: Callable[[tuple[str, ...]], None] | None = None,
        after_commit: Callable[[tuple[str, ...]], None] | None = None,
    ) -> None:
        self.catalog = catalog
        self.client_config = dict(client_config or {})
        self.before_commit = before_commit
        self.after_commit = after_commit
        self.commits = 0  # commit requests answered 200
        self.conflicts = 0  # commit requests answered 409
        self._lock = threading.Lock()
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def uri(self) -> str:
        """The catalog's base URI, the ``uri`` property of a REST client."""
        if self._server is None:
            raise RuntimeError("the REST catalog server is not started")
        return f"http://127.0.0.1:{self._server.server_port}"

    def client_properties(self) -> dict[str, str]:
        """pyiceberg catalog properties of a client of this server."""
        return {"type": "rest", "uri": self.uri}

    def start(self) -> RestCatalogServer:
        self._server = make_server(
            "127.0.0.1", 0, self._wsgi, threaded=True, request_handler=_QuietHandler
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="rest-catalog", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = self._thread = None

    def __enter__(self) -> RestCatalogServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    # --- WSGI ------------------------------------------------------------------------------

    def _wsgi(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        return self._respond(Request(environ))(environ, start_response)

    def _respond(self, request: Request) -> Response:
        try:
            endpoint, args = _URLS.bind_to_environ(request.environ).match()
            handler: Callable[..., Response] = getattr(self, f"_{endpoint}")
            response = handler(request, **args)
        except HTTPException as exc:
            return self._error(exc.code or 500, type(exc).__name__, exc.description or "")
        except Exception as exc:  # every failure reaches the client as the spec's error body
            status = next((s for t, s in _STATUS.items() if isinstance(exc, t)), 500)
            return self._error(status, type(exc).__name__, str(exc))
        if request.method == "HEAD":
            return Response(status=204)
        return response

    @staticmethod
    def _error(status: int, kind: str, message: str) -> Response:
        body = ErrorResponse(error=ErrorResponseMessage(message=message, type=kind, code=status))
        return _json(body, status)

    # --- endpoints -------------------------------------------------------------------------

    def _config(self, request: Request) -> Response:
        return _json(ConfigResponse(defaults=self.client_config, overrides={}))

    def _list_namespaces(self, request: Request) -> Response:
        parent = request.args.get("parent")
        found = self.catalog.list_namespaces(_namespace(parent) if parent else ())
        return _json(ListNamespaceResponse(namespaces=found))

    def _create_namespace(self, request: Request) -> Response:
        # the spec's CreateNamespaceRequest has the response's shape (pyiceberg has no model)
        body = NamespaceResponse.model_validate_json(request.get_data())
        self.catalog.create_namespace(body.namespace, body.properties)
        return _json(body)

    def _load_namespace(self, request: Request, namespace: str) -> Response:
        ns = _namespace(namespace)
        properties = self.catalog.load_namespace_properties(ns)
        return _json(NamespaceResponse(namespace=ns, properties=properties))

    def _drop_namespace(self, request: Request, namespace: str) -> Response:
        self.catalog.drop_namespace(_namespace(namespace))
        return Response(status=204)

    def _list_tables(self, request: Request, namespace: str) -> Response:
        found = self.catalog.list_tables(_namespace(namespace))
        entries = [ListTableResponseEntry(namespace=t[:-1], name=t[-1]) for t in found]
        return _json(ListTablesResponse(identifiers=entries))

    def _create_table(self, request: Request, namespace: str) -> Response:
        # optional members the client leaves out (it drops nulls) though the model wants them
        optional = {"location": None, "partition-spec": None, "write-order": None}
        body = CreateTableRequest.model_validate({**optional, **json.loads(request.get_data())})
        identifier = (*_namespace(namespace), body.name)
        args: dict[str, Any] = {
            "schema": body.table_schema,
            "location": body.location,
            "partition_spec": body.partition_spec or UNPARTITIONED_PARTITION_SPEC,
            "sort_order": body.write_order or UNSORTED_SORT_ORDER,
            "properties": body.properties,
        }
        if not body.stage_create:
            return self._table(self.catalog.create_table(identifier, **args))
        # a staged create writes nothing: the client commits it with assert-create
        if not isinstance(self.catalog, MetastoreCatalog):
            raise NotImplementedError("staged creates need a metastore catalog behind")
        if self.catalog.table_exists(identifier):
            raise TableAlreadyExistsError(f"table {'.'.join(identifier)} already exists")
        staged: StagedTable = self.catalog._create_staged_table(identifier, **args)
        return self._table(staged)

    def _load_table(self, request: Request, namespace: str, table: str) -> Response:
        return self._table(self.catalog.load_table((*_namespace(namespace), table)))

    def _commit_table(self, request: Request, namespace: str, table: str) -> Response:
        body = CommitTableRequest.model_validate_json(request.get_data())
        identifier = (*_namespace(namespace), table)
        if self.before_commit is not None:
            self.before_commit(identifier)
        try:
            current = self.catalog.load_table(identifier)
        except NoSuchTableError:
            if not body.requirements or body.requirements[0].type != "assert-create":
                raise
            current = None
        # the backing catalog checks every requirement against the metadata it holds and
        # swaps the metadata pointer only if nobody moved it meanwhile: 409 otherwise
        target = current if current is not None else _Named(identifier)
        try:
            response = self.catalog.commit_table(target, body.requirements, body.updates)  # type: ignore[arg-type]
        except CommitFailedException:
            with self._lock:
                self.conflicts += 1
            raise
        with self._lock:
            self.commits += 1
        if self.after_commit is not None:
            self.after_commit(identifier)
        return _json(response)

    def _drop_table(self, request: Request, namespace: str, table: str) -> Response:
        self.catalog.drop_table((*_namespace(namespace), table))
        return Response(status=204)

    def _table(self, table: Table) -> Response:
        if table.metadata_location is None and not isinstance(table, StagedTable):
            raise NotFound("table without metadata")
        response = {
            "metadata-location": table.metadata_location,
            "metadata": table.metadata,
            "config": self.client_config,
        }
        return _json(TableResponse.model_validate(response))


class _Named:
    """What a catalog's ``commit_table`` reads of a table it is asked to create: its name."""

    def __init__(self, identifier: tuple[str, ...]) -> None:
        self._identifier = identifier

    def name(self) -> tuple[str, ...]:
        return self._identifier
