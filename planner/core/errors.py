"""The project's error class: bad input becomes one line that names the problem and the fix."""


class StratagemError(Exception):
    """A user-facing error. The CLI prints ``error: <message>`` on one line and exits with status 2.

    Write the message as: what is wrong (with the value), what was expected, and the fix, e.g.
    ``plan needs 8 ranks but the launch has 4: start with --nproc-per-node 8 or re-plan for 4``.
    """

    exit_status = 2


class SettingError(StratagemError):
    """A library setting with a bad value. The message names the *setting* (``time_limit_s``), since the
    library has no flags; the CLI shows the flag that sets it (``--time-limit-s``) through its own table.

    >>> str(SettingError("time_limit_s", -1, "must be positive seconds, e.g. 30"))
    'time_limit_s -1 must be positive seconds, e.g. 30'
    >>> SettingError("time_limit_s", -1, "must be positive seconds, e.g. 30").render({"time_limit_s": "--time-limit-s"})
    '--time-limit-s -1 must be positive seconds, e.g. 30'
    """

    def __init__(self, setting: str, value: object, problem: str) -> None:
        self.setting, self.value, self.problem = setting, value, problem
        super().__init__(f"{setting} {value} {problem}")

    def render(self, flags: dict[str, str]) -> str:
        return f"{flags.get(self.setting, self.setting)} {self.value} {self.problem}"
