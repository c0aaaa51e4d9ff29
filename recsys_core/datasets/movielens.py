"""MovieLens readers (TorchRec's ``torchrec.datasets.movielens``): rows of ``ratings.csv``,
optionally joined with ``movies.csv`` (title, genres) on movieId."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch.utils.data import IterDataPipe

from recsys_core.datasets.utils import LoadFiles, ReadLinesFromCSV, safe_cast

RATINGS_FILENAME = "ratings.csv"
MOVIES_FILENAME = "movies.csv"
DEFAULT_RATINGS_COLUMN_NAMES: list[str] = ["userId", "movieId", "rating", "timestamp"]
DEFAULT_MOVIES_COLUMN_NAMES: list[str] = ["movieId", "title", "genres"]
DEFAULT_COLUMN_NAMES: list[str] = DEFAULT_RATINGS_COLUMN_NAMES + DEFAULT_MOVIES_COLUMN_NAMES[1:]
COLUMN_TYPE_CASTERS: list[Callable[[Any], Any]] = [
    lambda v: safe_cast(v, int, 0),
    lambda v: safe_cast(v, int, 0),
    lambda v: safe_cast(v, float, 0.0),
    lambda v: safe_cast(v, int, 0),
    lambda v: safe_cast(v, str, ""),
    lambda v: safe_cast(v, str, ""),
]


def _default_row_mapper(example: list[str]) -> dict[str, float | int | str]:
    return {DEFAULT_COLUMN_NAMES[i]: COLUMN_TYPE_CASTERS[i](v) for i, v in enumerate(example)}


class _JoinMovies(IterDataPipe):
    def __init__(self, ratings: IterDataPipe, movies: dict[str, list[str]]) -> None:
        super().__init__()
        self.ratings = ratings
        self.movies = movies

    def __iter__(self):  # noqa: ANN204 - rows are lists of strings
        for row in self.ratings:
            if row[1] not in self.movies:
                raise KeyError(f"movieId {row[1]!r} of ratings row {row} is not in movies.csv")
            yield row + self.movies[row[1]]


def _movielens(
    root: str,
    *,
    include_movies_data: bool = False,
    row_mapper: Callable[[list[str]], Any] | None = _default_row_mapper,
    **open_kw: Any,
) -> IterDataPipe:
    ratings = LoadFiles((os.path.join(root, RATINGS_FILENAME),), mode="r", **open_kw)
    datapipe: IterDataPipe = ReadLinesFromCSV(ratings, skip_first_line=True, delimiter=",")
    if include_movies_data:
        movies_files = LoadFiles((os.path.join(root, MOVIES_FILENAME),), mode="r")
        movies = {
            row[0]: row[1:]
            for row in ReadLinesFromCSV(movies_files, skip_first_line=True, delimiter=",")
        }
        datapipe = _JoinMovies(datapipe, movies)
    if row_mapper:
        datapipe = datapipe.map(row_mapper)
    return datapipe


def movielens_20m(
    root: str,
    *,
    include_movies_data: bool = False,
    row_mapper: Callable[[list[str]], Any] | None = _default_row_mapper,
    **open_kw: Any,
) -> IterDataPipe:
    """MovieLens 20M from the directory holding ``ratings.csv`` (and ``movies.csv``)."""
    return _movielens(
        root, include_movies_data=include_movies_data, row_mapper=row_mapper, **open_kw
    )


def movielens_25m(
    root: str,
    *,
    include_movies_data: bool = False,
    row_mapper: Callable[[list[str]], Any] | None = _default_row_mapper,
    **open_kw: Any,
) -> IterDataPipe:
    """MovieLens 25M from the directory holding ``ratings.csv`` (and ``movies.csv``)."""
    return _movielens(
        root, include_movies_data=include_movies_data, row_mapper=row_mapper, **open_kw
    )


__all__ = ["DEFAULT_COLUMN_NAMES", "movielens_20m", "movielens_25m"]
