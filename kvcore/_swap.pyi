# Types of the native extension built from csrc/_swap_module.cc. Array arguments are 1-D
# C-contiguous arrays of 8-byte integers (numpy int64/uint64; any such buffer is accepted);
# addresses are plain ints.
from numpy import ndarray

def swap_all_layers(
    dev_ptrs: ndarray,
    host_ptrs: ndarray,
    dev_nblocks: ndarray,
    block_bytes: int,
    host_nblocks: int,
    dev_ids: ndarray,
    host_ids: ndarray,
    mode: int,
    nthreads: int,
    /,
) -> None: ...
def swap_layout(
    layer_ptrs: ndarray,
    layer_nblocks: ndarray,
    block_bytes: int,
    staging: int,
    staging_nslots: int,
    dev_ids: ndarray,
    slot_ids: ndarray,
    mode: int,
    nthreads: int,
    /,
) -> None: ...
def resolve_threads(requested: int, total_bytes: int, /) -> int: ...
