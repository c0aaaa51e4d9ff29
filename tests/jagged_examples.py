"""The hand-written jagged example the padding tests of ``sparse_ops.jagged_to_padded_dense`` and
``JaggedTensor.to_padded_dense`` share: six bags of 1.0 to 8.0, padded or truncated to two
columns with 10.0::

    bags [1, 2], [], [3], [4], [5], [6, 7, 8]  ->  [1, 2], [10, 10], [3, 10], [4, 10], [5, 10], [6, 7]
"""

from __future__ import annotations

SIX_BAGS_VALUES = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
SIX_BAGS_OFFSETS = [0, 2, 2, 3, 4, 5, 8]
SIX_BAGS_PADDED_TO_2_WITH_10 = [
    [1.0, 2.0],
    [10.0, 10.0],
    [3.0, 10.0],
    [4.0, 10.0],
    [5.0, 10.0],
    [6.0, 7.0],
]
"""The six bags to two columns, padding with 10.0 (the last bag loses its 8.0)."""
