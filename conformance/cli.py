"""`polyengine conformance` (filled in by the conformance suite)."""


def add_command(sub) -> None:
    return None
