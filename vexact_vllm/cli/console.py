"""What the CLI shows on the terminal: where vLLM's own output goes, and the help's defaults.

vLLM, its engine processes (which inherit the file descriptors), torch and Triton write warnings and
progress bars to stdout and stderr. stdout carries only the report (a table, or JSON a machine can
parse), so they go elsewhere: to stderr (`diagnostics_to_stderr`), or to a log file that is shown
only when something went wrong (`captured_output`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile


@contextlib.contextmanager
def diagnostics_to_stderr():
    """Send everything written to stdout (file descriptor 1, this process and its children) to stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def captured_output(prefix: str):
    """Send stdout and stderr (file descriptors 1 and 2, this process and its children) to a new log
    file; yields (console, log path), `console` a text stream on the real stderr for progress. The
    caller decides whether to keep the log (see `keep_log`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(saved_err), "w", buffering=1)
    fd, log = tempfile.mkstemp(prefix=prefix, suffix=".log")
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield console, log
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        console.close()


@contextlib.contextmanager
def engine_output(verbose: bool, prefix: str):
    """`captured_output`, or with `verbose` everything on stderr (no log); yields (console, log)."""
    if verbose:
        with diagnostics_to_stderr():
            yield sys.stderr, None
    else:
        with captured_output(prefix) as (console, log):
            yield console, log


def keep_log(log: str | None, keep: bool, what: str) -> None:
    """Delete the captured log, or name it on stderr when it may explain a failure."""
    if log is None:
        return
    if keep:
        print(f"{what}: {log}", file=sys.stderr, flush=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(log)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default ("(default: 24)", "(default: off)" for a flag), unless
    the help already says it; an option without a default says in its help what happens when unset."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or "default" in text or default is None or default is argparse.SUPPRESS:
            return text
        if action.nargs == 0 and isinstance(default, bool):  # a flag (store_true)
            shown = "off" if default is False else "on"
        elif isinstance(default, list | tuple):
            shown = ",".join(map(str, default))
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"
