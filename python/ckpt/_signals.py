"""Critical sections that Ctrl-C cannot cut: SIGINT (and SIGTERM) deferred to their end.

A ckpt call is one C call plus Python bookkeeping around it (the parameters and param_groups
following a load, the handle of an async save recorded). The C call cannot be interrupted, but
Python runs a signal's handler between any two bytecodes, so a KeyboardInterrupt could land
after the C call and before the bookkeeping: the optimizer would hold the checkpoint's state
with the old param_groups. Inside `deferred()` the signal is only recorded; at the end of the
section the previous handlers are put back and each recorded signal is raised again, so its
handler (KeyboardInterrupt, by default) runs after the section is complete.

Only signals whose handler is a Python callable are deferred (SIGINT's default handler is one;
SIGTERM's is not unless the program installed one): a C-level, default or ignored disposition is
left as it is. Handlers can be set on the main thread only, so elsewhere `deferred()` does
nothing; there, Python runs no signal handler anyway.
"""
import contextlib
import signal
import threading

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _deliver(signals):
    """Raises each signal in turn (its handler runs in raise_signal); when a handler raises, the
    rest are still delivered (the last exception propagates, the earlier ones as its context)."""
    if signals:
        try:
            signal.raise_signal(signals[0])
        finally:
            _deliver(signals[1:])


def _restore(previous):
    """Puts back every handler in `previous` even if one of them fires meanwhile."""
    if previous:
        (signum, handler), rest = previous[0], previous[1:]
        try:
            signal.signal(signum, handler)
        finally:
            _restore(rest)


@contextlib.contextmanager
def deferred():
    """A critical section: SIGINT and SIGTERM that arrive inside it are delivered at its end,
    after the previous handlers are back. Nests (an inner section delivers to the outer one's
    recorder). On a thread other than the main one, does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen = []

    def record(signum, _frame):
        if signum not in seen:
            seen.append(signum)

    previous = []
    try:
        for signum in _SIGNALS:
            handler = signal.getsignal(signum)
            if callable(handler):
                # Recorded before it is replaced: a signal between the two lines still finds
                # the old handler, and the cleanup below then restores what is already there.
                previous.append((signum, handler))
                signal.signal(signum, record)
    except BaseException:
        _restore(previous)
        _deliver(seen)
        raise
    try:
        yield
    finally:
        # Any signal from here on goes to the previous handler: nothing is lost in between.
        _restore(previous)
        _deliver(seen)
