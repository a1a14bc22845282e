"""The one exception type that carries a user-facing message (bad model path, bad request values, ...).

Front ends print its message as one line (CLI) or map it to a status (services); anything else is a bug.
"""


class TreeserveError(Exception):
    """A problem the user can fix; str(error) is the whole explanation."""
