"""Types of the C extension ``backends.engine.kv.codecs._e8core`` (``_e8core.c``)."""

import numpy as np
import numpy.typing as npt

CODEBOOK_NORM2: int
CODEBOOK_SIZE: int
DESCENT_STEPS: int
LANES: int
RUNS_AVX2: bool
SHRINK: tuple[float, float]

def hadamard(rows: npt.NDArray[np.float32], dim: int, out: npt.NDArray[np.float32]) -> None: ...
def transform(
    rows: npt.NDArray[np.float32],
    columns: npt.NDArray[np.float32],
    heads: int,
    dim: int,
    out: npt.NDArray[np.float32],
) -> None: ...
def nearest_d8(rows: npt.NDArray[np.float64], out: npt.NDArray[np.float64]) -> None: ...
def nearest_e8(rows: npt.NDArray[np.float64], out: npt.NDArray[np.float64]) -> None: ...
def keys(points: npt.NDArray[np.float64], out: npt.NDArray[np.int64]) -> None: ...
def encode(rows: npt.NDArray[np.float64], out: npt.NDArray[np.uint16]) -> None: ...
def encode_scaled(
    rotated: npt.NDArray[np.float32],
    scales: npt.NDArray[np.uint8],
    table: npt.NDArray[np.float32],
    codes: npt.NDArray[np.uint16],
    high: npt.NDArray[np.uint8],
) -> None: ...
def token_scales(
    rotated: npt.NDArray[np.float32],
    tau: float,
    cuts: npt.NDArray[np.float64],
    out: npt.NDArray[np.uint8],
) -> None: ...
def decode_scaled(
    codes: npt.NDArray[np.uint16],
    scales: npt.NDArray[np.uint8],
    width: int,
    table: npt.NDArray[np.float32],
    out: npt.NDArray[np.float32],
) -> None: ...
