"""User-facing errors: the CLI prints their message on one line and exits with status 2."""


class HeadwayError(Exception):
    """Something the user can fix; the message says what and how."""
