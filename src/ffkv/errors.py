"""User-caused errors: the CLI turns them into one line and exit code 2."""


class FfkvError(Exception):
    """A problem the user can fix (bad path, bad flag, wrong run). Never a bug."""
