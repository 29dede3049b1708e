"""The project's error class: bad input becomes one line that names the problem and the fix."""


class StratagemError(Exception):
    """A user-facing error. The CLI prints ``error: <message>`` on one line and exits with status 2.

    Write the message as: what is wrong (with the value), what was expected, and the fix, e.g.
    ``plan needs 8 ranks but the launch has 4: start with --nproc-per-node 8 or re-plan for 4``.
    """

    exit_status = 2
