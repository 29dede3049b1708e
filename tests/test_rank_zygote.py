"""The ranks ``spawn_ranks`` forks from ``tests/rank_zygote.py`` behave as fresh interpreters would: their own
arguments, environment and streams, exit statuses, exceptions, atexit handlers, and a hash seed per server."""

from __future__ import annotations

import textwrap

from runtime_helpers import spawn_ranks

SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys
    rank = int(os.environ["RANK"])
    atexit.register(lambda: print(f"atexit {rank}"))
    print(f"rank {rank} argv {sys.argv[1:]} name {__name__} hook {os.environ.get('HOOK')} hash {hash('stratagem')}")
    if rank == 1:
        raise ValueError("rank 1 fails")
    if rank == 2:
        sys.exit(3)
    """
)


def test_forked_ranks_act_as_fresh_interpreters(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    proc = spawn_ranks(3, [str(script), "a b", "--x"], timeout_s=60, env={"HOOK": "on"})
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1  # the first non-zero status, in rank order
    assert "ValueError: rank 1 fails" in proc.stderr
    for rank in range(3):
        assert f"rank {rank} argv ['a b', '--x'] name __main__ hook on" in proc.stdout
        assert f"atexit {rank}" in lines
    hashes = {line.split("hash ")[1] for line in lines if " hash " in line}
    assert len(hashes) >= 2  # forked: ranks 0 and 2 share a server, rank 1 has the other's seed
