"""User-facing errors: the CLI prints their message as one line and exits with code 2."""


class UserError(Exception):
    """Something the user can fix (a path, a setting, an input file); never a bug."""
