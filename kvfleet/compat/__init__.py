"""kvfleet.compat: the compatibility matrix (compat_matrix/) and its checker.

MatrixError          the matrix file is missing or fails its JSON Schema
Incompatibility      one reason an artifact/pool cannot be served (a value, not an error)
"""

from kvfleet.compat.check import (
    ENGINE_VERSION,
    DriverInfo,
    Incompatibility,
    check,
    minimum_cuda_and_driver,
)
from kvfleet.compat.matrix import Matrix, MatrixError, default_matrix, load_matrix, matrix_from_dict

__all__ = [
    "ENGINE_VERSION",
    "DriverInfo",
    "Incompatibility",
    "Matrix",
    "MatrixError",
    "check",
    "default_matrix",
    "load_matrix",
    "matrix_from_dict",
    "minimum_cuda_and_driver",
]
