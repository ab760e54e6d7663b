"""Native: the one owner of each handle of libckpt_c.so (optimizer, store, checkpointer, pending
save), so that no Python object's lifetime frees one the library still uses.

Why an object of its own: torch code copies optimizers' attributes freely. Lightning wraps an
optimizer in an object whose __dict__ is a copy of the optimizer's and whose class derives from
the optimizer's class; when that wrapper was collected, a __del__ on the optimizer's class
closed the handle the optimizer still used (a segmentation fault at the next step). A copied
__dict__ copies the reference to the Native, not the handle: the handle is freed when the last
reference goes, or by close().

Order: a child (a checkpointer of an optimizer and a store, a pending save of a checkpointer)
must be freed before its parents, and close() on a parent closes its children first (an
optimizer closes its checkpointers: their async save in flight is abandoned, as the C ABI
requires). Reference counts alone cannot promise that order: objects that become garbage
together in a cycle (a checkpointer and its pending save refer to each other) have their
finalizers called in any order, after their weak references are cleared. So parents and open
children hold each other strongly, and whichever finalizer runs first, a parent's closes its
children before itself; a child that closes leaves its parents' sets. At interpreter exit every Native still open is closed while ctypes and the library
are still there (atexit), children first, except a collective one (a checkpointer over
torch.distributed, whose abandon is a vote of every rank that other ranks may never join) and
what it uses: those are left to the operating system, and the save in flight to the next
recovery, which removes its staging directory.

A Native refuses to be copied or pickled: two owners of one handle would free it twice.
"""
import atexit
import weakref

from ._lib import CkptError, Code

_OPEN = weakref.WeakSet()


class Native:
    """Owns one native handle: `destroy(handle)` frees it, exactly once."""

    def __init__(self, handle, destroy, what, parents=(), keep=(), collective=False,
                 then_close=()):
        self._handle = handle
        self._closing = False
        # Freeing it is a collective of the job's ranks (see the module's comment).
        self.collective = collective
        # The ctypes function itself, so that freeing works during the interpreter's exit too.
        self._destroy = destroy
        self.what = what
        self._parents = tuple(parents)  # Strong: they outlive this handle.
        self._keep = keep  # What the native side calls back into (ctypes callbacks).
        self._children = set()  # Open children (strong: see the module's comment).
        self._then_close = tuple(then_close)  # Closed after this one (a checkpointer's store).
        for parent in self._parents:
            parent._children.add(self)
        _OPEN.add(self)

    @property
    def closed(self):
        return self._handle is None

    @property
    def handle(self):
        """The handle; CkptError (FAILED_PRECONDITION) once closed."""
        if self._handle is None:
            raise CkptError(Code.FAILED_PRECONDITION, f"the {self.what} is closed")
        return self._handle

    def close(self):
        """Closes the children, then frees the handle. Harmless when already closed."""
        if self._closing:
            return
        self._closing = True
        for child in list(self._children):
            child.close()
        for parent in self._parents:
            parent._children.discard(self)
        # Taken before it is freed: an interrupt in between leaks it, never frees it twice.
        handle, self._handle = self._handle, None
        if handle is not None:
            self._destroy(handle)
        for other in self._then_close:
            other.close()

    def __del__(self):
        if getattr(self, "_handle", None) is not None:
            self.close()

    def __deepcopy__(self, memo):
        raise TypeError(f"a ckpt {self.what} owns native memory and cannot be deep-copied")

    def __copy__(self):
        raise TypeError(f"a ckpt {self.what} owns native memory and cannot be copied")

    def __reduce__(self):
        raise TypeError(f"a ckpt {self.what} owns native memory and cannot be pickled")


def _forget(native):
    """At exit: lets go of a handle without freeing it, and of what it uses (its parents)."""
    native._handle = None
    for parent in native._parents:
        _forget(parent)


@atexit.register
def _close_all_at_exit():
    natives = list(_OPEN)
    for native in natives:
        if native.collective and not native.closed:
            for child in list(native._children):
                _forget(child)
            _forget(native)
    for native in natives:
        native.close()
