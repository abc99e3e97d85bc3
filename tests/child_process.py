"""What the tests that drive child processes through signals share (test_interrupts.py,
test_fused_interrupts.py): starting a child with SIGINT ignored, as `nohup`, `cmd &` in a script
and CI runners do; reading from /proc whether it ignores SIGINT; reading its output as it comes."""

import signal
import threading
from pathlib import Path

# starts a command with SIGINT ignored, as `nohup`, `cmd &` in a script and CI runners do
IGNORING = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def ignores_sigint(pid: int) -> bool:
    """Whether process `pid` ignores SIGINT (SIG_IGN), from /proc; False where /proc is not."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return bool(int(fields.get("SigIgn", "0"), 16) >> (signal.SIGINT - 1) & 1)


def read_output(proc, lines, out, err) -> None:
    """Read `proc`'s stdout and stderr in daemon threads: each stdout line, stripped, onto the
    queue `lines` (None once the child has exited), and the tails of both into the deques `out`
    and `err` (for failure messages)."""
    def read(stream, tail):
        for line in stream:
            tail.append(line.rstrip())
            if stream is proc.stdout:
                lines.put(line.strip())
        if stream is proc.stdout:
            lines.put(None)  # end of output: the child exited

    for stream, tail in ((proc.stdout, out), (proc.stderr, err)):
        threading.Thread(target=read, args=(stream, tail), daemon=True).start()
