# Type stub of the C++ extension kvcore._fileio (csrc/_fileio_module.cc).
from collections.abc import Sequence

HAVE_DIGEST: int
OK: int
MISSING: int
OTHER: int
ERRNO: int
DIRECT_REFUSED: int

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
