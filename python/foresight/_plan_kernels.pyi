"""Type stubs for ``foresight._plan_kernels`` (Cython, built from ``engine/_plan_kernels.pyx``)."""
import numpy as np
import numpy.typing as npt

def blend(weights: npt.NDArray[np.float64], choice: npt.NDArray[np.uint16], counts: npt.NDArray[np.int64]) -> None: ...
def bucket_scatter(keys: npt.NDArray[np.uint16], cursor: npt.NDArray[np.int64],
                   out: npt.NDArray[np.int32] | npt.NDArray[np.int64]) -> None: ...
def block_expand(block_order: npt.NDArray[np.int64], src: npt.NDArray[np.int32] | npt.NDArray[np.int64],
                 out: npt.NDArray[np.int32] | npt.NDArray[np.int64], block_size: int) -> None: ...
def fill_samples(choice: npt.NDArray[np.uint16], order: npt.NDArray[np.int32] | npt.NDArray[np.int64],
                 order_base: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64], sizes_base: npt.NDArray[np.int64],
                 piece_dataset: npt.NDArray[np.uint16], piece_sample: npt.NDArray[np.int64],
                 piece_length: npt.NDArray[np.int64]) -> None: ...
def pack_tokens(choice: npt.NDArray[np.uint16], order: npt.NDArray[np.int32] | npt.NDArray[np.int64],
                order_base: npt.NDArray[np.int64], counts: npt.NDArray[np.int64], counts_base: npt.NDArray[np.int64],
                seq_len: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint16], npt.NDArray[np.int64],
                                       npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
