"""The ``stratagem`` command. The CLI is the one composition root: it may import ``runtime``."""
