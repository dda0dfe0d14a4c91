"""Record codecs: raw source values to Arrow columns of the target schema."""
