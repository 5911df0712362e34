"""The numpy array types the engine's modules annotate with: one name per dtype."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["Float32Array", "Float64Array", "IntArray", "UInt8Array"]

Float32Array = npt.NDArray[np.float32]
Float64Array = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]
UInt8Array = npt.NDArray[np.uint8]
