"""Ctrl-C that Python loses. A KeyboardInterrupt raised while the interpreter runs a weakref callback or a `__del__`
(importing the CLI's modules runs many) is printed as "Exception ignored in ..." and dropped, and the command went on:
a `tfsn launch` interrupted while it loaded submitted its job and ran it. The handler here also remembers the Ctrl-C,
and a command checks before it changes anything."""
from __future__ import annotations

import signal
import threading
from types import FrameType

_interrupted = threading.Event()


def _on_interrupt(signum: int, frame: FrameType | None) -> None:
    _interrupted.set()
    raise KeyboardInterrupt


def remember_interrupts() -> None:
    """Handle SIGINT as Python does, remembering it; in the main thread, and only over Python's own handler (a SIGINT
    ignored by whoever started tfsn stays ignored)."""
    _interrupted.clear()
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, _on_interrupt)


def raise_if_interrupted() -> None:
    """KeyboardInterrupt if a Ctrl-C came since `remember_interrupts`, even one whose exception Python dropped."""
    if _interrupted.is_set():
        raise KeyboardInterrupt
