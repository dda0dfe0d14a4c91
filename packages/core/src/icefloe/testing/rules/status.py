"""Rules of what operators read: ``Backend.probe()`` (for `icefloe doctor`) and
``Backend.describe()`` (for `icefloe status`) tell the truth and change nothing. Both are
optional - a backend that cannot tell raises NotImplementedError from ``probe`` or leaves a
field of ``BackendStatus`` None - but what they do say must be so."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping

import pytest

from icefloe.channel import Backend, BackendStatus
from icefloe.testing.rules.support import (
    Channels,
    SuiteBase,
    event_ids,
    make_batch,
    position_after,
    rule,
)


def _wrong(
    status: BackendStatus,
    leader: str,
    token: int,
    writer: str,
    stored: Mapping[str, int],
) -> list[str]:
    """What ``status`` says that is not so (None means "cannot tell" and is never wrong)."""
    out = []
    if status.token is not None and status.token != token:
        out.append(f"token {status.token}, not the leader's {token}")
    if status.leader is not None and leader not in status.leader:
        out.append(f"leader {status.leader!r}, not {leader!r}")
    if status.writers is not None and writer not in status.writers:
        out.append(f"writers {status.writers} without {writer!r}")
    if status.stored_position is not None and dict(status.stored_position) != dict(stored):
        out.append(f"stored position {dict(status.stored_position)}, not {dict(stored)}")
    return out


class StatusRules(SuiteBase):
    """Probe and describe."""

    @rule("Probe and describe")
    def test_describe_tells_the_leader_token_writers_and_position(
        self, backend: Backend, other_backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """What `icefloe status` shows an operator deciding whether a pipeline is stuck: never
        a stale leader or token (a takeover is the moment it matters). A backend whose status
        is read from a log may lag; it has ``read_timeout_s`` to catch up."""
        _, _, batch = self.publish_one(backend, group_id, channels, 0)
        first, records = self.read_from_start(backend, channels, group_id, event_ids([batch]), "c1")
        stored = position_after(records)
        first.store_position(stored)
        lease = first.renew()
        self.described(other_backend, "c1", lease.token, "w", stored)
        first.release()
        _, taken = self.take_over(backend, channels, "c2", lease, "c1 released the lease")
        self.described(other_backend, "c2", taken.token, "w", stored)

    @rule("Probe and describe")
    def test_probe_and_describe_change_nothing(
        self, backend: Backend, other_backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """They neither join, fence, renew nor write: the leader keeps its lease and token,
        the writer is not fenced, the channel holds no new event. And a server the suite is
        using is reachable: ``probe`` must not say otherwise."""
        w, ref, _ = self.publish_one(backend, group_id, channels, 0)
        leader, lease = self.leader(backend, channels, "c")
        end = leader.end_position()
        for _ in range(3):
            # NotImplementedError: "cannot tell", allowed; a ChannelError is a false alarm
            with contextlib.suppress(NotImplementedError):
                other_backend.probe()
            other_backend.describe()
        assert leader.renew().token == lease.token, "probe or describe took the lease"
        assert dict(leader.end_position()) == dict(end), "probe or describe wrote to the channel"
        assert w.publish(make_batch(group_id, ref, 1)) is True, "probe or describe fenced a writer"

    def described(
        self,
        backend: Backend,
        leader: str,
        token: int,
        writer: str,
        stored: Mapping[str, int],
    ) -> None:
        """Wait until ``describe()`` says nothing untrue; fail naming what it got wrong."""
        deadline = time.monotonic() + self.read_timeout_s
        while wrong := _wrong(backend.describe(), leader, token, writer, stored):
            if time.monotonic() > deadline:
                pytest.fail(f"describe() says {'; '.join(wrong)}")
            time.sleep(0.2)
