"""Kafka control-topic coordination backend for icefloe (the default)."""
