"""The live byte-progress line: on a terminal it says bytes, rate and time left; headless or
off a terminal it writes nothing."""

import io
import os
import pty
import subprocess
import sys

from conftest import REPO
from runtime.base.progress import ByteProgress


def test_line_has_bytes_rate_and_time_left():
    p = ByteProgress("staging s3://b/w", 4_000_000_000)
    line = p.line(1_000_000_000, p.t0 + 10)
    assert line == "staging s3://b/w: 1.0 GB of 4.0 GB, 100.0 MB/s, 30s left"


def test_nothing_off_a_terminal():
    out = io.StringIO()
    p = ByteProgress("x", 1 << 30, stream=out)
    p.update(1 << 29)
    p.close()
    assert out.getvalue() == ""


def test_on_a_terminal_and_not_when_headless(tmp_path):
    code = ("import time; from runtime.base.progress import ByteProgress, EVERY_S\n"
            "p = ByteProgress('packing', 1 << 30)\n"
            "for i in range(3):\n    p.update((i + 1) << 28); time.sleep(EVERY_S * 1.5)\n"
            "p.close()\n")
    for headless, want in (("0", True), ("1", False)):
        main, tty = pty.openpty()
        env = {**os.environ, "PYTHONPATH": str(REPO), "SPILLPACK_HEADLESS": headless}
        subprocess.run([sys.executable, "-c", code], stdout=tty, stderr=tty, env=env, timeout=60, check=True)
        os.close(tty)
        text = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:
                break
            if not chunk:
                break
            text += chunk
        os.close(main)
        assert (b"packing: 268.4 MB of 1.1 GB" in text) is want, text
