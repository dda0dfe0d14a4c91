"""PySpark data plane for icefloe: Kafka source, icefloe sink, CLI and demo."""
