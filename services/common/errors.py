"""The exceptions that carry a user-facing message: TreeserveError (bad model path, bad request values, ...), which
front ends print as one line (CLI) or map to a status (services), and RequestFailed, a service's answer to one
request with its gRPC status. Anything else is a bug.
"""


class TreeserveError(Exception):
    """A problem the user can fix; str(error) is the whole explanation."""


class RequestFailed(Exception):
    """A request refused or failed, with the gRPC status (a grpc.StatusCode) that says why; not a TreeserveError,
    so that code turning those into INVALID_ARGUMENT lets it through with its own status."""

    def __init__(self, code, message: str):
        super().__init__(message)
        self.code, self.message = code, message
