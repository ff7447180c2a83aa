"""Child processes for the multi-peer tests (monitor, trainers): output collected, always cleaned up."""

import os
import signal
import socket
import subprocess
import threading
import time


class Proc:
    """A child process in its own session whose stdout lines are collected by a thread (stderr goes to a file, or
    with the stdout lines).

    Args:
        args: the command line.
        log_path: file for its stderr.
        env: its environment.
        cwd: its working directory (default: the log file's directory).
        stdin: give it a pipe as stdin (``proc.stdin``; closing it is how some workers are told to leave).
        stderr_to_stdout: collect its stderr with its stdout lines instead of in ``log_path``.
    """

    def __init__(self, args, log_path, env, cwd=None, stdin=False, stderr_to_stdout=False):
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT if stderr_to_stdout else self.log,
                                     stdin=subprocess.PIPE if stdin else None, env=env, text=True,
                                     cwd=cwd or os.path.dirname(log_path), start_new_session=True)
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, prefix, timeout):
        """The first stdout line starting with ``prefix``; fails if the process exits or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(prefix):
                    return line
            if self.proc.poll() is not None:
                raise AssertionError(f"process exited ({self.proc.returncode}) before printing {prefix!r}:\n"
                                     + "\n".join(self.lines[-60:]))
            time.sleep(0.1)
        raise AssertionError(f"no {prefix!r} line within {timeout}s:\n" + "\n".join(self.lines[-60:]))

    def stop(self, timeout=20):
        """SIGTERM the process group, SIGKILL it after ``timeout`` seconds."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, timeout, what):
    """Poll ``condition()`` until it returns something truthy (returned) or ``timeout`` seconds pass (fails)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
