"""Record codecs: raw source values to Arrow columns of the target schema.

The built-in ``json`` and ``avro`` codecs register through the ``icefloe`` entry point
``icefloe.records.codecs.plugin`` exactly as a third party's codec would.
"""
