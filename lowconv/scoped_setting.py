"""A process-wide torch setting held at one value while any `with` block of it runs.

torch's switches (allow_fp16_accumulation, the MHA fast path) are global: two threads that each
set and restore one would leave it wrong when their blocks overlap. A ScopedSetting counts its
blocks under a lock: the first block in (of any thread) saves the value and sets its own, the last
one out puts the saved value back, also when a block raises. Other threads see the value while a
block runs.
"""
import contextlib
import threading
from typing import Callable


class ScopedSetting:
    def __init__(self, read: Callable[[], object], write: Callable[[object], None], value):
        self.read, self.write, self.value = read, write, value
        self.lock = threading.Lock()
        self.blocks = 0
        self.before = None

    @contextlib.contextmanager
    def held(self):
        with self.lock:
            if self.blocks == 0:
                self.before = self.read()
                self.write(self.value)
            self.blocks += 1
        try:
            yield
        finally:
            with self.lock:
                self.blocks -= 1
                if self.blocks == 0:
                    self.write(self.before)
