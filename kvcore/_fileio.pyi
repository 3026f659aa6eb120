# Type stub of the C++ extension kvcore._fileio (csrc/_fileio_module.cc).
from collections.abc import Sequence

# buffers (bytes, numpy arrays): anything with the buffer protocol
Buffer = object

HAVE_DIGEST: int
DIGEST_KERNEL: str
OK: int
MISSING: int
OTHER: int
ERRNO: int
DIRECT_REFUSED: int
DEADLINE: int
SKIPPED: int
MISMATCH: int
BATCH_READ: int
BATCH_WRITE: int

class Batch:
    def run(self) -> None: ...
    def results(self) -> tuple[bytes, bytes, int, int]: ...

def batch(
    kind: int,
    paths: Sequence[str],
    temps: Sequence[str] | None,
    heads: bytes,
    head_offsets: Buffer,
    head_lens: Buffer,
    prefixes: Sequence[bytes],
    iov: Buffer,
    iov_starts: Buffer,
    group_starts: Buffer | None,
    deadline: float,
    digest_offset: int,
    mask: bytes | None,
    direct: bool,
    sync: bool,
    /,
) -> Batch: ...
def read_file(
    path: str,
    head: bytearray | memoryview,
    pieces: Sequence[memoryview],
    direct: bool,
    prefix: bytes | None,
    /,
) -> tuple[int, int, bool, bytes | None]: ...
def write_file(
    temp: str,
    path: str,
    head: bytearray | memoryview,
    digest_offset: int,
    prefix: bytes | None,
    pieces: Sequence[memoryview | bytes],
    sync: bool,
    /,
) -> int: ...
