"""The one exception type the CLI turns into a single error line and exit code 2."""


class InputError(Exception):
    """Bad user input: say what was found and what was expected."""


class ServingRefused(Exception):
    """The serving engine's own code refuses the deployment before any forward (a served
    directory in a format it cannot read). That is a verdict about the deployment, not bad
    input to difftest: the report names it, with what the user can do."""

    def __init__(self, engine: str, served_dir: str, reason: str, cause: str):
        super().__init__(f"{engine} refuses {served_dir}: {reason}")
        self.engine, self.served_dir, self.reason, self.cause = engine, served_dir, reason, cause
