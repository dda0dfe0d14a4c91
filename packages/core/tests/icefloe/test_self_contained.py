"""A pipeline config shipped to executors names no local file: the Avro ``schema_file`` is read
where the pipeline starts (relative to the pipeline file) and travels as its text."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import fastavro
import pyarrow as pa
import pytest

from icefloe.config import load_config
from icefloe.errors import ConfigError
from icefloe.hookspecs import DecodeContext
from icefloe.records.codecs.avro import AvroCodec
from icefloe.records.codecs.options import self_contained

SCHEMA = {
    "type": "record",
    "name": "Row",
    "fields": [{"name": "id", "type": "long"}, {"name": "name", "type": ["null", "string"]}],
}


def _pipeline(directory: Path, options: dict[str, Any]) -> Path:
    """A pipeline file in ``directory`` with the given Avro format options."""
    lines = ['name = "p"', "[source]", 'topics = ["t"]', 'format = "avro"']
    lines.append("[source.format_options]")
    lines += [f"{key} = {json.dumps(value)}" for key, value in options.items()]
    lines += ["[[tables]]", 'name = "db.rows"']
    path = directory / "pipeline.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _encoded(record: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(SCHEMA), record)
    return out.getvalue()


def test_relative_schema_file_is_read_beside_the_pipeline_and_shipped_as_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "row.avsc").write_text(json.dumps(SCHEMA))
    config = load_config(_pipeline(conf_dir, {"schema_file": "row.avsc", "wire_format": "raw"}))
    elsewhere = tmp_path / "worker"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # an executor works in its worker's directory

    shipped = self_contained(config)

    options = shipped.source.format_options
    assert "schema_file" not in options
    assert json.loads(options["schema"]) == SCHEMA
    assert options["wire_format"] == "raw"
    # the executor's side: no file left anywhere, the config's JSON is all it gets
    (conf_dir / "row.avsc").unlink()
    received = type(shipped).model_validate_json(shipped.model_dump_json())
    codec = AvroCodec(dict(received.source.format_options))
    values = pa.array([_encoded({"id": 7, "name": "x"})], pa.binary())
    context = DecodeContext(
        topics=pa.array(["t"]), partitions=pa.array([0], pa.int32()), offsets=pa.array([0])
    )
    hint = pa.schema([pa.field("id", pa.int64()), pa.field("name", pa.string())])
    assert codec.decode(values, hint, context).to_pylist() == [{"id": 7, "name": "x"}]
    assert os.getcwd() == str(elsewhere)


def test_absolute_schema_file_and_other_formats(tmp_path: Path) -> None:
    schema_path = tmp_path / "abs.avsc"
    schema_path.write_text(json.dumps(SCHEMA))
    config = load_config(_pipeline(tmp_path, {"schema_file": str(schema_path)}))
    assert json.loads(self_contained(config).source.format_options["schema"]) == SCHEMA
    inline = load_config(_pipeline(tmp_path, {"schema": json.dumps(SCHEMA)}))
    assert self_contained(inline) is inline  # nothing to read: the same object


def test_unreadable_schema_file_names_the_key(tmp_path: Path) -> None:
    config = load_config(_pipeline(tmp_path, {"schema_file": "missing.avsc"}))
    with pytest.raises(ConfigError, match="schema_file") as info:
        self_contained(config)
    assert str(tmp_path / "missing.avsc") in str(info.value)
