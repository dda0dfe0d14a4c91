"""Key names of one pipeline.

Every key of a pipeline is ``<prefix>:{<group_id>}:<name>``: the braces are a Redis Cluster
hash tag, so all of a pipeline's keys live in one slot and every Lua script (which must only
touch keys of one slot on a cluster) can use all of them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineKeys:
    """The keys of pipeline ``group_id`` under ``prefix``."""

    prefix: str
    group_id: str

    def __post_init__(self) -> None:
        if not self.group_id:
            raise ValueError("group_id must not be empty (an empty hash tag spreads the keys)")

    @property
    def tag(self) -> str:
        """Everything before the key's own name; contains the hash tag."""
        return f"{self.prefix}:{{{self.group_id}}}"

    def _key(self, name: str) -> str:
        return f"{self.tag}:{name}"

    @property
    def events(self) -> str:
        """Stream of writer events; entry ids are ``0-<offset>``."""
        return self._key("events")

    @property
    def event_seq(self) -> str:
        """Counter: the last offset given to an event."""
        return self._key("event-seq")

    @property
    def broadcasts(self) -> str:
        """Stream of coordinator events, read by every writer."""
        return self._key("broadcasts")

    @property
    def epochs(self) -> str:
        """Hash: writer_id -> epoch of its newest instance."""
        return self._key("epochs")

    @property
    def batches(self) -> str:
        """Sorted set: ``writer_id\\nbatch_seq`` -> offset of the batch's last event."""
        return self._key("batches")

    @property
    def batch_floors(self) -> str:
        """Hash: writer_id -> highest batch_seq whose key was pruned (committed)."""
        return self._key("batch-floors")

    def sources(self, writer_id: str) -> str:
        """Hash: ``topic\\npartition`` -> source position JSON, for one writer."""
        return self._key(f"sources:{writer_id}")

    @property
    def lease(self) -> str:
        """String ``<token>\\n<holder>`` with the lease's expiry as TTL."""
        return self._key("lease")

    @property
    def token(self) -> str:
        """Counter: the newest fencing token issued."""
        return self._key("token")

    @property
    def channel_id(self) -> str:
        """The channel's identity, set once (SET NX) when the pipeline's keys are first used;
        gone with them (restart without persistence, FLUSHALL), so a new one marks a reset."""
        return self._key("channel-id")

    @property
    def position(self) -> str:
        """JSON of the last stored (committed) channel position."""
        return self._key("position")

    def match_all(self) -> str:
        """A SCAN pattern of this pipeline's keys (glob characters escaped)."""
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in self.tag)
        return escaped + ":*"
