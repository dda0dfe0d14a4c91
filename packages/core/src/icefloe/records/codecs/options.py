"""Codec options made self-contained: files they name read in, so tasks anywhere decode alike."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from icefloe.config import PipelineConfig


def self_contained(config: PipelineConfig) -> PipelineConfig:
    """``config`` with the files its codec options name read into the options themselves.

    Records are decoded where the tasks run: on a cluster, in other processes on other
    machines with other working directories. A config that names no local file decodes the
    same everywhere. Only the built-in ``avro`` codec's ``schema_file`` is such a file.
    """
    source = config.source
    if source.format != "avro" or "schema_file" not in source.format_options:
        return config
    from icefloe.records.codecs.avro import inline_schema_file

    base = Path(config.config_dir) if config.config_dir else None
    options = inline_schema_file(source.format_options, base)
    return config.model_copy(
        update={"source": source.model_copy(update={"format_options": options})}
    )
