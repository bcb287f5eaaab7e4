"""Type stubs for ``foresight._compact_kernels`` (Cython, built from ``engine/_compact_kernels.pyx``)."""
import numpy as np
import numpy.typing as npt

SIZE_U16: int
SIZE_I32: int
SIZE_U32: int
SIZE_I64: int

def permute_many(x: npt.NDArray[np.uint64], m: int, key: int) -> npt.NDArray[np.uint64]: ...
def block_prefix(totals: npt.NDArray[np.int64], key: int, out: npt.NDArray[np.int64]) -> None: ...
def add_rows(base: int, code: int, count: int, totals: npt.NDArray[np.int64]) -> int: ...
def min_positive_step(a: npt.NDArray[np.int64]) -> int: ...
def first_decrease(a: npt.NDArray[np.int64]) -> int: ...
def pack_range(start: int, stop: int, seq_len: int, pattern: npt.NDArray[np.uint16],
               pattern_rank: npt.NDArray[np.int64], period_counts: npt.NDArray[np.int64],
               size_ptrs: npt.NDArray[np.uint64], size_codes: npt.NDArray[np.int32], n_docs: npt.NDArray[np.int64],
               n_blocks: npt.NDArray[np.int64], totals: npt.NDArray[np.int64], epochs: npt.NDArray[np.int64],
               prefix_base: npt.NDArray[np.int64], key_base: npt.NDArray[np.int64], prefix: npt.NDArray[np.int64],
               block_keys: npt.NDArray[np.uint64], inner_keys: npt.NDArray[np.uint64],
               item_ptr: npt.NDArray[np.int64], p_dataset: npt.NDArray[np.uint16], p_sample: npt.NDArray[np.int64],
               p_offset: npt.NDArray[np.int64], p_length: npt.NDArray[np.int64], info: npt.NDArray[np.int64]) -> int: ...
