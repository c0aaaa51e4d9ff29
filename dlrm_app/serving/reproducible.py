"""What makes one checkpoint's ``.pt2`` the same bytes at every export (users pin its digest).

Three things in a PT2 archive as torch writes it vary from one export to the next although the
model does not:

- the archive's top folder, which torch names after the file it was given (so the export
  writes it as ``archive.pt2`` and renames it: :data:`ARCHIVE_FILE`);
- the C++ sources AOTInductor packages beside the compiled library: each compile appends a
  ``// Compile cmd`` / ``// Link cmd`` comment to its cached copy, so the packaged source
  carries one such block per compile the inductor cache has seen (:func:`normalized_sources`
  packages them as generated, without those blocks; the library is packaged unchanged);
- ``.data/serialization_id``, 40 digits that torch's zip writer fills partly at random when it
  closes the archive (:func:`settle_serialization_id` replaces them by digits derived from the
  other records).

What still changes the bytes is what changes the compiled library: the CPU it was built for
(AOTInductor compiles with ``-march=native``), the compiler, torch's version and install path,
and the inductor cache directory's path (``TORCHINDUCTOR_CACHE_DIR``), which the library keeps
in its source file names and debug line tables (see ``docs/serving.md``).
"""

from __future__ import annotations

import hashlib
import re
import struct
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

ARCHIVE_FILE = "archive.pt2"
"""The name a .pt2 is written under before it is renamed to ``--out``: torch names the archive's
top folder after its file (``archive/``, as torch names the archives it writes to a buffer)."""

SERIALIZATION_ID = ".data/serialization_id"

_BUILD_COMMENTS = re.compile(r"(?:\n// Compile cmd\n// [^\n]*\n// Link cmd\n// [^\n]*\n)+\Z")
"""The blocks AOTInductor appends to a cached source each time it compiles it."""


def normalized_sources(files: Sequence[object], folder: Path) -> list[object]:
    """``files`` (what ``torch._inductor.aot_compile`` returned) with each C++ source replaced
    by a copy in ``folder``, same name, without the compile/link comments appended to it;
    the library and other entries are kept as they are."""
    folder.mkdir(parents=True, exist_ok=True)
    kept: list[object] = []
    for file in files:
        if isinstance(file, str) and file.endswith(".cpp"):
            copy = folder / Path(file).name
            text = Path(file).read_text()
            copy.write_text(_BUILD_COMMENTS.sub("", text))
            kept.append(str(copy))
        else:
            kept.append(file)
    return kept


def settle_serialization_id(path: Path) -> str:
    """Replace the archive's ``.data/serialization_id`` (random in part) by 40 digits of the
    sha256 of every other record (names and bytes), in place: the record is stored
    uncompressed, so only its 40 bytes and its CRC-32 (central directory, and the local header
    or data descriptor that holds it) change; the layout torch's loaders read is untouched.
    Returns the new id."""
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
        found = [i for i in infos if i.filename.split("/", 1)[-1] == SERIALIZATION_ID]
        if len(found) != 1 or found[0].compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"{path}: expected one stored {SERIALIZATION_ID} record, as "
                             f"torch's zip writer leaves it")
        record = found[0]
        content = hashlib.sha256()
        for info in infos:
            if info is not record:
                content.update(info.filename.encode() + b"\0")
                content.update(struct.pack("<Q", info.file_size))
                with archive.open(info) as data:
                    for block in iter(lambda: data.read(1 << 20), b""):
                        content.update(block)
        new = f"{int(content.hexdigest(), 16) % 10**40:040d}".encode()
        if len(new) != record.file_size:
            raise ValueError(f"{path}: {SERIALIZATION_ID} holds {record.file_size} bytes, "
                             f"not the 40 digits torch writes")
        old_crc, new_crc = record.CRC, zlib.crc32(new)
        central = archive.start_dir
    with open(path, "r+b") as f:
        f.seek(record.header_offset)
        (signature, _, flags, _, _, _, local_crc, _, _, name_length,
         extra_length) = struct.unpack("<IHHHHHIIIHH", f.read(30))
        if signature != 0x04034B50:
            raise ValueError(f"{path}: no local header where {SERIALIZATION_ID}'s should be")
        data_at = record.header_offset + 30 + name_length + extra_length
        f.seek(data_at)
        f.write(new)
        if local_crc == old_crc:  # a descriptor-less record keeps its CRC here (else 0)
            f.seek(record.header_offset + 14)
            f.write(struct.pack("<I", new_crc))
        if flags & 0x8:  # a data descriptor follows the data: [signature] crc sizes
            f.seek(data_at + record.compress_size)
            first = f.read(4)
            at = data_at + record.compress_size + (4 if first == b"PK\x07\x08" else 0)
            f.seek(at)
            if struct.unpack("<I", f.read(4))[0] != old_crc:
                raise ValueError(f"{path}: {SERIALIZATION_ID}'s data descriptor does not hold "
                                 f"its CRC")
            f.seek(at)
            f.write(struct.pack("<I", new_crc))
        _patch_central_crc(f, central, record.orig_filename.encode("utf-8"), new_crc)
    return new.decode()


def _patch_central_crc(f: BinaryIO, offset: int, name: bytes, crc: int) -> None:
    """Set the CRC-32 of the central directory entry named ``name`` (the directory starts at
    ``offset``)."""
    while True:
        f.seek(offset)
        header = f.read(46)
        if len(header) < 46 or header[:4] != b"PK\x01\x02":
            raise ValueError(f"no central directory entry for {name.decode()}")
        name_length, extra_length, comment_length = struct.unpack("<HHH", header[28:34])
        if f.read(name_length) == name:
            f.seek(offset + 16)
            f.write(struct.pack("<I", crc))
            return
        offset += 46 + name_length + extra_length + comment_length
