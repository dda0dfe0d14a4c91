"""Spark's processes: the driver JVM, its start-up caches and logs, workers and signals."""
