"""The rules of the backend conformance suite, one module per topic, each a mixin of tests on
a shared base (``support``); :mod:`icefloe.testing.conformance` composes them into
``BackendConformance``, the class backends subclass."""
