"""Reading Kafka into Spark: the ``icefloe-kafka`` streaming source and Kafka helpers."""
