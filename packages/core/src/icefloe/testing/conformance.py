"""The backend conformance suite: what every coordination backend must pass against its real
server. Each test checks one rule of ``docs/backend-authors.md`` and, when it fails, says which
(``rule 'Atomic batches' of docs/backend-authors.md is broken: ...``).

How a backend author uses it (the built-in Kafka, PostgreSQL and Redis backends do exactly
this; see ``docs/backend-authors.md``; needs ``icefloe-core[test]``)::

    # packages/my-backend/tests/my_backend/test_conformance.py
    import pytest
    from icefloe.testing.conformance import BackendConformance, BackendFactory

    class TestMyBackendConformance(BackendConformance):
        @pytest.fixture
        def backend_factory(self, my_server) -> BackendFactory:
            # (group_id, lease_ttl_s) -> a NEW Backend connected to the same real server; also
            # called in forked child processes, so it must connect when called
            return lambda group_id, ttl: MyBackend(my_server.url, group_id, lease_ttl_s=ttl)

        @pytest.fixture
        def recreate_store(self, my_server) -> StoreRecreator:
            # backend -> None: drop the store the backend's pipeline lives in
            return lambda backend: my_server.drop_store_of(backend)

The backend itself provides the two test hooks declared on the abstract classes of
:mod:`icefloe.channel`: ``Backend.inject_undecodable`` (required) and
``CoordinatorChannel.simulate_crash`` (optional). A method or the ``recreate_store`` fixture
that is missing is reported once, by the test of its rule; the other tests that need it are
skipped, naming that test.

Every test uses a fresh random ``group_id``, so tests never see each other's events, leases or
positions even on a shared server. Lease TTLs are short (:attr:`lease_ttl_s`) and every wait
polls with a deadline (:attr:`read_timeout_s`), so no test depends on timing.

What is checked (one or more tests per rule, see :data:`RULES`):

* channel contract: epochs grow and fence older writer instances (a fenced publish adds
  nothing); a batch's events are all visible, in publish order, contiguous for the writer;
  re-publishing a batch key is a no-op or yields exact duplicates (the coordinator drops them);
  positions grow and a seek to a stored position resumes exactly after it; concurrent
  publishers (threads of one Backend, and child processes with their own Backend) never make
  an event visible below a position already read, leave no gaps and show whole batches; one
  leader at a time with a fencing token that grows across takeovers, re-acquire, release,
  close, two channels with one coordinator id; lease takeover after the leader dies;
  broadcasts reach writers opened before them and are kept; batch keys survive ``prune``;
  Backend objects from the factory share one store; channels work from any thread; pipelines
  are isolated; ``poll`` stops at undecodable bytes; ``end_position`` is exactly past the
  newest event and a seek past it raises ``ChannelResetError``; the channel id is stable and a
  recreated store gets a new one; epochs and tokens grow across a recreated store;
  ``probe``/``describe`` tell the truth and change nothing;
* the coordinator end to end with a real Iceberg catalog (SQLite ``SqlCatalog`` in
  ``tmp_path``) and real Parquet files, the coordinator's Backend object being another one
  than the writers' (as in production): N writers x M cycles give exactly M snapshots per table
  and every row once; a replayed batch adds no rows; a coordinator crash between the Iceberg
  commit and the position store loses and duplicates nothing; a stale leader cannot commit
  after a takeover.

Layout: the tests live in :mod:`icefloe.testing.rules`, one mixin class per topic -
``publishing`` (epochs, atomic and idempotent batches), ``reading`` (positions, zero timeouts,
bytes, end position), ``leadership`` (one leader, lease clock), ``broadcasts``, ``retention``,
``stores`` (shared store, isolated pipelines, identity, numbering), ``status`` (probe and
describe), ``concurrency`` (concurrent publishers, threading) and ``scenarios`` (the
coordinator end to end) - on the settings, fixtures and helpers of ``rules.support``; this
module composes them. It stays a module
rather than becoming a package because this import path is the documented one third parties
use: a package would have to re-export from its ``__init__``, which in this repository holds
only a docstring. The helpers it used to define are re-exported here for the same reason.
A new test goes in the module of its topic; decorate each with :func:`rule` (with
``reports=`` when it is the one test that reports a missing method of its rule).
"""

from __future__ import annotations

from icefloe.testing.rules.broadcasts import BroadcastRules
from icefloe.testing.rules.concurrency import ConcurrencyRules, in_thread, publish_run
from icefloe.testing.rules.leadership import LeadershipRules
from icefloe.testing.rules.publishing import PublishingRules
from icefloe.testing.rules.reading import ReadingRules
from icefloe.testing.rules.retention import RetentionRules
from icefloe.testing.rules.scenarios import CoordinatorScenarios
from icefloe.testing.rules.status import StatusRules
from icefloe.testing.rules.stores import StoreRules
from icefloe.testing.rules.support import (
    RULES,
    BackendFactory,
    StoreRecreator,
    assert_same_position,
    broken,
    event_ids,
    fake_file,
    make_batch,
    opened_backend,
    position_after,
    rule,
)

__all__ = [
    "RULES",
    "BackendConformance",
    "BackendFactory",
    "StoreRecreator",
    "assert_same_position",
    "broken",
    "event_ids",
    "fake_file",
    "in_thread",
    "make_batch",
    "opened_backend",
    "position_after",
    "publish_run",
    "rule",
]


# pytest collects the tests of base classes last base first: listed backwards, they run in
# the order of the layout above
class BackendConformance(
    CoordinatorScenarios,
    StatusRules,
    ConcurrencyRules,
    StoreRules,
    RetentionRules,
    BroadcastRules,
    LeadershipRules,
    ReadingRules,
    PublishingRules,
):
    """Base class of a backend's conformance tests; see the module docstring."""
