"""Run an `outrider` command in the background as a user would, until it prints a line."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def running(
    argv: Sequence[str | Path],
    ready: str,
    timeout_s: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Iterator[list[str]]:
    """Start `argv`, wait until a line of its output contains `ready`, yield the output so far
    (a list that keeps growing), then stop it with SIGINT (Ctrl-C) and wait for it to exit."""
    process = subprocess.Popen(
        [str(a) for a in argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,  # its own process group: nothing it starts outlives the test
    )
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if ready in line:
                seen.set()
        seen.set()  # the process ended: stop waiting

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        seen.wait(timeout_s)
        output = "".join(lines)
        assert process.poll() is None and ready in output, (
            f"{' '.join(map(str, argv))} did not print {ready!r} within {timeout_s:.0f} s "
            f"(exit status {process.poll()}); output:\n{output[-4000:]}"
        )
        yield lines
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        reader.join(10)


def traceback_free(output: str) -> bool:
    return "Traceback (most recent call last)" not in output
