"""Pure logic of the icefloe sink: options, writer identity, merging task messages."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from icefloe.config import PipelineConfig, config_from_dict
from icefloe.errors import ConfigError, TableMismatchError
from icefloe.events import DataFileMeta, SourcePosition
from icefloe_spark.kafka.planning import RANGE_ARROW_SCHEMA
from icefloe_spark.sink.datasource import (
    OPT_SOURCE,
    IcefloeCommitMessage,
    IcefloeStreamWriter,
    SinkOptions,
    derive_writer_id,
    merge_messages,
    sink_options,
)
from icefloe_spark.sink.publish import RemotePublisher
from icefloe_spark.sink.task import TaskOutput


def config(**coordination: Any) -> PipelineConfig:
    return config_from_dict(
        {
            "name": "orders",
            "source": {"topics": ["orders"]},
            "tables": [{"name": "db.orders"}, {"name": "db.audit"}],
            "catalog": {"properties": {"uri": "sqlite:///x.db"}},
            "coordination": {"backend": "postgres", "postgres": {"dsn": "host=db password=hush"}}
            | coordination,
        }
    )


def meta(path: str, rows: int = 10) -> DataFileMeta:
    return DataFileMeta(path=path, record_count=rows, file_size_in_bytes=100)


def message(
    partition: int, files: dict[str, list[str]], positions: list[SourcePosition], uuid: str = "u1"
) -> IcefloeCommitMessage:
    out = TaskOutput(
        files={t: tuple(meta(p) for p in ps) for t, ps in files.items()},
        table_uuids={t: uuid for t in files},
        positions=tuple(positions),
        records=10 * sum(len(ps) for ps in files.values()),
    )
    return IcefloeCommitMessage(partition, 0, out)


def test_writer_id_is_stable_per_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = derive_writer_id("orders", str(tmp_path / "ckpt"))
    assert a == derive_writer_id("orders", str(tmp_path / "ckpt") + "/")
    monkeypatch.chdir(tmp_path)
    assert a == derive_writer_id("orders", "ckpt")  # relative paths resolve like Spark's
    assert a != derive_writer_id("orders", str(tmp_path / "other"))
    assert a != derive_writer_id("billing", str(tmp_path / "ckpt"))
    uri = (tmp_path / "ckpt").as_uri()
    assert derive_writer_id("orders", uri) == derive_writer_id("orders", uri + "/")
    assert a.startswith("orders-spark-")


@pytest.mark.parametrize("location", ["nofs://somewhere/ckpt", "s4://bucket/ckpt"])
def test_a_checkpoint_no_file_system_serves_is_a_config_error(location: str) -> None:
    """Not pyarrow's ArrowInvalid from deep inside the driver's start: the key and a fix."""
    with pytest.raises(ConfigError) as refused:
        derive_writer_id("orders", location)
    assert refused.value.key == "spark.checkpoint_location"
    assert location in str(refused.value)


def test_a_fresh_checkpoint_at_the_same_place_gets_a_new_writer_id(tmp_path: Path) -> None:
    """Spark restarts batch ids at 0 in a fresh checkpoint; the old id's watermark would make
    the coordinator drop those batches, so the id must change with the checkpoint."""
    ckpt = tmp_path / "ckpt"
    first = derive_writer_id("orders", str(ckpt))
    assert derive_writer_id("orders", str(ckpt)) == first  # a restart keeps it
    shutil.rmtree(ckpt)
    second = derive_writer_id("orders", str(ckpt))
    assert second != first
    assert second.rsplit("-", 1)[0] == first.rsplit("-", 1)[0]  # same pipeline and location


def test_options_round_trip_and_leave_backend_secrets_out() -> None:
    cfg = config()
    opts = sink_options(cfg, "w-1", "/tmp/x/publish.sock", "s3cr3t")
    assert "hush" not in opts["config"]  # the commit worker talks to the driver, not the backend
    parsed = SinkOptions.parse({k.upper() if k == "config" else k: v for k, v in opts.items()})
    assert parsed.writer_id == "w-1"
    assert parsed.config.tables == cfg.tables
    assert parsed.config.catalog == cfg.catalog
    assert isinstance(parsed.publisher(), RemotePublisher)
    assert "s3cr3t" not in repr(parsed)
    assert "sqlite" not in repr(parsed)


def test_options_without_a_publisher_keep_the_backend_section() -> None:
    opts = sink_options(config(), "w-1")
    assert json.loads(opts["config"])["coordination"]["postgres"]["dsn"] == "host=db password=hush"
    assert "publisher.address" not in opts


def test_writer_id_derived_from_the_checkpoint_option(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt" / "orders")
    opts = {"config": config().model_dump_json(), "checkpointLocation": ckpt}
    assert SinkOptions.parse(opts).writer_id == derive_writer_id("orders", ckpt)


def test_options_name_what_is_missing() -> None:
    with pytest.raises(ConfigError, match="config"):
        SinkOptions.parse({})
    with pytest.raises(ConfigError, match="checkpoint"):
        SinkOptions.parse({"config": config().model_dump_json()})
    with pytest.raises(ConfigError, match=r"publisher\.secret"):
        SinkOptions.parse(
            {"config": config().model_dump_json(), "writer_id": "w", "publisher.address": "/x"}
        )
    with pytest.raises(ConfigError, match="tables"):
        SinkOptions.parse({"config": json.dumps({"name": "x", "source": {"topics": ["t"]}})})


def test_merge_takes_every_file_and_the_furthest_position_per_partition() -> None:
    msgs = [
        message(0, {"db.orders": ["a", "b"]}, [SourcePosition("orders", 0, 11, 500)]),
        message(1, {"db.orders": ["c"], "db.audit": ["d"]}, [SourcePosition("orders", 1, 7, 900)]),
        # a repartitioned input may spread one source partition over several tasks
        message(
            2, {}, [SourcePosition("orders", 0, 15, 400), SourcePosition("orders", 2, 3, None)]
        ),
    ]
    req = merge_messages(msgs, 7)
    assert req.batch_seq == 7
    assert {t: [m.path for m in ms] for t, ms in req.files.items()} == {
        "db.orders": ["a", "b", "c"],
        "db.audit": ["d"],
    }
    assert req.positions == (
        SourcePosition("orders", 0, 15, 500),
        SourcePosition("orders", 1, 7, 900),
        SourcePosition("orders", 2, 3, None),
    )
    assert req.table_uuids == {"db.orders": "u1", "db.audit": "u1"}
    assert req.records == 40
    assert req.file_count == 4


def test_merge_refuses_what_cannot_be_published_safely() -> None:
    with pytest.raises(TypeError):
        merge_messages([message(0, {}, []), None], 1)
    with pytest.raises(ValueError, match="twice"):
        merge_messages(
            [message(0, {"db.orders": ["a"]}, []), message(1, {"db.orders": ["a"]}, [])], 1
        )
    with pytest.raises(TableMismatchError):
        merge_messages(
            [
                message(0, {"db.orders": ["a"]}, [], uuid="u1"),
                message(1, {"db.orders": ["b"]}, [], uuid="u2"),
            ],
            1,
        )


def test_empty_batch_still_publishes_its_positions() -> None:
    req = merge_messages([message(0, {}, [SourcePosition("orders", 0, 3, None)])], 2)
    assert req.files == {}
    assert req.positions == (SourcePosition("orders", 0, 3, None),)


def test_commit_message_survives_pickling() -> None:
    msg = message(3, {"db.orders": ["a"]}, [SourcePosition("orders", 0, 1, 2)])
    assert pickle.loads(pickle.dumps(msg)) == msg


def test_merge_adds_up_the_tasks_bad_record_counts() -> None:
    """Counts travel from the tasks to the driver inside the commit messages."""
    outs = [TaskOutput(records=10, skipped=2), TaskOutput(records=5, skipped=1, dead_lettered=4)]
    req = merge_messages([IcefloeCommitMessage(i, 0, o) for i, o in enumerate(outs)], 3)
    assert (req.records, req.skipped, req.dead_lettered) == (15, 3, 4)


def test_range_rows_need_the_source_options_and_they_round_trip() -> None:
    """On the ranges data path the sink's tasks read Kafka themselves: without the source's
    options (what icefloe run passes) a range row is refused by name, never ignored."""
    opts = sink_options(config(), "w-1")
    ranges = pa.RecordBatch.from_pylist(
        [{"topic": "orders", "partition": 0, "start": 0, "end": 10}], schema=RANGE_ARROW_SCHEMA
    )
    with pytest.raises(ConfigError, match=r"source\.options"):
        IcefloeStreamWriter(SinkOptions.parse(opts)).write(iter([ranges]))
    reader = {"kafka.bootstrap.servers": "k:9092", "subscribe": "orders", "pollTimeoutMs": "5000"}
    parsed = SinkOptions.parse({**opts, OPT_SOURCE: json.dumps(reader)})
    assert parsed.source is not None
    assert (parsed.source.bootstrap_servers, parsed.source.topics) == ("k:9092", ("orders",))
    assert parsed.source.poll_timeout_s == 5.0
