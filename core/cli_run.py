"""CLI commands that run models (generate, chat)."""


def add_commands(sub) -> None:
    return None
