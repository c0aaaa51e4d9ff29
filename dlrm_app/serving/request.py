"""Request parsing for ``dlrm-app serve``: JSON bodies -> validated model inputs.

The request formats are documented in :mod:`dlrm_app.serving.server`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from dlrm_app.data.criteo.format import (
    NUM_DENSE,
    NUM_SPARSE,
    decode_hex_fields,
    row_pattern,
    value_problem,
)


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# ---- inputs: parsed requests and how a batch of them runs -----------------------------------
class Inputs(Protocol):
    """One request's parsed rows, of a type that knows how to run a batch of its kind."""

    @property
    def rows(self) -> int: ...

    @staticmethod
    def predict(model: torch.jit.ScriptModule, parts: Sequence[Any]) -> torch.Tensor:
        """Probabilities ``[sum of rows]`` of ``parts`` (all of this type) in one call."""
        ...


@dataclasses.dataclass(frozen=True)
class RawRows:
    """Raw Criteo rows for ``predict_raw``."""

    dense_raw: np.ndarray  # [B, D] float32, NaN = missing
    cat_raw: np.ndarray  # [B, F] int64, missing = 0

    @property
    def rows(self) -> int:
        return len(self.dense_raw)

    @staticmethod
    def predict(model: torch.jit.ScriptModule, parts: Sequence[RawRows]) -> torch.Tensor:
        dense = np.concatenate([p.dense_raw for p in parts])
        cats = np.concatenate([p.cat_raw for p in parts])
        return model.predict_raw(torch.from_numpy(dense), torch.from_numpy(cats))


@dataclasses.dataclass(frozen=True)
class EncodedRows:
    """Encoded features for ``forward``.

    Two rows, one-hot ``cat_0`` and multi-hot ``cat_1``::

        values  = [array([3, 7]), array([1, 4, 5])]   # cat_0: rows 0, 1; cat_1: rows 0, 1
        lengths = [[1, 1],
                   [2, 1]]                           # cat_1: row 0 has ids 1, 4; row 1 id 5
    """

    dense: np.ndarray  # [B, D] float32, transformed
    values: list[np.ndarray]  # per feature: its ids of all B rows, row after row
    lengths: np.ndarray  # [F, B] int64: ids per (feature, row)

    @property
    def rows(self) -> int:
        return len(self.dense)

    @staticmethod
    def predict(model: torch.jit.ScriptModule, parts: Sequence[EncodedRows]) -> torch.Tensor:
        # key-major bags: feature 0's bags of every part, then feature 1's, ...
        num_features = len(parts[0].values)
        values = np.concatenate([p.values[f] for f in range(num_features) for p in parts])
        lengths = np.concatenate([p.lengths for p in parts], axis=1).reshape(-1)
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        dense = np.concatenate([p.dense for p in parts])
        return model.forward(torch.from_numpy(dense), torch.from_numpy(values.astype(np.int64)),
                             torch.from_numpy(offsets))


# ---- parsing (raw rows: the Criteo row format of dlrm_app.data.criteo.format) ----------------
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class RequestParser:
    """Turns a ``/predict`` JSON body into ``RawRows`` or ``EncodedRows`` for one model."""

    def __init__(self, metadata: dict[str, Any], max_rows: int) -> None:
        self.dense_names = list(metadata["dense_features"])
        self.sparse = list(metadata["sparse_features"])
        self.sparse_names = [f["name"] for f in self.sparse]
        # rows are Criteo text; other raw-input models (one-hot generated data) take instances
        self.accepts_rows = bool(metadata.get("raw_input")) and (
            metadata.get("raw_format") == "criteo_tsv")
        self.raw_format = metadata.get("raw_format")
        self.max_rows = max_rows
        counts = (len(self.dense_names), len(self.sparse))
        if self.accepts_rows and counts != (NUM_DENSE, NUM_SPARSE):
            raise ValueError(f"metadata says raw_format criteo_tsv but lists {counts[0]} dense "
                             f"and {counts[1]} sparse features, not {NUM_DENSE} and "
                             f"{NUM_SPARSE}; re-export the model")
        self._row = row_pattern()

    def parse(self, body: bytes) -> RawRows | EncodedRows:
        try:
            request = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(400, f"body is not valid JSON: {e}") from None
        except RecursionError:
            raise RequestError(400, "body is JSON nested too deeply") from None
        except ValueError as e:  # e.g. an integer of more than 4300 digits
            raise RequestError(400, f"body is not usable JSON: {str(e)[:100]}") from None
        if not isinstance(request, dict) or len({"rows", "instances"} & request.keys()) != 1:
            raise RequestError(400, 'expected a JSON object with exactly one of "rows" (raw '
                                    'lines) and "instances" (encoded features)')
        unknown = request.keys() - {"rows", "instances", "labeled"}
        if unknown:
            raise RequestError(400, f"unknown keys {sorted(unknown)}; expected \"rows\" (with an "
                                    f"optional \"labeled\") or \"instances\"")
        key = "rows" if "rows" in request else "instances"
        items = request[key]
        if not isinstance(items, list):
            raise RequestError(400, f'"{key}" must be a list, got {type(items).__name__}')
        if len(items) > self.max_rows:
            raise RequestError(413, f"{len(items)} {key}, at most {self.max_rows} per request; "
                                    f"split the request")
        if key == "instances":
            if "labeled" in request:
                raise RequestError(400, '"labeled" applies to "rows" only')
            return self.parse_instances(items)
        if not self.accepts_rows:
            raise RequestError(400, f'this model takes no raw Criteo rows (its raw_format is '
                                    f'{self.raw_format!r}); send "instances" with encoded '
                                    f'features')
        labeled = request.get("labeled", False)
        if not isinstance(labeled, bool):
            raise RequestError(400, f'"labeled" must be true or false, got {labeled!r}')
        return self.parse_rows(items, labeled)

    def parse_rows(self, rows: list[Any], labeled: bool = False) -> RawRows:
        d, f = len(self.dense_names), len(self.sparse)
        n = d + f
        padded = []
        for i, row in enumerate(rows):
            if not isinstance(row, str):
                raise RequestError(400, f"rows[{i}] is a {type(row).__name__}, expected a "
                                        f"string of tab-separated fields")
            text = row.rstrip("\r\n")
            if labeled:
                text = text.partition("\t")[2]
            count = text.count("\t") + 1
            if count > n:
                hint = ('; if rows start with a label, send "labeled": true' if
                        count == n + 1 and not labeled else "")
                raise RequestError(400, f"rows[{i}] has {count + labeled} tab-separated fields, "
                                        f"expected at most {n + labeled} ({'label, ' * labeled}"
                                        f"{d} integer, {f} categorical){hint}")
            text += "\t" * (n - count)
            if not self._row.fullmatch(text):
                raise RequestError(400, self._field_problem(i, text.split("\t"), labeled))
            padded.append(text)
        # the validated rows are ASCII: bytes fields convert faster than str ones
        fields = "\t".join(padded).encode("ascii").split(b"\t") if padded else []
        table = np.array(fields, dtype=bytes).reshape(len(padded), n)
        dense = table[:, :d]
        dense = np.where(dense == b"", b"nan", dense).astype(np.float64)
        big = np.abs(dense) >= 2.0**63
        if big.any():
            i, j = np.argwhere(big)[0]
            raise RequestError(400, f"rows[{i}] field {j + 1 + labeled} ({self.dense_names[j]})"
                                    f" = {table[i, j].decode()} is outside the 64-bit integer "
                                    f"range")
        return RawRows(dense.astype(np.float32), decode_hex_fields(table[:, d:]))

    def _field_problem(self, i: int, fields: list[str], labeled: bool) -> str:
        names = self.dense_names + self.sparse_names
        for j, value in enumerate(fields):
            if value and (problem := value_problem(j, value)):
                shown = value if len(value) <= 40 else value[:40] + "..."
                return f"rows[{i}] field {j + 1 + labeled} ({names[j]}) = {shown!r} {problem}"
        return f"rows[{i}] is not a valid row"

    def parse_instances(self, instances: list[Any]) -> EncodedRows:
        d, names = len(self.dense_names), self.sparse_names
        dense = np.zeros((len(instances), d), np.float32)
        values: list[list[int]] = [[] for _ in names]
        lengths = np.zeros((len(names), len(instances)), np.int64)
        for i, inst in enumerate(instances):
            if not isinstance(inst, dict) or inst.keys() != {"dense", "sparse"}:
                raise RequestError(400, f'instances[{i}] must be an object with exactly "dense" '
                                        f'and "sparse"')
            x, sparse = inst["dense"], inst["sparse"]
            if (not isinstance(x, list) or len(x) != d
                    or not all(isinstance(v, int | float) and not isinstance(v, bool)
                               and abs(v) <= _FLOAT32_MAX for v in x)):
                raise RequestError(400, f"instances[{i}].dense must be a list of {d} finite "
                                        f"float32 numbers ({', '.join(self.dense_names)})")
            dense[i] = x
            if not isinstance(sparse, dict) or sparse.keys() != set(names):
                have = set(sparse) if isinstance(sparse, dict) else set()
                raise RequestError(400, f"instances[{i}].sparse must map every sparse feature "
                                        f"to ids: missing {sorted(set(names) - have)}, unknown "
                                        f"{sorted(have - set(names))}")
            for k, feature in enumerate(self.sparse):
                ids = sparse[feature["name"]]
                ids = [ids] if isinstance(ids, int) and not isinstance(ids, bool) else ids
                size = feature["num_embeddings"]
                where = f"instances[{i}].sparse.{feature['name']}"
                if not isinstance(ids, list) or not all(
                        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < size
                        for v in ids):
                    raise RequestError(400, f"{where} must be an id or a list of ids in "
                                            f"[0, {size}), got {str(ids)[:60]}")
                if len(ids) != 1 and not feature.get("multi_hot", False):
                    raise RequestError(400, f"{where} is one-hot: send exactly one id, got "
                                            f"{len(ids)}")
                values[k] += ids
                lengths[k, i] = len(ids)
        return EncodedRows(dense, [np.array(v, np.int64) for v in values], lengths)
