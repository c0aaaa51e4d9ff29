"""Criteo 1TB's per-feature cardinalities, for the benches that size tables like it (planner,
train, scale, publish); a module of its own so that a bench imports them without torch."""

CRITEO_1TB_ROWS = [
    45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10, 2209,
    11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35,
]
"""The 26 categorical features of Criteo 1TB (24 days), as TorchRec's DLRM example sizes them."""
