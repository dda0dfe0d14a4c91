"""Where a writer may start when its checkpoint cannot tell, and when it must not start.

Two operator situations lose the link between a writer's checkpoint and what it published:

* **A lost checkpoint** (new checkpoint, ``starting_offsets = "table"``). The new checkpoint
  gives the writer a new id, so batches the old writer published but the coordinator had not
  committed yet would be read again from the source and land twice. The writer therefore
  starts from the **greater** of the source offsets the tables record and those the batches
  still on the channel reached (:func:`start_offsets`).

  Why the greater, not "drain first": a published batch is committed (or quarantined) by
  whichever coordinator leads, in the driver or standalone (invariant 2), so the new writer
  only has to start after it, and finding where takes one read-only pass over the channel
  (no lease, nothing stored). Draining first would need the lease (a standalone coordinator
  would have to be stopped, or waited for) and would block the start for as long as any table
  fails to commit.

  Read order matters while a coordinator runs: the channel first, then the tables. A batch
  the coordinator commits in between was either still on the channel when it was read
  (positions are stored only after the Iceberg commit) or is in the tables read afterwards.

* **A fresh (or older) checkpoint under an explicit writer id.** Spark numbers batches from
  the checkpoint, so they restart below what the channel or the tables hold for that writer
  id, and the dedupe rule would drop them as replays. :func:`check_batch_continuity` refuses
  such a start (:class:`~icefloe.errors.WriterRegressionError`) instead of starting a new
  incarnation: a new writer id is that incarnation already, and choosing it is the
  operator's call (the message says how).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from pyiceberg.catalog import Catalog

from icefloe.channel import CoordinatorChannel
from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.dedupe import max_merge
from icefloe.commit.policy import TablePolicies
from icefloe.coordination.backlog import READ_TO_END_S, backlog
from icefloe.errors import WriterRegressionError
from icefloe.events import DataComplete, DataWritten

K = TypeVar("K")
SourceOffsets = dict[str, dict[int, int]]  # topic -> partition -> next offset


@dataclass(frozen=True)
class Progress:
    """How far a pipeline's writers got, by source offsets and by batch numbers."""

    source_offsets: SourceOffsets = field(default_factory=dict)
    """Per source partition, the furthest next offset reached."""
    batches: dict[str, int] = field(default_factory=dict)
    """Per writer id, the highest batch number."""


def published(
    channel: CoordinatorChannel, group_id: str, timeout_s: float = READ_TO_END_S
) -> Progress:
    """What the batches still on the channel (from its stored position to its end) reached:
    the source positions their DataComplete events carry and each writer's highest batch_seq.
    Read only: no lease, nothing stored. Raises
    :class:`~icefloe.errors.ChannelStalledError` when the channel's end is not reached within
    ``timeout_s`` (a shorter read would start the writer below batches it missed)."""
    offsets: SourceOffsets = {}
    batches: dict[str, int] = {}
    for rec in backlog(channel, group_id, timeout_s):
        event, payload = rec.event, rec.event.payload
        if isinstance(payload, DataComplete):
            for p in payload.positions:
                _raise(offsets.setdefault(p.topic, {}), p.partition, p.offset)
        if (
            isinstance(payload, (DataWritten, DataComplete))
            and event.writer is not None
            and event.batch_seq is not None
        ):
            _raise(batches, event.writer.writer_id, event.batch_seq)
    return Progress(offsets, batches)


def committed(
    catalog: Catalog, group_id: str, tables: Iterable[str], branch: str | TablePolicies = "main"
) -> Progress:
    """What the group's newest snapshots of ``tables`` record: source offsets and writer
    watermarks, each merged by taking the highest value (a table that received no rows of a
    range gets no snapshot for it, so its offsets legitimately lag). Tables that do not exist
    or hold no snapshot of the group are skipped. ``branch``: one branch for every table, or
    the pipeline's policies (each table read on its own branch)."""
    policies = TablePolicies.single(branch) if isinstance(branch, str) else branch
    committer = IcebergCommitter(
        catalog, group_id, branch=policies.default.branch, policies=policies
    )
    offsets: SourceOffsets = {}
    batches: dict[str, int] = {}
    for name in tables:
        if not catalog.table_exists(name):
            continue
        state = committer.state(name)
        if state is None:
            continue
        for topic, parts in state.source_offsets.items():
            mine = offsets.setdefault(topic, {})
            for partition, offset in parts.items():
                _raise(mine, int(partition), offset)
        batches = max_merge(batches, state.watermarks)
    return Progress(offsets, batches)


def start_offsets(on_channel: Progress, in_tables: Progress) -> SourceOffsets:
    """Per source partition, the greater of what the tables record and what the channel's
    uncommitted batches reached: where a writer without a checkpoint starts (see above)."""
    out: SourceOffsets = {t: dict(parts) for t, parts in in_tables.source_offsets.items()}
    for topic, parts in on_channel.source_offsets.items():
        mine = out.setdefault(topic, {})
        for partition, offset in parts.items():
            _raise(mine, partition, offset)
    return out


def check_batch_continuity(
    writer_id: str,
    checkpoint_batch: int | None,
    on_channel: Progress,
    in_tables: Progress,
    checkpoint: str,
) -> None:
    """Refuse to start ``writer_id`` when its checkpoint (newest planned batch
    ``checkpoint_batch``, None when it has none) is behind the batches the channel or the
    tables hold for it.

    Spark re-runs at most the newest planned batch, with the same offsets, so a checkpoint at
    batch N may meet a writer that published N (a replay the dedupe rule rightly drops) but
    never one that published more. Raises :class:`WriterRegressionError`."""
    held = {
        where: progress.batches[writer_id]
        for where, progress in (("the channel", on_channel), ("the tables", in_tables))
        if writer_id in progress.batches
    }
    if not held:
        return
    highest = max(held.values())
    if checkpoint_batch is not None and checkpoint_batch >= highest:
        return
    source = " and ".join(f"{where} up to {n}" for where, n in held.items())
    known = "no batch" if checkpoint_batch is None else f"batches up to {checkpoint_batch}"
    raise WriterRegressionError(
        f"writer '{writer_id}' already published batches ({source}), but the checkpoint "
        f"{checkpoint} knows {known}: Spark would number its next batches at or below "
        f"{highest} again and they would be dropped as replays (lost). Fix: restore this "
        "writer's checkpoint, or start with another writer id (leave writer_id unset to "
        "derive one from the checkpoint) and "
        'source.starting_offsets = "table" to resume from what was published'
    )


def _raise(into: dict[K, int], key: K, value: int) -> None:
    """Keep the highest value per key."""
    old = into.get(key)
    if old is None or value > old:
        into[key] = value
