"""The one exception type the CLI turns into a single error line and exit code 2."""


class InputError(Exception):
    """Bad user input: say what was found and what was expected."""
