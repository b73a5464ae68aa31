"""The conformance suite: one set of tests every polyengine backend must pass."""
