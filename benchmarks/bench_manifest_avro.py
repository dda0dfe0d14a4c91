"""A commit's manifest written by pyiceberg's Avro writer vs. fastavro: CPU per manifest.

    python benchmarks/bench_manifest_avro.py --files 2 --rounds 300

The committer writes one manifest (and one manifest list) per table per cycle, through
pyiceberg's ``write_manifest``. This measures that call for ``--files`` data-file entries, and
fastavro writing the same records (read back from pyiceberg's manifest, same Avro schema parsed
once, same codec) to the same kind of local file, so the figure is what switching writers could
save at best (building those records from pyiceberg's DataFile objects not counted).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import fastavro
from pyiceberg.manifest import ManifestEntry, ManifestEntryStatus, write_manifest

from icefloe.records.datafiles import DataFileBuilder
from icefloe.testing.fixtures import create_rows_table, make_sqlite_catalog, write_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=2, help="entries per manifest")
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-avro-") as work:
        catalog = make_sqlite_catalog(Path(work) / "iceberg")
        table = create_rows_table(catalog, "bench.events")
        metas = [write_rows(table, [i], "w", i)[0] for i in range(args.files)]
        build = DataFileBuilder(table.metadata).build
        files = [build(m) for m in metas]
        out = Path(work) / "manifests"
        out.mkdir()

        def pyiceberg_manifest() -> Path:
            path = out / f"{uuid.uuid4()}-m0.avro"
            with write_manifest(
                format_version=table.metadata.format_version,
                spec=table.metadata.spec(),
                schema=table.metadata.schema(),
                output_file=table.io.new_output(f"file://{path}"),
                snapshot_id=1,
                avro_compression="deflate",
            ) as writer:
                for f in files:
                    writer.add(
                        ManifestEntry.from_args(
                            status=ManifestEntryStatus.ADDED, snapshot_id=1, data_file=f
                        )
                    )
            return path

        with pyiceberg_manifest().open("rb") as stream:
            reader = fastavro.reader(stream)
            schema = fastavro.parse_schema(reader.writer_schema)
            metadata = {k: v for k, v in reader.metadata.items() if not k.startswith("avro.")}
            records = [r for r in reader if isinstance(r, dict)]  # a manifest's are records

        def fastavro_manifest() -> Path:
            path = out / f"{uuid.uuid4()}-m0.avro"
            with path.open("wb") as stream:
                fastavro.writer(stream, schema, records, codec="deflate", metadata=metadata)
            return path

        def cpu_ms(write: Any) -> float:
            times = []
            for _ in range(args.rounds):
                started = time.process_time()
                write()
                times.append((time.process_time() - started) * 1000)
            return statistics.median(times)

        cpu_ms(pyiceberg_manifest), cpu_ms(fastavro_manifest)  # warm up
        ours, theirs = cpu_ms(pyiceberg_manifest), cpu_ms(fastavro_manifest)
    print(
        f"{args.files} entries per manifest, median of {args.rounds}: pyiceberg write_manifest "
        f"{ours:.2f} ms CPU, fastavro {theirs:.2f} ms CPU (x{ours / theirs:.1f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
