"""Leadership: the lease, its renewal, and the fencing token every table commit carries."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from icefloe.channel import CoordinatorChannel, Lease
from icefloe.errors import NotLeaderError

_MAX_RENEW_GAP_S = 5.0  # renew at least this often even when a lease never expires


class Leadership:
    """Holds this coordinator's lease; renews a third of the way into it."""

    def __init__(
        self,
        channel: CoordinatorChannel,
        coordinator_id: str,
        after_lease_check: Callable[[str], None] | None = None,
    ) -> None:
        self._channel = channel
        self._coordinator_id = coordinator_id
        self._after_lease_check = after_lease_check
        self.lease: Lease | None = None
        self._renew_at = 0.0
        # commit workers (coordination.commit_parallelism) renew before each table commit:
        # one renewal at a time, as the channel's clients expect a single caller
        self._renewing = threading.Lock()

    def acquire(self, timeout: float) -> Lease | None:
        lease = self._channel.acquire(timeout)
        if lease is not None:
            self._set(lease)
        return lease

    def _set(self, lease: Lease) -> None:
        self.lease = lease
        now = time.monotonic()
        # renew a third of the way into the lease, so two renewals can fail before it expires
        self._renew_at = now + min(max(lease.expires_at - now, 0.0) / 3, _MAX_RENEW_GAP_S)

    def renew(self) -> None:
        with self._renewing:
            try:
                self._set(self._channel.renew())
            except NotLeaderError:
                self.lease = None
                raise

    def renew_if_due(self) -> None:
        if time.monotonic() >= self._renew_at:
            self.renew()

    def before_commit(self) -> None:
        """Runs right before each catalog commit attempt: prove we still lead."""
        self.renew()
        if self._after_lease_check is not None:
            self._after_lease_check(self._coordinator_id)

    def token(self) -> int:
        if self.lease is None:
            raise NotLeaderError(f"{self._coordinator_id} is not the leader")
        return self.lease.token

    def drop(self) -> None:
        self.lease = None

    def release(self) -> None:
        """Give the lease back (if held); it counts as dropped even when the call fails."""
        if self.lease is not None:
            try:
                self._channel.release()
            finally:
                self.lease = None
