"""Namespace of the built-in backends (``polyengine.backends.<name>``).

Each lives in the repository's ``backends/<name>/`` folder and registers through the
``polyengine.backends`` entry-point group, exactly like a third-party backend.
"""
